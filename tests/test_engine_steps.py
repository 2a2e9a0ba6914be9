"""benchmarks/engine_steps.py runs end to end on the shipped pair (a few requests per policy): each policy's steps
split into the kernel's calls and the rest, and the kernel's calls were timed (a wrapper that saw none would report
every step as all Python)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_steps.py"


def test_the_engine_steps_benchmark_splits_each_step(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    command = [sys.executable, str(SCRIPT), "--sequences", "1", "3", "--policies", "fixed:tau=0", "adaptive"]
    command += ["--requests", "4", "--rounds", "1", "--json", str(out), "--by-depth"]
    prompts = tmp_path / "prompts.jsonl"  # prompts of one's own (--prompts), as the load test takes them
    prompts.write_text('"The history of bridges"\n{"prompt": "A short story about a lost key:"}\n')
    command += ["--prompts", str(prompts)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["sequences"], r["policy"]) for r in rows] == [
        (1, "fixed:tau=0"),
        (1, "adaptive"),
        (3, "fixed:tau=0"),
        (3, "adaptive"),
    ]
    for r in rows:
        assert r["tokens_per_s"] > 0
        assert 0 < r["native_ms_per_step"] < r["ms_per_step"]
        assert abs(r["native_ms_per_step"] + r["rest_ms_per_step"] - r["ms_per_step"]) < 1e-6
        # the kernel's time by runner: every target pass is the target's; plain steps run no draft forward
        assert r["target_ms_per_step"] > 0
    for r in rows:
        (run,) = r["rounds"]  # one round: its split adds up to its kernel time exactly
        assert run["target_ms_per_step"] + run["draft_ms_per_step"] == pytest.approx(run["native_ms_per_step"])
        assert (run["draft_ms_per_step"] > 0) == (r["policy"] == "adaptive"), r["policy"]
    assert "| 3 | adaptive |" in proc.stdout
    # Every step that made tokens is in one depth's row: the depths' tokens add up to the run's (one round), their
    # seconds to the steps' share of it.
    for r in rows:
        (run,) = r["rounds"]
        steps, tokens, seconds, native = (sum(d[i] for d in r["by_depth"].values()) for i in range(4))
        assert 0 < steps <= run["steps"]
        wall = run["steps"] * run["ms_per_step"] * 1e-3
        assert tokens == pytest.approx(run["tokens_per_s"] * wall, rel=1e-6)
        assert 0 < native < seconds <= wall * (1 + 1e-9)
    assert "| 3 | fixed:tau=0 | 0 |" in proc.stdout  # plain steps are depth 0


def test_interleaved_policies_each_keep_their_own_loop_and_are_compared_by_chunk(tmp_path: Path) -> None:
    """``--interleave``: the policies' loops stepped in turn, each its own requests and figures, and the policy that is
    not fixed held to the best fixed one over the rounds, round by round and by chunk."""
    out = tmp_path / "steps.json"
    command = [sys.executable, str(SCRIPT), "--interleave", "--sequences", "3", "--requests", "8", "--rounds", "2"]
    command += ["--policies", "fixed:tau=0", "fixed:tau=2", "adaptive", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["interleave"] is True
    rows = report["rows"]
    assert [r["policy"] for r in rows] == ["fixed:tau=0", "fixed:tau=2", "adaptive"]
    for r in rows:
        assert len(r["rounds"]) == 2
        for run in r["rounds"]:
            assert run["tokens_per_s"] > 0 and len(run["chunk_tokens_per_s"]) == 4
            assert (run["draft_ms_per_step"] > 0) == (r["policy"] != "fixed:tau=0"), r["policy"]
    (standing,) = report["standing"]
    assert standing["policy"] == "adaptive" and standing["best_fixed"] in ("fixed:tau=0", "fixed:tau=2")
    assert len(standing["rounds"]) == 2 and len(standing["chunks"]) == 8
    best = [r for r in rows if r["policy"] == standing["best_fixed"]][0]
    for ratio, run, other in zip(standing["rounds"], rows[2]["rounds"], best["rounds"]):
        assert ratio <= run["tokens_per_s"] / other["tokens_per_s"] + 1e-9
    assert "3 sequences, interleaved: adaptive ÷ the best fixed policy" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "fixed:tau=2", "fixed:2"], "--policies: bad policy option '2' in 'fixed:2'"),
        (
            ["--interleave", "--policies", "fixed:tau=2", "adaptive+trace"],
            "--interleave: a policy named NAME+trace runs only without it",
        ),
        (["--prompts", "/nonexistent/prompts.jsonl"], "prompt file not found: /nonexistent/prompts.jsonl"),
        (["--prefill-in-step", "-1"], "--prefill-in-step must be 0 or more, not -1"),
        (["--policies", "fixed:tau=0+chain0"], "--policies: fixed:tau=0+chain0: a chain of at least 1 target pass"),
    ],
)
def test_bad_arguments_are_one_line_before_the_models_load(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_rest_of_a_step_is_split_by_part(tmp_path: Path) -> None:
    """``--breakdown``: the engine's Python around the kernel's calls by part, the draft's and the verification's
    without their kernel calls (each call timed whole holds them: subtracted, never below 0), every part seen."""
    out = tmp_path / "steps.json"
    command = [sys.executable, str(SCRIPT), "--sequences", "3", "--policies", "fixed:tau=2", "--requests", "6"]
    command += ["--rounds", "1", "--json", str(out), "--breakdown"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    us = row["breakdown_us_per_step"]
    assert set(us) == {"plan", "draft", "verify", "contexts", "commit", "detokenise", "close", "starts", "other"}
    assert all(us[part] > 0 for part in ("plan", "draft", "verify", "contexts", "commit", "detokenise", "close"))
    assert sum(us.values()) == pytest.approx(1e3 * row["rest_ms_per_step"], rel=1e-6)
    assert "| 3 | fixed:tau=2 |" in proc.stdout.split("The rest by part")[1]


def test_a_policy_named_with_a_chain_runs_its_plain_steps_chained(tmp_path: Path) -> None:
    """``NAME+chainN``: the loop's plain steps chain up to N target passes (``Engine.chain_plain``), each step then
    making several tokens a sequence; the other loops step one pass at a time."""
    out = tmp_path / "steps.json"
    command = [sys.executable, str(SCRIPT), "--interleave", "--sequences", "3", "--requests", "6", "--rounds", "1"]
    command += ["--policies", "fixed:tau=0", "fixed:tau=0+chain4", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain, chained = json.loads(out.read_text())["rows"]
    assert (plain["policy"], chained["policy"]) == ("fixed:tau=0", "fixed:tau=0+chain4")
    # the same 6 requests of 64 tokens: a chained step takes several passes, so far fewer steps
    (a,), (b,) = plain["rounds"], chained["rounds"]
    assert b["steps"] * 2 < a["steps"]
    assert b["target_ms_per_step"] > 2 * a["target_ms_per_step"]
