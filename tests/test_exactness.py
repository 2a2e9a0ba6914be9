"""Greedy exactness: speculative output is token-identical to target-only greedy decoding."""

from __future__ import annotations

import pytest
import torch

import specdec

pytestmark = pytest.mark.identity

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):"]
TAUS = [1, 2, 4, 8]


def _baseline(engine, prompt: str, n: int) -> list[int]:
    return engine.generate(prompt, max_new_tokens=n, tau=0).token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral"])
def test_greedy_identical_with_independent_draft(tiny_models, arch):
    engine = specdec.load(tiny_models[arch], tiny_models["draft"], dtype="float32", runtime="hf")
    engine.eos_ids = frozenset()  # random models may emit EOS early; compare full-length outputs
    for prompt in PROMPTS:
        expected = _baseline(engine, prompt, 24)
        assert len(expected) == 24
        for tau in TAUS:
            got = engine.generate(prompt, max_new_tokens=24, tau=tau)
            assert got.token_ids == expected, f"{arch} tau={tau} prompt={prompt!r}"
            assert got.stats.target_passes == got.stats.steps


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_identical_with_target_as_its_own_draft(tiny_models, arch):
    engine = specdec.load(tiny_models[arch], tiny_models[arch], dtype="float32", runtime="hf")
    engine.eos_ids = frozenset()
    for prompt in PROMPTS:
        expected = _baseline(engine, prompt, 24)
        for tau in TAUS:
            got = engine.generate(prompt, max_new_tokens=24, tau=tau)
            assert got.token_ids == expected, f"{arch} tau={tau}"
            # every draft is accepted, so each pass emits tau + 1 tokens (except where max_new_tokens clamps)
            assert got.stats.acceptance_rate == 1.0
            assert got.stats.target_passes == -(-24 // (tau + 1))


def test_greedy_identical_with_prompt_lookup(tiny_models):
    engine = specdec.load(tiny_models["llama"], prompt_lookup=True, dtype="float32", runtime="hf")
    prompt = "a b c a b c a b c a b"
    expected = _baseline(engine, prompt, 32)
    for tau in TAUS:
        assert engine.generate(prompt, max_new_tokens=32, tau=tau).token_ids == expected


def test_rejected_drafts_never_reach_output(tiny_models):
    """Every step: emitted = accepted prefix of the draft + one correction token."""
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    for temperature in (0.0, 1.0):
        r = engine.generate(PROMPTS[0], max_new_tokens=30, tau=4, temperature=temperature, seed=3)
        out: list[int] = []
        for rec in r.records:
            n = rec.n_accepted
            assert n == next((i for i, f in enumerate(rec.accept_flags) if not f), rec.tau)
            assert rec.emitted[:n] == rec.draft_tokens[:n]
            assert len(rec.emitted) <= n + 1
            out += rec.emitted
        assert out == r.token_ids
        assert r.stats.accepted == sum(min(x.n_accepted, len(x.emitted)) for x in r.records)


def test_loaded_transformers_objects(tiny_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]))
    draft = AutoModelForCausalLM.from_pretrained(str(tiny_models["draft"]))
    tok = AutoTokenizer.from_pretrained(str(tiny_models["llama"]))
    engine = specdec.load(target, draft, tokenizer=tok)
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        ref = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = engine.generate(PROMPTS[0], max_new_tokens=12, tau=3)
    assert got.token_ids == ref[0, ids.shape[1] :].tolist()


def test_stream_concatenates_to_generate(tiny_models):
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    full = engine.generate(PROMPTS[1], max_new_tokens=30, tau=3)
    assert "".join(engine.stream(PROMPTS[1], max_new_tokens=30, tau=3)) == full.text


def test_stop_string_cuts_output_and_stats(tiny_models):
    engine = specdec.load(tiny_models["llama"], tiny_models["llama"], dtype="float32")
    full = engine.generate(PROMPTS[0], max_new_tokens=30, tau=4)
    stop = full.text[10:13]
    assert stop and stop in full.text
    cut = engine.generate(PROMPTS[0], max_new_tokens=30, tau=4, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    # the kept tokens are the fewest whose text contains the stop string: nothing after it
    tok = engine.tokenizer
    assert stop in tok.decode(cut.token_ids) and stop not in tok.decode(cut.token_ids[:-1])
    assert cut.stats.new_tokens == len(cut.token_ids)
    assert cut.stats.accepted <= cut.stats.new_tokens
    streamed = "".join(engine.stream(PROMPTS[0], max_new_tokens=30, tau=4, stop=[stop]))
    assert streamed == cut.text


def test_eos_ends_generation(tiny_models):
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    full = engine.generate(PROMPTS[0], max_new_tokens=20, tau=2)
    eos = full.token_ids[7]
    engine.eos_ids = frozenset({eos})
    r = engine.generate(PROMPTS[0], max_new_tokens=20, tau=2)
    first = full.token_ids.index(eos)
    assert r.token_ids == full.token_ids[:first]
    assert r.finish_reason == "stop"


def test_verify_budget_caps_target_passes(tiny_models):
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    r = engine.generate(PROMPTS[0], max_new_tokens=40, tau=2, max_verify_passes=5)
    assert r.stats.target_passes == 5
    assert r.finish_reason == "verify_budget"
    assert r.token_ids == engine.generate(PROMPTS[0], max_new_tokens=40, tau=0).token_ids[: len(r.token_ids)]
