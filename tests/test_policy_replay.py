"""benchmarks/policy_replay.py: a recording of what the engine told the adaptive policy replays into a fresh policy
with every answer the same (the policy is deterministic in its inputs), and a changed answer is caught."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "policy_replay.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_a_recording_replays_with_every_answer_the_same_and_a_changed_one_is_caught(tmp_path: Path) -> None:
    calls = tmp_path / "calls.pkl"
    recorded = run("record", str(calls), "--runs", "3:6", "4:6:2")
    assert recorded.returncode == 0, recorded.stderr[-2000:]
    saved = pickle.loads(calls.read_bytes())
    names = [name for name, _, _ in saved["calls"]]
    # batch plans (3 sequences a step; 4 rotating two at a time), their steps learnt from, requests begun and ended
    assert {"plan", "observe_step", "begin", "end"} <= set(names) and names.count("plan") >= 6
    replayed = run("replay", str(calls), "--repeat", "2")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr[-2000:]
    assert f"replayed {len(names)} calls: 0 answers differed" in replayed.stdout

    # One decision's τ changed in the recording: the replay answers otherwise, and says so.
    i = next(i for i, (name, _, want) in enumerate(saved["calls"]) if name == "plan" and want)
    name, blob, want = saved["calls"][i]
    tau, reason, rule = want[0]
    saved["calls"][i] = (name, blob, [(tau + 1, reason, rule), *want[1:]])
    calls.write_bytes(pickle.dumps(saved))
    changed = run("replay", str(calls))
    assert changed.returncode == 1 and "1 answers differed" in changed.stdout and f"call {i} (plan)" in changed.stdout


def test_bad_runs_and_a_missing_recording_are_one_line_errors(tmp_path: Path) -> None:
    bad = run("record", str(tmp_path / "x.pkl"), "--runs", "4:abc")
    assert bad.returncode == 2 and "--runs" in bad.stderr and "Traceback" not in bad.stderr
    missing = run("replay", str(tmp_path / "none.pkl"))
    assert missing.returncode == 2 and "no recording" in missing.stderr and "Traceback" not in missing.stderr
