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

from typing import Any

import pytest
import torch
from scipy.stats import chisquare

import specdec
from specdec.sampling import SamplingParams, logits_to_probs, sample
from specdec.verify import verify_sampling

P_THRESHOLD = 1e-3


def chi2_pvalue(counts: dict, expected_probs: dict | Law, n: int) -> float:
    """Chi-square goodness of fit, pooling categories with expected count < 5 into one. ``expected_probs``: a dict of
    outcome -> probability (every outcome the target can produce), or a ``Law``; an outcome drawn that the target
    gives no mass fails the test (p = 0)."""
    pooled_o, pooled_e = 0.0, 0.0
    if isinstance(expected_probs, Law):
        expected_probs, rest = expected_probs.listed(counts, n)
        if any(expected_probs[key] <= 0.0 for key in counts):
            return 0.0  # outcomes the target cannot produce
        pooled_e = rest * n
    obs, exp = [], []
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


class Law:
    """The exact law of the first ``depth`` tokens of target-only sampling (``exact_joint``): a dense float64 tensor
    over vocabulary^depth, read as the tests need it. At temperature 1 the tiny target's law of three tokens has 320³
    entries: as a dict of tuples (until session 83) its building and every chi-square test's walk over it took
    ~200 s of each test that enumerated it."""

    def __init__(self, probs: torch.Tensor) -> None:
        self.probs = probs

    def __getitem__(self, outcome: tuple[int, ...]) -> float:
        if len(outcome) != self.probs.dim() or not all(0 <= t < n for t, n in zip(outcome, self.probs.shape)):
            return 0.0
        return float(self.probs[outcome])

    def total(self) -> float:
        return float(self.probs.sum())

    def marginals(self) -> list[dict[int, float]]:
        """Each position's marginal law: token -> probability, the tokens with mass."""
        out = []
        for pos in range(self.probs.dim()):
            others = [d for d in range(self.probs.dim()) if d != pos]
            m = self.probs.sum(dim=others) if others else self.probs
            out.append({t: p for t, p in enumerate(m.tolist()) if p > 0.0})
        return out

    def likeliest(self) -> tuple[int, ...]:
        index, out = int(self.probs.argmax()), []
        for size in reversed(self.probs.shape):
            out.append(index % size)
            index //= size
        return tuple(reversed(out))

    def listed(self, counts: dict, n: int) -> tuple[dict[tuple, float], float]:
        """For a chi-square test of ``n`` draws with these ``counts``: the outcomes expected 5 times or more and every
        outcome drawn, with their probabilities, and the mass of all the others (one pooled category)."""
        big = torch.nonzero(self.probs * n >= 5).tolist()
        listed = {tuple(i): float(self.probs[tuple(i)]) for i in big}
        for key in counts:
            listed[key] = self[key]
        return listed, max(0.0, self.total() - sum(listed.values()))


def exact_joint(target_dir, prompt_ids: list[int], params: SamplingParams, depth: int = 3) -> Law:
    """The exact law of the first ``depth`` tokens of target-only sampling, by enumerating the prefixes the target can
    produce (each one's next-token law from one fp32 forward of transformers, the last position's logits only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    prompt = torch.tensor(prompt_ids)
    law = torch.ones((), dtype=torch.float64)
    with torch.no_grad():
        for _ in range(depth):
            prefixes = torch.nonzero(law > 0.0)  # [prefixes, depth so far]
            rows = []
            for chunk in prefixes.split(4096):
                batch = torch.cat([prompt.expand(len(chunk), -1), chunk], dim=1)
                logits = model(input_ids=batch, logits_to_keep=1).logits[:, -1]
                rows.append(logits_to_probs(logits, params).double())
            probs = torch.cat(rows)
            grown = torch.zeros((*law.shape, probs.shape[-1]), dtype=torch.float64)
            at = tuple(prefixes.T)
            grown[at] = law[at][..., None] * probs
            law = grown
    return Law(law)


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
    return settings, prompt, joint, joint.marginals()


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
    likeliest = list(joint.likeliest())
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
def test_exact_joint_is_the_law_of_the_first_tokens(tiny_models):
    """The enumerated law of two tokens at top-k 4: 16 outcomes, summing to one, its likeliest one's probability the
    chain rule's from two forwards of its own; and the chi-square test reads the ``Law`` as it reads the same law as
    a dict, an outcome of no mass failing it either way."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=1.0, top_k=4)
    joint = exact_joint(tiny_models["llama"], [5, 6, 7], params, depth=2)
    assert joint.probs.shape == (320, 320) and int((joint.probs > 0).sum()) == 16
    assert abs(joint.total() - 1.0) < 1e-6  # (each row of probabilities sums to one in fp32)
    a, b = joint.likeliest()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = logits_to_probs(model(input_ids=torch.tensor([[5, 6, 7]])).logits[:, -1], params)[0, a]
        p2 = logits_to_probs(model(input_ids=torch.tensor([[5, 6, 7, a]])).logits[:, -1], params)[0, b]
    assert joint[(a, b)] == pytest.approx(float(p1) * float(p2), rel=1e-5)
    assert [sum(m.values()) for m in joint.marginals()] == [pytest.approx(1.0), pytest.approx(1.0)]
    as_dict = {tuple(k): joint[tuple(k)] for k in torch.nonzero(joint.probs).tolist()}
    rare = min(as_dict, key=as_dict.__getitem__)
    counts = {(a, b): 25, rare: 3, **{k: 2 for k in list(as_dict)[:6] if k not in ((a, b), rare)}}
    n = sum(counts.values())
    assert chi2_pvalue(counts, joint, n) == pytest.approx(chi2_pvalue(counts, as_dict, n))
    impossible = next((x, y) for x in range(320) for y in range(320) if (x, y) not in as_dict)
    assert chi2_pvalue({**counts, impossible: 1}, joint, n + 1) == 0.0


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
