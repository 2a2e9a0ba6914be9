"""Losslessness in distribution: the emitted tokens follow the target's (processed) distribution.

Statistical tests use fixed seeds, so each outcome is deterministic; every chi-square test rejects at
p < 1e-3 (``P_THRESHOLD``). Over the choice of seeds, a correct implementation fails a rule test with
probability ≤ 1e-3 and an engine test (four chi-square tests) with probability ≤ 4e-3 (union bound);
about 7% for the whole file (5 rule cases; 18 engine cases: 4 settings on 3 runtimes, 4 with predicted drafts, one
restricted draft head, one output format). A failure after a change that only
reorders random draws is therefore worth one rerun with other seeds before it is believed; one that
persists is a bug.

The engine tests run on every runtime that samples: ``transformers`` (``hf``), and the native runtime
through its one-call CPU kernel (``native-kernel``, the default on CPU) and through PyTorch operators
(``native-torch``, the kernel switched off).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from scipy.stats import chisquare

import specdec
from specdec.sampling import SamplingParams, logits_to_probs, sample
from specdec.verify import verify_sampling

P_THRESHOLD = 1e-3


def chi2_pvalue(counts: dict, expected_probs: dict, n: int) -> float:
    """Chi-square goodness of fit, pooling categories with expected count < 5 into one."""
    obs, exp = [], []
    pooled_o, pooled_e = 0.0, 0.0
    for key, prob in expected_probs.items():
        if prob * n >= 5:
            obs.append(counts.get(key, 0))
            exp.append(prob * n)
        else:
            pooled_o += counts.get(key, 0)
            pooled_e += prob * n
    pooled_o += sum(c for k, c in counts.items() if k not in expected_probs)
    if pooled_e == 0 and pooled_o > 0:
        return 0.0  # outcomes the target cannot produce
    if pooled_e > 0:
        obs.append(pooled_o)
        exp.append(pooled_e)
    if len(obs) < 2:
        return 1.0  # a single possible outcome, and only it was observed
    total = sum(exp)
    exp = [e * sum(obs) / total for e in exp]
    return float(chisquare(obs, exp).pvalue)


CASES = {
    "random": (torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25]), torch.tensor([0.3, 0.1, 0.1, 0.3, 0.2])),
    "draft mass where target has none": (
        torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0]),
        torch.tensor([0.1, 0.1, 0.4, 0.2, 0.2]),
    ),
    "draft one-hot": (torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25]), torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])),
    "equal distributions": (torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25]), torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])),
    "target one-hot": (torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]), torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])),
}


@pytest.mark.distribution
@pytest.mark.parametrize("case", list(CASES))
def test_rule_reproduces_target_distribution(case: str):
    """One draft position: ŷ ~ q, then the rule; the first emitted token must be ~ p.

    10,000 draws from ``torch.Generator().manual_seed(1234)``; one chi-square test at 1e-3: false-failure
    rate ≤ 1e-3 over seeds."""
    p, q = CASES[case]
    gen = torch.Generator().manual_seed(1234)
    n = 10000
    counts: dict[int, int] = {}
    target_probs = torch.stack([p, p])  # [τ+1, V]; the bonus row is p too
    for _ in range(n):
        y = sample(q[None], gen)  # [1]
        v = verify_sampling(y, q[None], target_probs, gen)
        counts[v.tokens[0]] = counts.get(v.tokens[0], 0) + 1
    expected = {i: float(p[i]) for i in range(len(p)) if p[i] > 0}
    assert all(k in expected for k in counts), f"emitted a token the target gives zero mass: {counts}"
    assert chi2_pvalue(counts, expected, n) > P_THRESHOLD


def exact_joint(target_dir, prompt_ids: list[int], params: SamplingParams, depth: int = 3) -> dict[tuple, float]:
    """The exact distribution of the first ``depth`` tokens of target-only sampling, by enumerating prefixes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    joint: dict[tuple, float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(depth):
            prefixes = [k for k, v in joint.items() if v > 1e-7]
            batch = torch.tensor([prompt_ids + list(k) for k in prefixes])
            probs = logits_to_probs(model(input_ids=batch).logits[:, -1], params)  # [B, V]
            new: dict[tuple, float] = {}
            for row, prefix in enumerate(prefixes):
                nz = torch.nonzero(probs[row] > 1e-7).flatten().tolist()
                for tok in nz:
                    new[prefix + (tok,)] = joint[prefix] * float(probs[row, tok])
            joint = new
    return joint


@pytest.fixture(scope="module")
def soft_draft(tiny_models, tmp_path_factory):
    """Same weights as the tiny llama target but a flatter output layer: partial acceptance."""
    from specdec.testing import tiny_checkpoint

    return tiny_checkpoint(
        tmp_path_factory.mktemp("soft") / "d", "llama", seed=0, tokenizer_from=tiny_models["llama"], sharpen=2.0
    )


PROMPT = "def fibonacci(n):"
SETTINGS = {
    "t1": dict(temperature=1.0),
    "t1-topk8": dict(temperature=1.0, top_k=8),
    "t0.8-topp0.8": dict(temperature=0.8, top_p=0.8),
    "t1-minp0.2": dict(temperature=1.0, min_p=0.2),  # keeps 67 of the 320 first tokens
}


@pytest.fixture(scope="module", params=list(SETTINGS))
def target_law(request: pytest.FixtureRequest, tiny_models):
    """(sampling settings, prompt ids, the exact law of the first three tokens, each position's marginal):
    enumerated once per settings and shared by every runtime (at temperature 1 the joint has 320³ entries and
    takes most of the test's time)."""
    from specdec.api import load_tokenizer

    settings = SETTINGS[request.param]
    prompt = list(load_tokenizer(tiny_models["llama"])(PROMPT)["input_ids"])
    joint = exact_joint(tiny_models["llama"], prompt, SamplingParams(**settings))
    marginals: list[dict[int, float]] = [{}, {}, {}]
    for k, v in joint.items():
        for pos, marg in enumerate(marginals):
            marg[k[pos]] = marg.get(k[pos], 0.0) + v
    return settings, prompt, joint, marginals


@pytest.mark.slow
@pytest.mark.distribution
def test_engine_first_three_tokens_match_target_sampling(tiny_models, soft_draft, target_law, runtime_name):
    """The joint law of the first three tokens, and each position's marginal, against the exact target law
    (enumerated with transformers in fp32), for each sampling setting on each runtime.

    600 generations with seeds 0..599; four chi-square tests at 1e-3: false-failure rate ≤ 4e-3 over seeds."""
    settings, prompt, joint, marginals = target_law
    engine = specdec.load(tiny_models["llama"], soft_draft, dtype="float32", runtime=runtime_name.split("-")[0])
    backend = getattr(engine.target, "backend", "transformers")
    expected = {"hf": "transformers", "native-kernel": "cpu-kernel", "native-torch": "torch-"}[runtime_name]
    assert backend.startswith(expected), backend
    assert engine.encode(PROMPT) == prompt
    engine.eos_ids = frozenset()  # sample exactly three tokens every time: EOS would end some runs early
    counts = first_three_follow_the_law(engine, prompt, settings, joint, marginals)
    assert all(len(k) == 3 for k in counts)


@pytest.mark.slow
@pytest.mark.distribution
def test_drafts_read_from_a_prediction_keep_the_target_law(tiny_models, soft_draft, target_law):
    """A request with a predicted output (``prediction``): steps draft from it where the output follows it (q one-hot
    on the predicted token) and from the draft model elsewhere. The prediction is the likeliest three tokens, so it is
    accepted in part. Four chi-square tests at 1e-3 per setting: false-failure rate ≤ 4e-3 over seeds."""
    settings, prompt, joint, marginals = target_law
    engine = specdec.load(tiny_models["llama"], soft_draft, dtype="float32")
    engine.eos_ids = frozenset()
    likeliest = list(max(joint, key=joint.__getitem__))
    first_three_follow_the_law(engine, prompt, settings, joint, marginals, prediction=likeliest)
    r = engine.generate(prompt, max_new_tokens=3, tau=3, seed=0, prediction=likeliest, **settings)
    assert r.records[0].reason == "prediction" and r.records[0].draft_tokens == likeliest[:2]  # 3 tokens: τ ≤ 2


def first_three_follow_the_law(
    engine, prompt, settings, joint, marginals, seeds: range = range(600), tau: int = 3, **request: Any
) -> dict[tuple, int]:
    """A generation of (up to) three tokens for each seed (τ = 3; ``request``: more ``Engine.start`` arguments): the
    draft partly accepted (τ > 0), the joint law and each position's marginal given not rejected at ``P_THRESHOLD``
    (one chi-square test each: four with the three marginals). Returns the counts."""
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    n = len(seeds)
    for seed in seeds:
        r = engine.generate(prompt, max_new_tokens=3, tau=tau, seed=seed, **settings, **request)
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    if tau:
        assert 0.05 < accepted / drafted < 0.95, "the draft should be partly accepted for this test to mean anything"
    assert chi2_pvalue(counts, joint, n) > P_THRESHOLD
    for pos, marg in enumerate(marginals):  # marginals of each position too
        cnt: dict[int, int] = {}
        for k, c in counts.items():
            if len(k) > pos:
                cnt[k[pos]] = cnt.get(k[pos], 0) + c
        assert chi2_pvalue(cnt, marg, n) > P_THRESHOLD, f"position {pos + 1}"
    return counts


@pytest.mark.slow
@pytest.mark.distribution
def test_plain_sampled_steps_keep_the_target_law(tiny_models, target_law):
    """τ = 0 on the CPU kernel: each token one draw from its target row (``sample_plain``: ``sd_sample_rows`` for a
    temperature-only request, torch's ops for the others), one pass a step and chained three passes a step (the
    passes after a step's first drawn by the chain). 600 seeds, four chi-square tests at 1e-3 (false-failure rate
    ≤ 4e-3 over seeds); the chained draws equal the unchained ones seed by seed."""
    settings, prompt, joint, marginals = target_law
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32", runtime="native")
    assert engine.target.backend.startswith("cpu-kernel")
    engine.eos_ids = frozenset()
    counts = first_three_follow_the_law(engine, prompt, settings, joint, marginals, tau=0)
    engine.chain_plain = 3
    chained: dict[tuple, int] = {}
    for seed in range(600):
        r = engine.generate(prompt, max_new_tokens=3, tau=0, seed=seed, **settings)
        assert max(rec.target_passes for rec in r.records) > 1
        chained[tuple(r.token_ids)] = chained.get(tuple(r.token_ids), 0) + 1
    assert chained == counts


@pytest.mark.distribution
def test_exact_joint_sums_to_one(tiny_models):
    joint = exact_joint(tiny_models["llama"], [5, 6, 7], SamplingParams(temperature=1.0, top_k=4), depth=2)
    assert abs(sum(joint.values()) - 1.0) < 1e-3
    assert all(len(k) == 2 for k in itertools.islice(joint, 10))


@pytest.mark.distribution
def test_same_seed_same_output(tiny_models):
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    a = engine.generate("def f(x):", max_new_tokens=16, temperature=1.0, seed=7, tau=3)
    b = engine.generate("def f(x):", max_new_tokens=16, temperature=1.0, seed=7, tau=3)
    c = engine.generate("def f(x):", max_new_tokens=16, temperature=1.0, seed=8, tau=3)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.slow
@pytest.mark.distribution
def test_a_draft_head_without_the_likeliest_tokens_keeps_the_target_law(tiny_models, soft_draft, target_law, tmp_path):
    """A restricted draft head (``draft_vocab``) that leaves out the two likeliest first tokens and half the
    vocabulary: those tokens come only from the residual max(0, p - q), and the first three tokens still follow the
    exact target law (CPU kernel; top-k 8 at temperature 1). 600 generations with seeds 0..599; four chi-square
    tests at 1e-3: false-failure rate ≤ 4e-3 over seeds."""
    import json
    import shutil

    import specdec.runtime.native_kernel as nk
    from specdec.draft_vocab import write_ranking

    settings, prompt, joint, marginals = target_law
    if settings != SETTINGS["t1-topk8"]:
        pytest.skip("one sampling setting is enough for the restricted head")
    if not nk.kernel_available():
        pytest.skip(f"CPU kernel unavailable: {nk.kernel_status()}")
    draft = tmp_path / "cut"
    shutil.copytree(soft_draft, draft)
    vocab = json.loads((draft / "config.json").read_text())["vocab_size"]
    left_out = sorted(marginals[0], key=lambda t: -marginals[0][t])[:2]
    ranked = [t for t in range(vocab) if t not in left_out] + left_out
    write_ranking(draft, ranked, [0] * vocab, "test")
    engine = specdec.load(tiny_models["llama"], draft, dtype="float32", draft_vocab=vocab // 2)
    assert not set(left_out) & set(engine.drafter.runner.head_tokens)
    engine.eos_ids = frozenset()
    counts = first_three_follow_the_law(engine, prompt, settings, joint, marginals)
    assert sum(c for k, c in counts.items() if k[0] in left_out) > 0.2 * 600  # the residual's tokens do come up


@pytest.mark.slow
@pytest.mark.distribution
def test_sampling_under_an_output_format_keeps_the_masked_target_law(tiny_models, soft_draft):
    """``response_format`` (a regex of lowercase words): the first three tokens (fewer where EOS ends the output, which
    the format allows once it is complete) follow the exact law of target-only sampling with every token the format
    forbids masked at each position, enumerated here with a fresh llguidance matcher per prefix (not the engine's
    rolled-back one). The draft is masked too, and partly accepted. 1,200 generations with seeds 600..1799, τ = 3;
    two chi-square tests at 1e-3: false-failure rate ≤ 2e-3 over seeds. (Seeds 0..599 put the first token's marginal
    at p = 5e-4 when this test was written; 8,000 generations put it at p = 0.68, and nine other blocks of 600 seeds
    at 0.30-0.98.)"""
    llguidance = pytest.importorskip("llguidance")
    from transformers import AutoModelForCausalLM

    from specdec.output_format import OutputFormat

    spec = {"type": "regex", "regex": "[a-z]+( [a-z]+)*"}
    settings = dict(temperature=1.0)
    engine = specdec.load(tiny_models["llama"], soft_draft, dtype="float32")
    prompt = engine.encode(PROMPT)
    (eos,) = engine.eos_ids
    fmt = OutputFormat.parse(spec)
    tokenizer = engine.formats._llg_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()
    joint: dict[tuple, float] = {}
    frontier: dict[tuple, float] = {(): 1.0}
    with torch.no_grad():
        for depth in range(3):
            prefixes = [k for k, v in frontier.items() if v > 1e-7]
            logits = model(input_ids=torch.tensor([prompt + list(k) for k in prefixes])).logits[:, -1]
            new: dict[tuple, float] = {}
            for row, prefix in enumerate(prefixes):
                m = llguidance.LLMatcher(tokenizer, fmt.grammar(), log_level=0)
                assert m.consume_tokens(list(prefix))
                bits = torch.tensor(list(m.compute_bitmask()), dtype=torch.uint8)
                allowed = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().flatten()
                masked = logits[row].masked_fill(~allowed[: logits.shape[-1]], float("-inf"))
                probs = logits_to_probs(masked[None], SamplingParams(**settings))[0]
                for tok in torch.nonzero(probs > 1e-7).flatten().tolist():
                    p = frontier[prefix] * float(probs[tok])
                    if tok == eos or depth == 2:
                        joint[prefix + (tok,)] = p
                    else:
                        new[prefix + (tok,)] = p
            frontier = new
    assert abs(sum(joint.values()) - 1.0) < 1e-3
    assert sum(p for k, p in joint.items() if k[-1] == eos) > 0.01, "EOS should end some outputs early"
    first: dict[int, float] = {}
    for k, p in joint.items():
        first[k[0]] = first.get(k[0], 0.0) + p
    first_three_follow_the_law(engine, prompt, settings, joint, [first], seeds=range(600, 1800), response_format=spec)
