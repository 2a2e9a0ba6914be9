"""benchmarks/contention.py runs end to end on the shipped pair: a burst is asked for at every step's chosen point (a
hook that never fired would report every setting as costing nothing), and each setting is reported against none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "contention.py"


def test_the_contention_benchmark_bursts_at_every_step(tmp_path: Path) -> None:
    out = tmp_path / "contention.json"
    command = [sys.executable, str(SCRIPT), "--sequences", "2", "--requests", "4", "--rounds", "1"]
    command += ["--burst-us", "0", "200", "--at", "draft", "pass", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["burst_us"], r["at"]) for r in rows] == [(0, "-"), (200, "draft"), (200, "pass")]
    none, *burst = rows
    assert none["rounds"][0]["bursts"] == 0 and none["vs_none"] == 1.0 and none["exchange_rate"] is None
    for r in burst:
        (run,) = r["rounds"]
        # one burst a step: 4 requests of 64 tokens take more than a few steps, and fewer than one a token
        assert 4 <= run["bursts"] <= 4 * 64, r
        assert r["tokens_per_s"] > 0 and r["vs_none"] > 0 and r["cpu_share"] > 0
        assert isinstance(r["exchange_rate"], float)
    assert "exchange rate" in proc.stdout


def test_the_contention_benchmark_refuses_bad_settings() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--requests", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--requests" in proc.stderr and "Traceback" not in proc.stderr
