"""benchmarks/join_latency.py runs end to end on the shipped pair (a few requests per setting): its report has both
prefill settings for each prompt set, and the prompt budget's runs took prompts in through the steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "join_latency.py"


def test_the_join_latency_benchmark_reports_both_settings(tmp_path: Path) -> None:
    out = tmp_path / "join.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sequences", "2", "--requests", "3", "--rounds", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["sequences"] == 2 and len(report["sets"]) == 3
    for runs in report["sets"].values():
        assert [r["prefill_in_step"] for r in runs] == [0, 256]
        assert all(r["tokens_per_s"] > 0 and r["steps"] > 0 for r in runs)
