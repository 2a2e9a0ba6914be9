"""audit: passes on the real engine, fails (naming the position) on a deliberately broken acceptance rule.

The broken engines are made here only, by replacing the verify functions of the engine's target side
(``specdec.verifier``) with ones that accept every draft token. The sampling audit is a chi-square test at false-failure rate 1e-3 with
fixed seeds (0..149), so its outcome here is deterministic.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import specdec
import specdec.verifier as verifier_mod
from specdec.audit import audit_greedy, audit_sampling
from specdec.engine import Engine
from specdec.runtime.native import NativeRunner
from specdec.verify import SampledBlock, Verdict, verdicts_with_uniforms

PROMPTS = ["def fibonacci(n):", "import os, sys"]


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Engine:
    return specdec.load(tiny_models["llama"], tiny_models["draft"], tau=3)


def _accept_all_greedy(draft_tokens: list[int], best: list[int]) -> Verdict:
    """In place of ``verdict_greedy`` (the draft tokens, the target's argmax at each row): accepts every token."""
    tau = len(draft_tokens)
    return Verdict([True] * tau, tau, [*draft_tokens, best[tau]], "bonus" if tau else "plain", [], [])


def _accept_all_sampling(blocks: list[SampledBlock]) -> list[Verdict]:
    """In place of ``verify_blocks``: r = 0 passes r·q ≤ p for every token the target allows."""
    return verdicts_with_uniforms(blocks, [torch.zeros(len(b.draft_tokens)) for b in blocks])


@pytest.fixture
def broken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verifier_mod, "verdict_greedy", _accept_all_greedy)
    monkeypatch.setattr(verifier_mod, "verify_blocks", _accept_all_sampling)
    # the CPU kernel's own verdicts (temperature-only requests) left out, so the broken rule above decides them too
    monkeypatch.setattr(NativeRunner, "sampled_verdict", lambda *args, **kwargs: None)


@pytest.mark.identity
def test_greedy_audit_passes_on_the_real_engine(engine: Engine) -> None:
    result = audit_greedy(engine, PROMPTS, max_new_tokens=24)
    assert result.ok, result.text()
    assert result.tokens_compared > 0 and result.text().startswith("PASS")


@pytest.mark.identity
def test_greedy_audit_names_the_first_divergence_of_a_broken_engine(engine: Engine, broken: None) -> None:
    result = audit_greedy(engine, PROMPTS, max_new_tokens=24)
    assert not result.ok
    d = result.divergences[0]
    ref = engine.generate(PROMPTS[d.prompt_index], max_new_tokens=24, tau=0).token_ids
    bad = engine.generate(PROMPTS[d.prompt_index], max_new_tokens=24).token_ids
    first = next(i for i, (a, b) in enumerate(zip(ref, bad)) if a != b)
    assert (d.position, d.expected, d.got) == (first, ref[first], bad[first])
    assert f"first divergence at generated position {first}" in result.text()


BATCH_PROMPTS = [*PROMPTS, "class Node:\n    def __init__(self, value):\n", "x", "for i in range(10):\n    print("]


@pytest.fixture
def company_dependent(engine: Engine) -> Iterator[None]:
    """A target pass whose rows depend on their company: with more than one sequence in it, every block but the
    first gets token 7's logit raised far above the rest. Alone, each block is computed exactly."""
    runner = engine.target
    assert runner.batches, "the tiny checkpoints should run on the CPU kernel, which batches"
    honest = runner.forward_blocks

    def leaky(blocks: Any, keep: Sequence[int], argmax_only: bool = False) -> torch.Tensor:
        logits = honest(blocks, keep)  # every logit, argmax_only or not: the leak is in them
        if len(blocks) > 1:  # other logits than the pass computed (a new tensor: the pass's own argmax is of its own)
            logits = logits.clone()
            logits[keep[0] :, 7] += 1e4
        return logits

    runner.forward_blocks = leaky  # type: ignore[method-assign]
    try:
        yield
    finally:
        runner.forward_blocks = honest  # type: ignore[method-assign]


@pytest.mark.identity
def test_batched_greedy_audit_passes_and_says_what_shared_a_pass(engine: Engine) -> None:
    result = audit_greedy(engine, BATCH_PROMPTS, max_new_tokens=[24, 30, 12, 40, 18], batch=4, seed=3)
    assert result.ok, result.text()
    assert result.batch == 4 and 2 <= result.max_sequences <= 4 and result.shared_steps > 0
    assert result.max_rows > result.max_sequences  # the sequences drafted: ragged blocks in one pass
    assert "served up to 4 at a time" in result.text() and result.to_json()["shared_steps"] == result.shared_steps
    assert "each prompt prefilled in a pass of its own" in result.text()


@pytest.mark.identity
def test_batched_greedy_audit_catches_a_row_that_depends_on_its_company(
    engine: Engine, company_dependent: None
) -> None:
    """The solo audit cannot see this fault; the batched one names the step and its company."""
    assert audit_greedy(engine, BATCH_PROMPTS, max_new_tokens=16).ok
    result = audit_greedy(engine, BATCH_PROMPTS, max_new_tokens=16, batch=3, seed=0)
    assert not result.ok
    d = result.divergences[0]
    assert d.got == 7 and d.expected != 7
    assert d.step is not None and d.sequences is not None and d.sequences > 1
    assert f"(step {d.step}, its pass shared by {d.sequences} sequence(s), {d.rows} rows)" in result.text()


@pytest.mark.identity
def test_a_replay_shorter_than_its_min_tokens_is_compared(engine: Engine) -> None:
    """A served output a stop string cut before its ``min_tokens``: compared over its length (EOS masked there either
    way) instead of refused as a request whose min_tokens exceeds max_new_tokens."""
    out = engine.generate(PROMPTS[0], max_new_tokens=6, tau=0, min_tokens=6).token_ids
    result = audit_greedy(engine, PROMPTS[:1], max_new_tokens=[6], recorded=[out], request_kwargs=[{"min_tokens": 20}])
    assert result.ok and result.tokens_compared == 6, result.text()


def test_batched_audits_refuse_what_they_cannot_do(engine: Engine) -> None:
    with pytest.raises(ValueError, match="batch must be >= 1"):
        audit_greedy(engine, PROMPTS, batch=0)
    with pytest.raises(ValueError, match="recorded outputs"):
        audit_greedy(engine, PROMPTS, recorded=[[1], [2]], batch=2)


@pytest.mark.distribution
def test_batched_sampling_audit_passes_on_the_real_engine(engine: Engine) -> None:
    """Two prompts' 150 runs each (seeds 0..149) served up to 12 at a time through shared steps: the same tests at
    the same false-failure rate as alone (≤ 1e-3; fixed seeds and order, so deterministic)."""
    result = audit_sampling(engine, PROMPTS, temperature=1.0, runs=150, positions=2, seed=0, batch=12)
    assert result.max_sequences == 12 and result.shared_steps > 0.9 * result.steps
    assert result.tests and result.ok, result.text()


# Token 5 pushed up at position 1 (a group of runs shares it), then penalised at position 2 for having been generated.
SAMPLING_RULES = dict(logit_bias={5: 6.0}, presence_penalty=2.0)


@pytest.mark.distribution
def test_sampling_audit_with_logits_rules(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs with a bias and a presence penalty (seeds 0..149, batched 8 at a time) follow the target's distribution
    under the same rules at positions 1 and 2 (false-failure rate ≤ 1e-3; fixed seeds, deterministic). Power, same
    runs: a reference without the rules fails at position 1, one that forgets the generated token (no presence penalty)
    at position 2."""
    import specdec.audit as audit_mod
    from specdec.logits_rules import RulesState

    kw: dict[str, Any] = dict(temperature=1.0, runs=150, positions=2, seed=0, batch=8, rules=SAMPLING_RULES)
    result = audit_sampling(engine, PROMPTS[:1], **kw)
    assert [t.position for t in result.tests] == [1, 2] and result.ok, result.text()

    class Blind(RulesState):
        def apply(self, logits: torch.Tensor, tokens: Sequence[int] = (), offset: int = 0) -> torch.Tensor:
            return logits

    class Forgetful(RulesState):
        def commit(self, tokens: Sequence[int]) -> None:
            pass

    for wrong, position in ((Blind, 1), (Forgetful, 2)):
        monkeypatch.setattr(audit_mod, "RulesState", wrong)
        failed = [t.position for t in audit_sampling(engine, PROMPTS[:1], **kw).tests if not t.ok]
        assert failed == [position], (wrong.__name__, failed)


@pytest.mark.distribution
def test_sampling_audit_passes_on_the_real_engine(engine: Engine) -> None:
    """150 runs with seeds 0..149; the audit's tests together fail a correct engine with probability ≤ 1e-3
    (Bonferroni), so over seeds this test fails falsely at most once in 1,000."""
    result = audit_sampling(engine, PROMPTS[:1], temperature=1.0, runs=150, positions=2, seed=0)
    assert result.tests and all(t.samples > 0 for t in result.tests)
    assert result.ok, result.text()


@pytest.mark.distribution
def test_sampling_audit_fails_when_everything_is_accepted(engine: Engine, broken: None) -> None:
    """Power, same seeds 0..149: a rule that accepts every draft token outputs the draft's law, which the audit
    must reject (deterministic with these seeds)."""
    result = audit_sampling(engine, PROMPTS[:1], temperature=1.0, runs=150, positions=2, seed=0)
    assert not result.ok
    assert "position 1 is not distributed as the target's" in (result.first_failure or "")


@pytest.mark.identity
def test_cli_audits_a_trace_and_catches_a_tampered_output(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specdec.cli import main

    trace = tmp_path / "t.jsonl"
    eng = specdec.load(tiny_models["llama"], tiny_models["draft"], tau=3, trace=trace)
    # A request with logits rules is replayed with them (without, its target-only run is another output).
    rules = dict(presence_penalty=1.5, repetition_penalty=1.6, logit_bias={5: 4.0}, min_tokens=3)
    ruled = eng.generate(PROMPTS[1], max_new_tokens=16, **rules).token_ids  # type: ignore[arg-type]
    assert ruled != eng.generate(PROMPTS[1], max_new_tokens=16, tau=0).token_ids
    for p in PROMPTS:
        eng.generate(p, max_new_tokens=16)
    eng.observers[-1].close()  # type: ignore[attr-defined]
    models = ["--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"])]
    assert main(["audit", *models, "--trace", str(trace)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.startswith("PASS  greedy audit: 4 prompt(s)"), out
    assert main(["audit", *models, "--trace", str(trace), "--presence-penalty", "1"]) == 2
    assert "--presence-penalty: a greedy --trace audit replays each request with the rules" in capsys.readouterr().err

    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    step = next(
        x for x in lines if x["type"] == "step" and x["request_id"] == lines[-1]["request_id"] and x["step"] == 1
    )
    step["emitted"][0] = (step["emitted"][0] + 1) % 300  # what a wrong engine would have served
    pos = sum(
        len(x["emitted"])
        for x in lines
        if x["type"] == "step" and x["request_id"] == step["request_id"] and x["step"] == 0
    )
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["audit", *models, "--trace", str(trace), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["divergences"][0]["position"] == pos
    assert out["divergences"][0]["request"] == f"{step['request_id']} in {trace}"

    # A fleet's traces (one file per replica) are audited as one, each divergence named with its request and file.
    other = tmp_path / "u.jsonl"
    eng = specdec.load(tiny_models["llama"], tiny_models["draft"], tau=2, trace=other)
    eng.generate("The fleet", max_new_tokens=12)
    eng.observers[-1].close()  # type: ignore[attr-defined]
    assert main(["audit", *models, "--trace", str(other), str(trace)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL  greedy audit: 5 prompt(s)"), out
    assert f"request {step['request_id']} in {trace}): first divergence at generated position {pos}" in out, out


@pytest.mark.identity
def test_cli_refuses_a_trace_served_with_other_numerics(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A greedy replay is exact only on a target that computes as the serving one did: the trace's header says how
    (``target_numerics``), and an audit set up otherwise is refused with the difference named, not run into false
    divergences."""
    from specdec.cli import main
    from specdec.trace import read_trace

    trace = tmp_path / "t.jsonl"
    eng = specdec.load(tiny_models["llama"], tiny_models["draft"], tau=3, trace=trace, dtype="float32")
    eng.generate(PROMPTS[0], max_new_tokens=8)
    eng.observers[-1].close()  # type: ignore[attr-defined]
    served = read_trace(trace).headers[0]["meta"]["target_numerics"]
    assert served["dtype"] == "float32" and served["kv_dtype"] == "fp32" and served["runtime"] == "cpu-kernel"
    models = ["--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"])]
    assert main(["audit", *models, "--dtype", "float32", "--trace", str(trace)]) == 0
    capsys.readouterr()
    assert main(["audit", *models, "--dtype", "bfloat16", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "dtype float32 (here bfloat16), kv_dtype fp32 (here bf16)" in err and err.count("\n") == 1
    # A sampling audit of the trace's prompts tests distributions, not bits: not refused.
    args = ["--dtype", "bfloat16", "--trace", str(trace), "--temperature", "1", "--runs", "30", "--samples", "1"]
    assert main(["audit", *models, *args]) in (0, 1)


def test_cli_prompts_file_and_bad_input(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specdec.cli import main

    models = ["--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"])]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert main(["audit", *models, "--prompts", str(prompts), "--max-new-tokens", "12"]) == 0
    assert "2 prompt(s)" in capsys.readouterr().out
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))  # bare JSON strings: load_test's form
    assert main(["audit", *models, "--prompts", str(prompts), "--max-new-tokens", "12"]) == 0
    assert "2 prompt(s)" in capsys.readouterr().out
    prompts.write_text('{"text": "no prompt field"}\n')
    assert main(["audit", *models, "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert 'p.jsonl:1: expected a non-empty JSON string or an object with a non-empty string "prompt"' in err
    assert err.count("\n") == 1
    assert main(["audit", *models, "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    assert main(["audit", *models, "--prompts", str(prompts), "--batch", "0"]) == 2
    assert capsys.readouterr().err == "specdec: error: --batch must be a positive integer\n"
    assert main(["audit", *models, "--trace", str(prompts), "--batch", "2"]) == 2
    assert "--batch does not apply to a greedy --trace audit" in capsys.readouterr().err
    assert main(["audit", *models, "--prompts", str(prompts), "--prefill-in-step", "64"]) == 2
    assert "--prefill-in-step applies to batched audits" in capsys.readouterr().err
    assert main(["audit", *models, "--prompts", str(prompts), "--batch", "2", "--prefill-in-step", "-1"]) == 2
    assert "--prefill-in-step must be >= 0" in capsys.readouterr().err


def test_cli_batched_audit(tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specdec.cli import main

    models = ["--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"]), "--tau", "3"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in BATCH_PROMPTS))
    assert main(["audit", *models, "--prompts", str(prompts), "--max-new-tokens", "12", "--batch", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["prompts"] == 5 and out["batch"] == 3 and out["max_sequences"] == 3
    assert out["prefill_in_step"] == 256  # the server's default: prompts join the batch's passes
    # Prompts of ~10-40 tokens in pieces of 4 over several steps, beside the others' drafts.
    args = ["--max-new-tokens", "12", "--batch", "4", "--prefill-in-step", "4"]
    assert main(["audit", *models, "--prompts", str(prompts), *args]) == 0
    assert "prompts taken in by the steps, up to 4 tokens a step" in capsys.readouterr().out
    rules = ["--presence-penalty", "1", "--logit-bias", "5=3", "--min-tokens", "4"]
    assert main(["audit", *models, "--prompts", str(prompts), "--max-new-tokens", "12", "--batch", "3", *rules]) == 0
    assert capsys.readouterr().out.startswith("PASS")


@pytest.mark.distribution
def test_fit_test_false_failure_rate_and_power() -> None:
    """Calibration without an engine: 300 samples from p pass at the stated rate; samples from q fail.

    ``torch.Generator().manual_seed(1234)``; 200 tests at level 0.01 may fail at most 8 times, which a correct
    test exceeds with probability < 1e-3 (binomial)."""
    from specdec.audit import fit_test

    gen = torch.Generator().manual_seed(1234)
    p = torch.softmax(torch.randn(320, generator=gen) * 2.0, dim=-1)  # a flat-ish target, like a tiny model's
    q = torch.softmax(torch.randn(320, generator=gen) * 2.0, dim=-1)  # an unrelated draft
    level = 0.01
    false = sum(
        not fit_test(0, 1, torch.multinomial(p, 300, True, generator=gen).tolist(), p, level).ok for _ in range(200)
    )
    assert false <= 8  # expected ≤ 2 (level 0.01 × 200); P(≥ 9 | rate 0.01) < 1e-3 (binomial)
    caught = sum(
        not fit_test(0, 1, torch.multinomial(q, 300, True, generator=gen).tolist(), p, level).ok for _ in range(20)
    )
    assert caught == 20
    topk = p.clone()
    topk[topk < topk.topk(10).values[-1]] = 0
    topk /= topk.sum()
    assert not fit_test(0, 1, torch.multinomial(p, 300, True, generator=gen).tolist(), topk, level).ok  # p = 0 tokens
