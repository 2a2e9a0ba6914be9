"""OpenAI request fields exact under speculation: penalties, logit_bias, min_tokens, ignore_eos, logprobs.

Each rule is checked by hand on a tiny vocabulary, and row ``i`` of a verify block must be processed exactly as
a one-row pass whose context is ``context + block[:i]``. End to end, speculative decoding with the rules on must
equal target-only (``tau=0``) decoding with the same rules: token for token for greedy requests, in
distribution for sampled ones; and logprobs must equal target-only logprobs (exactly on the native runtime,
whose rows do not depend on the rest of the pass; within 1e-5 on transformers).
"""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.errors import InvalidRequestError
from specdec.logits_rules import LogitsRules, RulesState
from specdec.sampling import SamplingParams, logits_to_probs, token_logprobs

V = 6
EOS = 0


def _state(rules: LogitsRules, prompt: list[int], generated: list[int], vocab: int = V) -> RulesState:
    state = RulesState(rules, prompt, vocab, {EOS}, torch.device("cpu"))
    state.commit(generated)
    return state


def _reference(logits: torch.Tensor, rules: LogitsRules, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The rules of one position written out token by token (the definition, independent of RulesState)."""
    out = [float(x) for x in logits]
    for t, b in rules.logit_bias.items():
        out[t] += b
    for t in range(len(out)):
        if t in prompt or t in generated:
            r = rules.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        c = generated.count(t)
        out[t] -= rules.frequency_penalty * c + rules.presence_penalty * (1.0 if c > 0 else 0.0)
    if len(generated) < rules.min_tokens:
        out[EOS] = float("-inf")
    return torch.tensor(out)


ALL_RULES = LogitsRules(
    presence_penalty=0.7,
    frequency_penalty=0.3,
    repetition_penalty=1.5,
    logit_bias={2: 1.25, 4: -3.0},
    min_tokens=5,
)


@pytest.mark.rules
def test_each_rule_by_hand():
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0, -2.0])
    prompt, gen = [1, 5], [3, 3, 1]

    def one(rules: LogitsRules) -> list[float]:
        return _state(rules, prompt, gen).apply(logits[None])[0].tolist()

    # presence: every generated token (3, 1) loses 0.5 once
    assert one(LogitsRules(presence_penalty=0.5)) == [1.0, 1.5, -1.0, 0.0, 3.0, -2.0]
    # frequency: 3 generated twice, 1 once
    assert one(LogitsRules(frequency_penalty=0.5)) == [1.0, 1.5, -1.0, -0.5, 3.0, -2.0]
    # repetition over prompt + generated (1, 3, 5): positive divided, negative multiplied
    assert one(LogitsRules(repetition_penalty=2.0)) == [1.0, 1.0, -1.0, 0.25, 3.0, -4.0]
    assert one(LogitsRules(logit_bias={0: -100.0, 2: 5.0})) == [-99.0, 2.0, 4.0, 0.5, 3.0, -2.0]
    # min_tokens: 3 generated; EOS masked while fewer than 4, free at 3 (min_tokens = 3)
    assert one(LogitsRules(min_tokens=4))[EOS] == float("-inf")
    assert one(LogitsRules(min_tokens=3))[EOS] == 1.0
    # all together, against the written-out definition
    torch.testing.assert_close(
        _state(ALL_RULES, prompt, gen).apply(logits[None])[0], _reference(logits, ALL_RULES, prompt, gen)
    )


@pytest.mark.rules
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_row_equals_one_row_pass_with_its_context(seed: int):
    """Row i of a block [last, ŷ1..ŷτ] == one row processed with context + ŷ1..ŷi, bit for bit; the draft form
    (one row after ``offset`` drafted tokens) too."""
    g = torch.Generator().manual_seed(seed)
    vocab = 50
    rules = LogitsRules(
        presence_penalty=0.4, frequency_penalty=0.9, repetition_penalty=1.3, logit_bias={7: 2.0}, min_tokens=6
    )
    prompt = torch.randint(0, vocab, (9,), generator=g).tolist()
    generated = torch.randint(0, vocab, (3,), generator=g).tolist()
    block = [EOS, 7, 7, *torch.randint(0, vocab, (3,), generator=g).tolist()]  # repeats and EOS inside
    logits = torch.randn(len(block) + 1, vocab, generator=g) * 3
    processed = _state(rules, prompt, generated, vocab).apply(logits, block)
    for i in range(len(block) + 1):
        alone = _state(rules, prompt, generated + block[:i], vocab).apply(logits[i : i + 1])
        assert torch.equal(processed[i : i + 1], alone), f"row {i}"
        as_draft = _state(rules, prompt, generated, vocab).apply(logits[i : i + 1], block[:i], offset=i)
        assert torch.equal(as_draft, alone), f"draft row {i}"
        torch.testing.assert_close(alone[0], _reference(logits[i], rules, prompt, generated + block[:i]))


@pytest.mark.rules
def test_no_rule_costs_nothing():
    logits = torch.randn(3, V)
    state = _state(LogitsRules(ignore_eos=True), [1], [2])
    assert state.apply(logits, [1, 2]) is logits
    assert not LogitsRules(ignore_eos=True, logit_bias={}).active


@pytest.mark.rules
def test_rule_values_checked():
    def check(param: str, **kw):
        with pytest.raises(InvalidRequestError) as e:
            LogitsRules.checked(vocab_size=V, max_new_tokens=8, **kw)
        assert e.value.param == param

    check("presence_penalty", presence_penalty=2.5)
    check("frequency_penalty", frequency_penalty=float("nan"))
    check("repetition_penalty", repetition_penalty=0.0)
    check("logit_bias", logit_bias={V: 1.0})
    check("logit_bias", logit_bias={1: 101.0})
    check("min_tokens", min_tokens=9)
    check("min_tokens", min_tokens=-1)
    check("ignore_eos", ignore_eos=1)
    ok = LogitsRules.checked(vocab_size=V, max_new_tokens=8, min_tokens=8, logit_bias={1: 0.0, 2: -100})
    assert ok.logit_bias == {2: -100.0} and ok.min_tokens == 8


@pytest.mark.rules
def test_token_logprobs_of_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0, 0.5]])
    greedy = token_logprobs(logits, [1], SamplingParams(), 3)[0]
    lp = torch.log_softmax(logits[0], -1)
    assert greedy.logprob == float(lp[1])
    assert [t for t, _ in greedy.top] == [0, 1, 5]
    assert [v for _, v in greedy.top] == sorted((v for _, v in greedy.top), reverse=True)
    params = SamplingParams(temperature=0.5, top_k=2)
    sampled = token_logprobs(logits, [1], params, 5)[0]
    probs = logits_to_probs(logits, params)[0]
    assert abs(sampled.logprob - float(torch.log(probs[1]))) < 1e-6
    assert [t for t, _ in sampled.top] == [0, 1]  # the -inf entries outside top-k are left out
    assert token_logprobs(logits, [4], params, 0)[0].top == []


@pytest.mark.rules
@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.7, min_p=0.05),
        dict(temperature=1.3, top_k=50, min_p=0.2),
        dict(temperature=0.9, top_p=0.9, min_p=0.1),
        dict(temperature=1.0, min_p=1.0),
    ],
)
def test_sampling_filters_match_transformers(settings: dict):
    """temperature, top_k, top_p and min_p keep the tokens transformers' warpers keep (in their order: temperature,
    top-k, top-p, min-p), with the same probabilities: a user's sampling settings mean what they mean there. Random
    logits over 1,000 tokens, seed 0 (no ties)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(settings["temperature"])])
    if settings.get("top_k"):
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    warpers.append(MinPLogitsWarper(settings["min_p"]))
    want = torch.softmax(warpers(torch.zeros(4, 1, dtype=torch.long), logits.clone()), dim=-1)
    got = logits_to_probs(logits, SamplingParams(**settings))
    assert torch.equal(got > 0, want > 0)
    assert 1 <= int((got[0] > 0).sum()) < 1000  # the filters cut, and the likeliest token stays
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


# -- engine ----------------------------------------------------------------------------------------------

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):"]
RULES = {
    "penalties": dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3),
    "bias+min_tokens": dict(logit_bias={5: 3.0, 17: -100.0}, min_tokens=12, frequency_penalty=-0.4),
    "ignore_eos+bias": dict(ignore_eos=True, logit_bias={0: 6.0}),  # EOS pushed up, and kept
}


def _engine(tiny_models, runtime: str, draft: str | None, prompt_lookup: bool = False):
    drafter = tiny_models[draft] if draft else None
    return specdec.load(tiny_models["llama"], drafter, prompt_lookup=prompt_lookup, dtype="float32", runtime=runtime)


@pytest.mark.identity
@pytest.mark.parametrize("runtime", ["native", "hf"])
@pytest.mark.parametrize("rules", list(RULES))
def test_greedy_with_rules_equals_target_only(tiny_models, runtime: str, rules: str):
    """Draft model (τ 1..4) and prompt lookup, with the rules on: the same tokens as target-only decoding
    with the same rules; the rules change the output (else the test would show nothing)."""
    kw = dict(max_new_tokens=40, **RULES[rules])
    for draft, lookup in (("draft", False), ("llama", False), (None, True)):
        engine = _engine(tiny_models, runtime, draft, lookup)
        for prompt in PROMPTS:
            base = engine.generate(prompt, tau=0, **kw)
            assert base.token_ids != engine.generate(prompt, tau=0, max_new_tokens=40).token_ids
            for tau in (1, 2, 3, 4) if draft else (3,):
                out = engine.generate(prompt, tau=tau, **kw)
                assert out.token_ids == base.token_ids, (draft, lookup, prompt, tau)
                assert out.finish_reason == base.finish_reason
            if draft == "llama" and runtime == "native":
                # The target as its own draft, the rules applied to it as well: every draft token accepted.
                assert out.stats.acceptance_rate == 1.0


@pytest.mark.identity
def test_min_tokens_and_ignore_eos(tiny_models):
    """A strong bias on EOS ends generation at once; min_tokens holds it off for exactly that many tokens;
    ignore_eos keeps EOS as a token and runs to max_new_tokens."""
    engine = _engine(tiny_models, "native", "draft")
    prompt = PROMPTS[0]
    assert engine.generate(prompt, tau=3, logit_bias={EOS: 100.0}).token_ids == []
    held = engine.generate(prompt, tau=3, logit_bias={EOS: 100.0}, min_tokens=7, max_new_tokens=20)
    assert len(held.token_ids) == 7 and held.finish_reason == "stop"
    assert EOS not in held.token_ids
    kept = engine.generate(prompt, tau=3, logit_bias={EOS: 100.0}, ignore_eos=True, max_new_tokens=9)
    assert kept.token_ids == [EOS] * 9 and kept.finish_reason == "length"
    fixed = engine.generate(prompt, tau=3, ignore_eos=True, max_new_tokens=30, temperature=1.0, seed=3)
    assert len(fixed.token_ids) == 30


@pytest.mark.identity
@pytest.mark.parametrize("runtime", ["native", "hf"])
def test_greedy_logprobs_equal_target_only(tiny_models, runtime: str):
    engine = _engine(tiny_models, runtime, "draft")
    kw = dict(max_new_tokens=30, logprobs=4, **RULES["penalties"])
    for prompt in PROMPTS:
        base = engine.generate(prompt, tau=0, **kw)
        assert base.logprobs is not None and len(base.logprobs) == len(base.token_ids)
        for tau in (2, 4):
            out = engine.generate(prompt, tau=tau, **kw)
            assert out.logprobs is not None and [lp.token for lp in out.logprobs] == out.token_ids == base.token_ids
            for a, b in zip(out.logprobs, base.logprobs):
                assert len(a.top) == 4 and [v for _, v in a.top] == sorted((v for _, v in a.top), reverse=True)
                assert a.top[0][0] == a.token  # greedy: the emitted token is the most likely
                if runtime == "native":
                    assert a == b
                else:
                    assert abs(a.logprob - b.logprob) < 1e-5
                    assert [t for t, _ in a.top] == [t for t, _ in b.top]
                    assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-5
    assert engine.generate(PROMPTS[0], tau=2, max_new_tokens=5).logprobs is None


def _forced_logprobs(engine, prompt: list[int], tokens: list[int], params: SamplingParams, k: int, rules: LogitsRules):
    """Target-only logprobs of given tokens: one-token passes, as a ``tau=0`` run makes them."""
    target = engine.target
    cache = target.new_cache()
    state = RulesState(rules, prompt, target.vocab_size, engine.eos_ids, target.device)
    with torch.inference_mode():
        if len(prompt) > 1:
            target.forward(torch.tensor(prompt[:-1]), cache, last_only=True)
        out = []
        last = prompt[-1]
        for t in tokens:
            logits = state.apply(target.forward_batch([(torch.tensor([last]), cache)])[0])
            out += token_logprobs(logits, [t], params, k)
            state.commit([t])
            last = t
    target.release(cache)
    return out


@pytest.mark.identity
@pytest.mark.parametrize("runtime", ["native", "hf"])
def test_sampled_logprobs_equal_target_only(tiny_models, runtime: str):
    """Seeded sampled runs (seeds 0..2), speculative τ=3: each token's logprob and top list equal what target-only
    decoding gives those same tokens."""
    engine = _engine(tiny_models, runtime, "draft")
    settings = dict(temperature=0.8, top_k=20, top_p=0.9)
    rules = dict(presence_penalty=0.5, repetition_penalty=1.2)
    for seed in range(3):
        prompt = engine.encode(PROMPTS[seed % 2])
        out = engine.generate(prompt, tau=3, seed=seed, max_new_tokens=24, logprobs=3, **settings, **rules)
        assert out.logprobs is not None
        forced = _forced_logprobs(engine, prompt, out.token_ids, SamplingParams(**settings), 3, LogitsRules(**rules))
        for a, b in zip(out.logprobs, forced, strict=True):
            assert 1 <= len(a.top) <= 3 and all(v > float("-inf") for _, v in a.top)
            if runtime == "native":
                assert a == b
            else:
                assert abs(a.logprob - b.logprob) < 1e-5


@pytest.mark.rules
def test_engine_refuses_bad_values(tiny_models):
    engine = _engine(tiny_models, "native", None)
    for kw, param in (
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias"),
        (dict(min_tokens=20, max_new_tokens=10), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            engine.start("x", **kw)
        assert e.value.param == param


# -- distribution ----------------------------------------------------------------------------------------

P_THRESHOLD = 1e-3
DIST_SETTINGS = dict(temperature=1.0, top_k=4)  # the tiny target is flat: top-4 keeps 64 joint outcomes
DIST_RULES = dict(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.8)


def _exact_joint(target_dir, prompt: list[int], params: SamplingParams, rules: LogitsRules, depth: int):
    """The exact law of the first ``depth`` tokens of target-only sampling with the rules, by enumerating prefixes
    (transformers, fp32; each prefix's rules computed from its own context)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(depth):
            prefixes = [k for k, v in joint.items() if v > 1e-9]
            logits = model(input_ids=torch.tensor([prompt + list(k) for k in prefixes])).logits[:, -1]
            new: dict[tuple[int, ...], float] = {}
            for row, prefix in enumerate(prefixes):
                state = _state(rules, prompt, list(prefix), vocab=logits.shape[-1])
                probs = logits_to_probs(state.apply(logits[row : row + 1]), params)[0]
                for tok in torch.nonzero(probs > 1e-9).flatten().tolist():
                    new[prefix + (tok,)] = joint[prefix] * float(probs[tok])
            joint = new
    return joint


@pytest.mark.slow
@pytest.mark.distribution
@pytest.mark.parametrize("runtime", ["native", "hf"])
def test_penalised_sampling_first_three_tokens_match_target(tiny_models, tmp_path_factory, runtime: str):
    """Sampled with presence + frequency + repetition penalties, speculative τ=3 with a partly accepted draft:
    the joint law of the first three tokens and each position's marginal against the exact target-only law.

    600 generations with seeds 0..599 (``ignore_eos``, so every run has three tokens); four chi-square tests at
    1e-3: false-failure rate ≤ 4e-3 over seeds. (Checked once by hand: the joint test rejects at p < 1e-10 when
    the block's rows are all processed with the step's base context, or when the repetition penalty is left out.)"""
    from specdec.testing import tiny_checkpoint
    from test_distribution import chi2_pvalue

    soft = tiny_checkpoint(
        tmp_path_factory.mktemp("soft") / "d", "llama", seed=0, tokenizer_from=tiny_models["llama"], sharpen=2.0
    )
    engine = specdec.load(tiny_models["llama"], soft, dtype="float32", runtime=runtime)
    prompt = engine.encode("def fibonacci(n):")
    params, rules = SamplingParams(**DIST_SETTINGS), LogitsRules(**DIST_RULES)
    joint = _exact_joint(tiny_models["llama"], prompt, params, rules, 3)
    plain = _exact_joint(tiny_models["llama"], prompt, params, LogitsRules(), 3)
    tv = 0.5 * sum(abs(joint.get(k, 0.0) - plain.get(k, 0.0)) for k in set(joint) | set(plain))
    assert tv > 0.05, f"the penalties should change the law for this test to mean anything (TV {tv:.3f})"
    n = 600
    counts: dict[tuple[int, ...], int] = {}
    drafted = accepted = 0
    for seed in range(n):
        r = engine.generate(prompt, max_new_tokens=3, tau=3, seed=seed, ignore_eos=True, **DIST_SETTINGS, **DIST_RULES)
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    assert 0.05 < accepted / drafted < 0.95, "the draft should be partly accepted for this test to mean anything"
    assert all(len(k) == 3 for k in counts)
    assert chi2_pvalue(counts, joint, n) > P_THRESHOLD
    for pos in range(3):
        cnt: dict[int, int] = {}
        marg: dict[int, float] = {}
        for k, c in counts.items():
            cnt[k[pos]] = cnt.get(k[pos], 0) + c
        for k, v in joint.items():
            marg[k[pos]] = marg.get(k[pos], 0.0) + v
        assert chi2_pvalue(cnt, marg, n) > P_THRESHOLD, f"position {pos + 1}"


# -- server, with the official openai client ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """A real ``specdec serve`` process on 127.0.0.1 (tiny llama with a chat template, tiny draft), its
    ``openai`` client, and the same models in-process (what the server must reproduce)."""
    openai = pytest.importorskip("openai")

    from test_server import MODEL, served, with_chat_template

    target = with_chat_template(tiny_models["llama"], tmp_path_factory.mktemp("fields") / "llama")
    log = tmp_path_factory.mktemp("fields-server") / "server.log"
    with served(target, tiny_models["draft"], log) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        yield client, specdec.load(target, tiny_models["draft"]), MODEL


SERVER_RULES = dict(presence_penalty=0.6, frequency_penalty=0.4, logit_bias={"5": 4.0, "17": -100.0})
SERVER_EXTRA = dict(repetition_penalty=1.25, min_tokens=6)


def _engine_rules() -> dict:
    return dict(
        presence_penalty=0.6,
        frequency_penalty=0.4,
        logit_bias={5: 4.0, 17: -100.0},
        repetition_penalty=1.25,
        min_tokens=6,
    )


@pytest.mark.server
def test_server_completion_logprobs_and_penalties_equal_target_only(served):
    """Completions, stream and not: penalised greedy text and every token's logprob and top-3 equal the Python
    API's target-only run (native runtime: exactly)."""
    from specdec.server.responses import token_text

    client, engine, model = served
    tok = engine.tokenizer
    for prompt in PROMPTS:
        expected = engine.generate(prompt, tau=0, max_new_tokens=24, logprobs=3, **_engine_rules())
        assert expected.logprobs is not None
        want = {
            "tokens": [token_text(tok, lp.token) for lp in expected.logprobs],
            "token_logprobs": [lp.logprob for lp in expected.logprobs],
            "top_logprobs": [{token_text(tok, t): v for t, v in lp.top} for lp in expected.logprobs],
        }
        resp = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            logprobs=3,
            **SERVER_RULES,
            extra_body=SERVER_EXTRA,
        )
        choice = resp.choices[0]
        assert choice.text == expected.text
        got = choice.logprobs
        assert (got.tokens, got.token_logprobs, got.top_logprobs) == (
            want["tokens"],
            want["token_logprobs"],
            want["top_logprobs"],
        )
        assert got.text_offset == [sum(len(t) for t in want["tokens"][:i]) for i in range(len(want["tokens"]))]
        chunks = list(
            client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                logprobs=3,
                stream=True,
                **SERVER_RULES,
                extra_body=SERVER_EXTRA,
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == expected.text
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
        assert [t for lp in lps for t in lp.tokens] == want["tokens"]
        assert [v for lp in lps for v in lp.token_logprobs] == want["token_logprobs"]
        assert [d for lp in lps for d in lp.top_logprobs] == want["top_logprobs"]
        assert [o for lp in lps for o in lp.text_offset] == got.text_offset
        plain = engine.generate(prompt, tau=0, max_new_tokens=24)
        assert plain.text != expected.text  # the penalties took effect


@pytest.mark.server
def test_server_chat_logprobs_equal_target_only(served):
    from specdec.server.requests import render_chat
    from specdec.server.responses import token_text

    client, engine, model = served
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    ids = render_chat(tok, messages)
    expected = engine.generate(ids, tau=0, max_new_tokens=20, logprobs=2, **_engine_rules())
    assert expected.logprobs is not None
    want = [
        (token_text(tok, lp.token), lp.logprob, [(token_text(tok, t), v) for t, v in lp.top])
        for lp in expected.logprobs
    ]
    kw = dict(
        model=model,
        messages=messages,
        max_tokens=20,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        **SERVER_RULES,
        extra_body=SERVER_EXTRA,
    )
    resp = client.chat.completions.create(**kw)
    assert resp.choices[0].message.content == expected.text
    content = resp.choices[0].logprobs.content
    assert [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content] == want
    assert all(c.bytes == list(c.token.encode()) for c in content)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in streamed] == want
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected.text
    no_lp = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert no_lp.choices[0].logprobs is None


@pytest.mark.server
@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.1), "frequency_penalty"),
        (dict(logit_bias={"999999": 1}), "logit_bias"),
        (dict(logprobs=6), "logprobs"),
        (dict(extra_body={"min_tokens": 9}), "min_tokens"),
        (dict(extra_body={"repetition_penalty": -1}), "repetition_penalty"),
    ],
)
def test_server_bad_values_name_the_field(served, kw, param):
    import openai

    client, _engine, model = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=8, **kw)
    assert e.value.status_code == 400
    body = e.value.body  # the client hands back the body's "error" object
    assert isinstance(body, dict)
    assert body["param"] == param


@pytest.mark.identity
def test_batched_step_with_different_rules_equals_solo(tiny_models):
    """Requests with different rules (and one with none) stepped together: each equals its solo target-only run,
    logprobs included (native runtime: exactly)."""
    engine = _engine(tiny_models, "native", "draft")
    asks = [
        dict(max_new_tokens=20, logprobs=2, **RULES["penalties"]),
        dict(max_new_tokens=20, **RULES["bias+min_tokens"]),
        dict(max_new_tokens=20, logprobs=0),
        dict(max_new_tokens=20, temperature=0.9, seed=5, ignore_eos=True, repetition_penalty=1.4),
    ]
    prompts = [PROMPTS[i % 2] for i in range(len(asks))]
    gens = [engine.start(p, tau=3, **kw) for p, kw in zip(prompts, asks)]
    while not all(g.done for g in gens):
        engine.step(gens)
    for g, p, kw in zip(gens, prompts, asks):
        solo = engine.generate(p, tau=3 if "seed" in kw else 0, **kw)  # sampled: same seed, same τ alone
        got = g.result()
        assert got.token_ids == solo.token_ids
        assert got.logprobs == solo.logprobs


def test_cli_generate_rules_and_logprobs(tiny_models, capsys: pytest.CaptureFixture[str]):
    import json

    from specdec.cli import main

    base = ["generate", "def f(x):", "--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"])]
    base += ["--dtype", "float32", "--max-new-tokens", "8"]
    rc = main([*base, "--logit-bias", f"{EOS}=100", "--ignore-eos", "--min-tokens", "2", "--json", "--logprobs", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    # EOS masked for the first two tokens (min_tokens), then pushed up by the bias, kept (ignore_eos) to the end
    assert EOS not in out["token_ids"][:2] and out["token_ids"][2:] == [EOS] * 6 and out["finish_reason"] == "length"
    assert [lp["token"] for lp in out["logprobs"]] == out["token_ids"]
    assert all(len(lp["top"]) == 2 for lp in out["logprobs"])
    assert all(EOS not in [t for t, _ in lp["top"]] for lp in out["logprobs"][:2])  # probability 0: left out
    assert all(lp["top"][0][0] == EOS for lp in out["logprobs"][2:])
    with pytest.raises(SystemExit) as e:  # argparse refuses a malformed ID=BIAS itself
        main([*base, "--logit-bias", "5"])
    assert e.value.code == 2 and "ID=BIAS" in capsys.readouterr().err
    for extra, needle in (
        (["--presence-penalty", "3"], "presence_penalty"),
        (["--logprobs", "2"], "--json"),
        (["--min-tokens", "9"], "min_tokens"),
    ):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err
