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
    # Several traces (a fleet's replicas) read as one.
    other = write_synthetic_trace(tmp_path / "u.jsonl", "slow_draft", seed=1)
    assert main(["diagnose", str(path), str(other), "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["trace"] == f"{path}, {other}" and both["findings"][0]["code"] == "draft_too_slow"
    n = diagnose(path).stats.n_requests + diagnose(other).stats.n_requests
    assert both["requests"] == n, both


def test_cli_bad_trace_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specdec.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["diagnose", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error:") and "no step or request lines" in err and "\n" not in err


def test_real_engine_with_a_useless_draft(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Random target, unrelated random draft: the draft never predicts the target, diagnose must say so (as a critical
    finding; with a target pass of ~0.04 ms the engine's own per-step work, the trace's writing included, may weigh
    more and come first)."""
    import specdec

    path = tmp_path / "real.jsonl"
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], tau=4, trace=path)
    for prompt in ["def fibonacci(n):", "import os, sys", "class Stack:"]:
        engine.generate(prompt, max_new_tokens=32)
    engine.observers[-1].close()  # type: ignore[attr-defined]
    d = diagnose(read_trace(path))
    assert d.stats.alpha < 0.2, d.text()
    weak = next((f for f in d.findings if f.code == "draft_too_weak"), None)
    assert weak is not None and weak.severity == "critical", d.text()
    assert "τ=0" in weak.action
    assert d.top is not None and d.top.code in ("draft_too_weak", "host_overhead"), d.text()


def _batched_trace(
    path: Path,
    depths: dict[int, tuple[int, float]],
    sequences: int = 4,
    others: tuple[tuple[str, dict[int, tuple[int, float]], float], ...] = (),
    rest: float = 0.0,
) -> Path:
    """A batching server's trace: for each depth, (steps, seconds a step) of ``sequences`` sequences, every draft
    accepted (each record emits depth + 1 tokens; too good to be true for the acceptance check, which is not what
    these tests read); each record carries its step's whole pass and draft times, ``rest`` seconds of them the rest of
    the step. ``others``: more steps after those, each (policy, depths, rest), as a load test's modes follow the
    policy's on one server."""
    from specdec.records import StepRecord
    from specdec.trace import JsonlTrace

    with JsonlTrace(path, meta={"synthetic": "batched"}) as trace:
        step = 0
        for policy, segment, rest_s in (("adaptive", depths, rest), *others):
            context = [20] * sequences
            for depth, (count, seconds) in segment.items():
                for _ in range(count):
                    step += 1
                    for i in range(sequences):
                        context[i] += depth + 1
                        trace.on_step(
                            StepRecord(
                                request_id=f"{policy}{i}",
                                step=step - 1,
                                prompt_len=20,
                                context_len=context[i] - depth - 1,
                                policy=policy,
                                reason="batch",
                                tau=depth,
                                draft_tokens=[5] * depth,
                                accept_flags=[True] * depth,
                                n_accepted=depth,
                                correction="bonus" if depth else "plain",
                                emitted=[5] * (depth + 1),
                                draft_time=0.2 * (seconds - rest_s),
                                verify_time=0.8 * (seconds - rest_s) + step * 1e-9,  # a step's records share it alone
                                other_time=rest_s + 1e-4 * i,  # the step's rest: the least, ``rest_s``
                                batch_size=sequences,
                                rows=sequences * (depth + 1),
                                drafting=sequences if depth else 0,
                                draft_passes=depth,
                            )
                        )
    return path


def test_a_batching_servers_trace_is_read_by_its_steps_depths(tmp_path: Path) -> None:
    """Batched steps' times are their whole batch's: the one-sequence cost checks stay silent on them (a pass of 4 × 4
    rows read as a 4-token block looked like serial verification), and the goodput of each depth at the batch size
    most steps ran is compared instead. Depth 2: 60 steps of 4 sequences, 12 tokens in 4.0 ms (3.0 tokens/ms);
    depth 3: 30 steps, 16 tokens in 4.2 ms (3.81): the trace ran mostly at the depth that served 21% less."""
    d = diagnose(_batched_trace(tmp_path / "b.jsonl", {2: (60, 4.0e-3), 3: (30, 4.2e-3)}))
    codes = {f.code for f in d.findings}
    assert not codes & {"serial_verify", "host_overhead", "draft_too_slow", "draft_too_weak", "tau_suboptimal"}
    f = next(f for f in d.findings if f.code == "batch_depths")
    assert f.severity == "warning" and "depth 2, which served 21% less than depth 3" in f.title, f.title
    assert "depth 2 3.00 tokens/ms over 60 steps" in f.evidence[0] and "depth 3 3.81 tokens/ms" in f.evidence[0]
    from specdec.diagnose.html import render_html

    assert "Batched steps of 4: goodput by depth" in render_html(d)  # and the report plots it
    # The most run depth served best: a line of information only.
    ok = diagnose(_batched_trace(tmp_path / "ok.jsonl", {2: (60, 3.0e-3), 3: (30, 4.2e-3)}))
    f = next(f for f in ok.findings if f.code == "batch_depths")
    assert f.severity == "info" and "most run (depth 2)" in f.title
    assert not {p.code for p in ok.problems} & {"serial_verify", "host_overhead", "draft_too_slow", "tau_suboptimal"}


def test_a_policys_batched_steps_are_held_against_a_fixed_taus_at_the_same_depth(tmp_path: Path) -> None:
    """A load test's trace holds the policy's steps and a fixed τ's on one server. At the same depth (3, batches of 4,
    16 tokens a step) the policy's steps took 4.5 ms with 0.7 ms of rest, the fixed τ's 4.2 ms with 0.4: the policy
    served 7% less, and the gap is in the rest of its steps (its own work), not in its tokens or passes. Its depths
    are read for themselves too (one finding of each kind), and the fixed τ's depth 0 (plain mode) is not taken for
    a depth it chose."""
    fixed = ("fixed", {0: (100, 1.5e-3), 3: (60, 4.2e-3)}, 0.4e-3)
    d = diagnose(
        _batched_trace(tmp_path / "ab.jsonl", {2: (20, 3.4e-3), 3: (60, 4.5e-3)}, others=(fixed,), rest=0.7e-3)
    )
    f = next(f for f in d.findings if f.code == "batch_beside_fixed")
    assert f.severity == "warning" and "served 7% less than a fixed τ's" in f.title, f.title
    assert "rest of its steps took 0.300 ms longer" in f.title, f.title
    assert "depth 3: adaptive 3.56 tokens/ms over 60 steps" in f.evidence[0], f.evidence
    assert "fixed τ 3.81 over 60" in f.evidence[0], f.evidence
    depths = next(f for f in d.findings if f.code == "batch_depths")
    assert "(adaptive)" in depths.title and "depth 0" not in depths.evidence[0], depths
    from specdec.diagnose.html import render_html

    assert "adaptive 3 (60)" in render_html(d) and "fixed 0 (100)" in render_html(d)  # both policies' bars
    # The same steps at the same cost: a line of information.
    same = ("fixed", {3: (60, 4.4e-3)}, 0.0)
    ok = diagnose(_batched_trace(tmp_path / "same.jsonl", {3: (60, 4.4e-3)}, others=(same,)))
    f = next(f for f in ok.findings if f.code == "batch_beside_fixed")
    assert f.severity == "info" and "1.00x a fixed τ's" in f.title, f.title


def test_host_overhead_says_how_much_of_it_was_the_policys_own_work(tmp_path: Path) -> None:
    """Records carry the policy's own work within their rest (``policy_time``): where the rest dominates, the finding
    says how much of the step time was the policy's; traces written before the field (0) say nothing of it."""
    path = write_synthetic_trace(tmp_path / "t.jsonl", "host_overhead", seed=0)
    before = next(f for f in diagnose(path).findings if f.code == "host_overhead")
    assert not any("policy's own work" in e for e in before.evidence)

    def edit(x: dict) -> dict:
        if x["type"] == "step":
            x["policy_time"] = 0.5 * x["other_time"]
        return x

    _rewrite(path, edit)
    records = [r for r in read_trace(path).steps]
    total = sum(r.draft_time + r.verify_time + r.other_time for r in records)
    share = sum(r.policy_time for r in records) / total
    after = next(f for f in diagnose(path).findings if f.code == "host_overhead")
    assert f"of it, the policy's own work (its plans and learning) {share:.0%} of step time" in after.evidence


def test_steps_drafted_from_a_prediction_are_left_out_of_the_drafters_analysis(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """An exact predicted output is accepted whole: read as the drafter's, it would look like implausibly high
    acceptance. Diagnose analyses the drafter's steps and says how many predicted ones it left out."""
    import specdec

    path = tmp_path / "pred.jsonl"
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], tau=3, trace=path)
    engine.eos_ids = frozenset()
    for prompt in ("def f(x):", "class A:", "import os", "x = [", "while True:", "for i in range(10):"):
        want = engine.generate(prompt, max_new_tokens=48, tau=0).token_ids
        engine.generate(prompt, max_new_tokens=48, prediction=want)
    engine.observers[-1].close()  # type: ignore[attr-defined]
    d = diagnose(path)
    predicted = sum(1 for s in read_trace(path).steps if s.reason == "prediction")
    assert predicted > 0 and d.stats.predicted_steps == predicted
    assert len(d.stats.steps) == len(read_trace(path).steps) - predicted
    assert "implausible_acceptance" not in {f.code for f in d.findings}
    assert f"note: {predicted} step(s) that drafted from requests' predicted outputs" in d.text()
    assert d.to_json()["predicted_steps"] == predicted
