"""Losslessness in distribution: the emitted tokens follow the target's (processed) distribution.

Statistical tests use fixed seeds (so they are deterministic) and a chi-square p-value threshold of
1e-3 each: over random seeds, the chance that any of the tests here fails on a correct
implementation is at most 1e-3 per test (about 1% for the whole file).
"""

from __future__ import annotations

import itertools

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


@pytest.mark.parametrize("case", list(CASES))
def test_rule_reproduces_target_distribution(case: str):
    """One draft position: ŷ ~ q, then the rule; the first emitted token must be ~ p."""
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [dict(temperature=1.0), dict(temperature=1.0, top_k=8), dict(temperature=0.8, top_p=0.8)],
    ids=["t1", "t1-topk8", "t0.8-topp0.8"],
)
def test_engine_first_three_tokens_match_target_sampling(tiny_models, soft_draft, settings):
    engine = specdec.load(tiny_models["llama"], soft_draft, dtype="float32", runtime="hf")
    engine.eos_ids = frozenset()  # sample exactly three tokens every time: EOS would end some runs early
    prompt = engine.encode("def fibonacci(n):")
    params = SamplingParams(**settings)
    joint = exact_joint(tiny_models["llama"], prompt, params)
    n = 600
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for seed in range(n):
        r = engine.generate(prompt, max_new_tokens=3, tau=3, seed=seed, **settings)
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    assert 0.05 < accepted / drafted < 0.95, "the draft should be partly accepted for this test to mean anything"
    assert all(len(k) == 3 for k in counts)
    assert chi2_pvalue(counts, joint, n) > P_THRESHOLD
    # marginals of each position too
    for pos in range(3):
        marg: dict[int, float] = {}
        for k, v in joint.items():
            marg[k[pos]] = marg.get(k[pos], 0.0) + v
        cnt: dict[int, int] = {}
        for k, c in counts.items():
            cnt[k[pos]] = cnt.get(k[pos], 0) + c
        assert chi2_pvalue(cnt, marg, n) > P_THRESHOLD, f"position {pos + 1}"


def test_exact_joint_sums_to_one(tiny_models):
    joint = exact_joint(tiny_models["llama"], [5, 6, 7], SamplingParams(temperature=1.0, top_k=4), depth=2)
    assert abs(sum(joint.values()) - 1.0) < 1e-3
    assert all(len(k) == 2 for k in itertools.islice(joint, 10))


def test_same_seed_same_output(tiny_models):
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    a = engine.generate("def f(x):", max_new_tokens=16, temperature=1.0, seed=7, tau=3)
    b = engine.generate("def f(x):", max_new_tokens=16, temperature=1.0, seed=7, tau=3)
    c = engine.generate("def f(x):", max_new_tokens=16, temperature=1.0, seed=8, tau=3)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
