"""diagnose: each planted fault is named first; a healthy trace gets no warning; the real engine with a useless draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.diagnose import diagnose
from specdec.diagnose.synthetic import write_synthetic_trace
from specdec.trace import read_trace

PLANTED = {
    "long_prompt": "long_prompt_collapse",
    "serial_verify": "serial_verify",
    "slow_draft": "draft_too_slow",
    "weak_draft": "draft_too_weak",
    "host_overhead": "host_overhead",
    "inconsistent": "inconsistent_trace",
    "accept_all": "implausible_acceptance",
}


@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
@pytest.mark.parametrize("fault", sorted(PLANTED))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planted_fault_is_named_first(tmp_path: Path, fault: str, seed: int, greedy: bool) -> None:
    d = diagnose(write_synthetic_trace(tmp_path / "t.jsonl", fault, seed=seed, greedy=greedy))
    assert d.top is not None, d.text()
    assert d.top.code == PLANTED[fault], d.text()
    assert d.top.evidence and d.top.action


@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_healthy_trace_raises_nothing_alarming(tmp_path: Path, seed: int, greedy: bool) -> None:
    d = diagnose(write_synthetic_trace(tmp_path / "t.jsonl", "healthy", seed=seed, greedy=greedy))
    assert d.problems == [], d.text()
    assert "no problems found" in d.text()


def _rewrite(path: Path, edit: callable) -> None:  # type: ignore[valid-type]
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(x)) + "\n" for x in lines))


def test_n_accepted_disagreeing_with_the_flags_is_flagged(tmp_path: Path) -> None:
    path = write_synthetic_trace(tmp_path / "t.jsonl", "healthy", seed=5)
    done = []

    def edit(x: dict) -> dict:
        if x["type"] == "step" and x["request_id"] == "req3" and x["step"] == 7 and not done:
            x["n_accepted"] = x["tau"]  # claims everything was accepted; flags say otherwise (or τ=0 ...)
            x["accept_flags"] = [False] * x["tau"]
            done.append(1)
        return x

    _rewrite(path, edit)
    d = diagnose(path)
    if d.trace.requests[3].steps[7].tau == 0:
        pytest.skip("step drew τ = 0")
    assert d.top is not None and d.top.code == "inconsistent_trace"
    assert "request req3 step 7" in " ".join(d.top.evidence)


def test_cli_text_json_and_self_contained_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specdec.cli import main

    path = write_synthetic_trace(tmp_path / "t.jsonl", "slow_draft", seed=0)
    html = tmp_path / "r.html"
    assert main(["diagnose", str(path), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "1. [CRITICAL] Draft too slow" in out and "→" in out
    page = html.read_text()
    assert page.count("<svg") == 6 and "draft_too_slow" in page
    assert "<script" not in page and "https://" not in page and "src=" not in page  # nothing fetched
    assert main(["diagnose", str(path), "--json", "--strict"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["healthy"] is False and data["findings"][0]["code"] == "draft_too_slow"


def test_cli_bad_trace_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specdec.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["diagnose", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error:") and "no step or request lines" in err and "\n" not in err


def test_real_engine_with_a_useless_draft(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Random target, unrelated random draft: the draft never predicts the target, diagnose must say so."""
    import specdec

    path = tmp_path / "real.jsonl"
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], tau=4, trace=path)
    for prompt in ["def fibonacci(n):", "import os, sys", "class Stack:"]:
        engine.generate(prompt, max_new_tokens=32)
    engine.observers[-1].close()  # type: ignore[attr-defined]
    d = diagnose(read_trace(path))
    assert d.stats.alpha < 0.2, d.text()
    assert d.top is not None and d.top.code == "draft_too_weak", d.text()
    assert "τ=0" in d.top.action
