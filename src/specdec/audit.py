"""Losslessness audit: is a speculative configuration's output exactly the target's?

Greedy: replay prompts with target-only decoding (τ = 0, same engine, same runtime) and with the
speculative configuration; compare token by token; the first divergence is the finding.
Sampling: draw many seeded completions from the speculative configuration and test the first
positions' token frequencies against the target's exact distributions (one target forward per
context), with a chi-square goodness-of-fit test and a log-likelihood z-test. Tests are
Bonferroni-corrected, so a correct engine fails an audit with probability at most ``alpha`` (default 1e-3).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specdec.engine import Engine
from specdec.sampling import SamplingParams, logits_to_probs

Prompt = str | Sequence[int]
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are pooled
MIN_GROUP = 20  # samples sharing a first token before its second-position distribution is tested


@dataclass
class Divergence:
    prompt_index: int
    prompt: str
    position: int  # 0-based index into the generated tokens
    expected: int | None  # target-only token (None: target-only decoding ended here)
    got: int | None  # speculative token (None: it ended here)
    expected_text: str
    got_text: str
    logit_margin: float | None = None  # target logit(expected) - logit(got) there; ~0 means a near tie

    def describe(self) -> str:
        near = ""
        if self.logit_margin is not None and abs(self.logit_margin) < 1e-2:
            near = (
                f" (near tie: target logits differ by {self.logit_margin:.1e}; likely a numerical difference "
                "between block and single-token kernels, e.g. bf16)"
            )
        return (
            f"prompt {self.prompt_index} ({_short(self.prompt)}): first divergence at generated position "
            f"{self.position}: target-only {_tok(self.expected, self.expected_text)}, speculative "
            f"{_tok(self.got, self.got_text)}{near}"
        )


@dataclass
class DistributionTest:
    prompt_index: int
    position: int  # 1-based generated position
    samples: int
    chi2: float
    dof: int
    p_value: float  # of the two tests below together: 2 × the smaller p-value (Bonferroni)
    loglik_z: float  # mean log p(token) of the samples vs its exact mean under the target, in standard errors
    tv: float  # total-variation distance, empirical vs exact (biased upward by sampling noise)
    threshold: float  # per-test significance level after Bonferroni
    worst: str = ""  # the most over-represented token, for the report

    @property
    def ok(self) -> bool:
        return self.p_value >= self.threshold


@dataclass
class AuditResult:
    mode: str  # greedy | sampling
    prompts: int
    tokens_compared: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    tests: list[DistributionTest] = field(default_factory=list)
    alpha: float = 1e-3

    @property
    def ok(self) -> bool:
        return not self.divergences and all(t.ok for t in self.tests)

    @property
    def first_failure(self) -> str | None:
        if self.divergences:
            return self.divergences[0].describe()
        bad = [t for t in self.tests if not t.ok]
        if bad:
            t = min(bad, key=lambda x: x.p_value)
            return (
                f"prompt {t.prompt_index}: position {t.position} is not distributed as the target's "
                f"(chi-square {t.chi2:.1f} on {t.dof} dof, log-likelihood z = {t.loglik_z:+.1f}; combined "
                f"p = {t.p_value:.2e} < {t.threshold:.1e}; "
                f"TV distance {t.tv:.3f}; {t.worst})"
            )
        return None

    def text(self) -> str:
        if self.mode == "greedy":
            head = (
                f"greedy audit: {self.prompts} prompt(s), {self.tokens_compared} tokens compared with "
                "target-only decoding"
            )
        else:
            head = (
                f"sampling audit: {len(self.tests)} distribution test(s) over {self.prompts} prompt(s), "
                f"false-failure rate ≤ {self.alpha:g}"
            )
        if self.ok:
            return f"PASS  {head}: outputs match the target\n"
        lines = [f"FAIL  {head}", f"  {self.first_failure}"]
        if len(self.divergences) > 1:
            lines.append(f"  {len(self.divergences)} of {self.prompts} prompts diverge")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "ok": self.ok,
            "prompts": self.prompts,
            "tokens_compared": self.tokens_compared,
            "first_failure": self.first_failure,
            "divergences": [asdict(d) for d in self.divergences],
            "tests": [asdict(t) | {"ok": t.ok} for t in self.tests],
            "alpha": self.alpha,
        }


def audit_greedy(
    engine: Engine,
    prompts: Sequence[Prompt],
    max_new_tokens: int | Sequence[int] = 64,
    recorded: Sequence[Sequence[int]] | None = None,
    **spec_kwargs: Any,
) -> AuditResult:
    """Compare greedy outputs token by token: target-only vs speculative (or vs ``recorded`` outputs,
    e.g. the ones a trace says were served). ``max_new_tokens``: one limit, or one per prompt.
    ``spec_kwargs`` (tau, policy) choose the speculative run (default: the engine's configuration)."""
    result = AuditResult(mode="greedy", prompts=len(prompts))
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    for i, prompt in enumerate(prompts):
        ref = engine.generate(prompt, max_new_tokens=limits[i], temperature=0.0, tau=0).token_ids
        if recorded is not None:
            got = list(recorded[i])
        else:
            got = engine.generate(prompt, max_new_tokens=limits[i], temperature=0.0, **spec_kwargs).token_ids
        n = min(len(ref), len(got))
        result.tokens_compared += n
        pos = next((j for j in range(n) if ref[j] != got[j]), n)
        if pos < max(len(ref), len(got)):
            result.divergences.append(_divergence(engine, i, prompt, ref, got, pos))
    return result


def _divergence(engine: Engine, i: int, prompt: Prompt, ref: list[int], got: list[int], pos: int) -> Divergence:
    exp = ref[pos] if pos < len(ref) else None
    out = got[pos] if pos < len(got) else None
    margin = None
    if exp is not None and out is not None:
        logits = _next_logits(engine, engine.encode(prompt) + ref[:pos])
        margin = float(logits[exp] - logits[out])
    return Divergence(
        prompt_index=i,
        prompt=_as_text(engine, prompt),
        position=pos,
        expected=exp,
        got=out,
        expected_text=_decode(engine, exp),
        got_text=_decode(engine, out),
        logit_margin=margin,
    )


def audit_sampling(
    engine: Engine,
    prompts: Sequence[Prompt],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    runs: int = 400,
    positions: int = 2,
    seed: int = 0,
    alpha: float = 1e-3,
    max_new_tokens: int | None = None,
    **spec_kwargs: Any,
) -> AuditResult:
    """Chi-square goodness of fit of the first ``positions`` generated tokens against the target.

    Position 1 is tested against p(· | prompt); position 2 within each group of runs that share the
    first token y1 against p(· | prompt, y1). ``max_new_tokens`` defaults to positions + 8 so that the
    first step drafts a full block.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if params.greedy:
        raise ValueError("audit_sampling needs temperature > 0; use audit_greedy for greedy decoding")
    result = AuditResult(mode="sampling", prompts=len(prompts), alpha=alpha)
    eos = min(engine.eos_ids) if engine.eos_ids else None
    raw: list[tuple[int, list[int], list[list[int]]]] = []
    for i, prompt in enumerate(prompts):
        samples = []
        for r in range(runs):
            res = engine.generate(
                prompt,
                max_new_tokens=max_new_tokens or positions + 8,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed + r,
                **spec_kwargs,
            )
            toks = list(res.token_ids[:positions])
            if len(toks) < positions and res.finish_reason == "stop" and eos is not None:
                toks.append(eos)  # the engine strips EOS; it is a category of its own
            samples.append(toks)
        raw.append((i, engine.encode(prompt), samples))
    planned: list[tuple[int, int, list[int], list[int]]] = []  # (prompt index, position, context, tokens)
    for i, ids, samples in raw:
        planned.append((i, 1, ids, [s[0] for s in samples if s]))
        if positions >= 2:
            groups: dict[int, list[int]] = {}
            for s in samples:
                if len(s) >= 2 and s[0] != eos:
                    groups.setdefault(s[0], []).append(s[1])
            planned += [(i, 2, ids + [y1], toks) for y1, toks in groups.items() if len(toks) >= MIN_GROUP]
    threshold = alpha / max(1, len(planned))
    for i, pos, context, toks in planned:
        probs = _target_probs(engine, context, params, eos)
        result.tests.append(fit_test(i, pos, toks, probs, threshold, lambda t: _decode(engine, t)))
    return result


def _target_probs(engine: Engine, context: list[int], params: SamplingParams, eos: int | None) -> torch.Tensor:
    probs = logits_to_probs(_next_logits(engine, context)[None], params)[0]  # [V]
    if eos is not None:  # every EOS id ends generation the same way: one category
        for other in engine.eos_ids:
            if other != eos and other < probs.shape[0]:
                probs[eos] += probs[other]
                probs[other] = 0.0
    return probs


def fit_test(
    i: int, pos: int, toks: list[int], probs: torch.Tensor, threshold: float, decode: Callable[[int], str] = str
) -> DistributionTest:
    """Do the sampled ``toks`` follow ``probs [V]``? Chi-square (pooled cells) and log-likelihood z, combined."""
    n = len(toks)
    counts = Counter(toks)
    expected = probs.double() * n  # [V]
    order = torch.argsort(expected, descending=True).tolist()
    big = [t for t in order if expected[t] >= MIN_EXPECTED]
    cells_e = [float(expected[t]) for t in big]
    cells_o = [float(counts.get(t, 0)) for t in big]
    rest_e, rest_o = float(n - sum(cells_e)), float(n - sum(cells_o))  # every rarer token, pooled
    if rest_e >= MIN_EXPECTED or not cells_e:
        cells_e.append(max(rest_e, 1e-12))
        cells_o.append(rest_o)
    else:
        cells_e[-1] += rest_e
        cells_o[-1] += rest_o
    chi2 = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e))
    if any(float(probs[t]) <= 0 for t in counts):
        chi2 = float("inf")  # a token the target never produces was emitted
    dof = max(1, len(cells_e) - 1)
    p_chi = 0.0 if chi2 == float("inf") else _chi2_sf(chi2, dof)
    z = _loglik_z(toks, probs)
    p_ll = math.erfc(abs(z) / math.sqrt(2))
    p_value = min(1.0, 2 * min(p_chi, p_ll))
    seen_p = sum(float(probs[t]) for t in counts)
    tv = 0.5 * (sum(abs(c / n - float(probs[t])) for t, c in counts.items()) + max(0.0, 1.0 - seen_p))
    worst_tok = max(counts, key=lambda t: counts[t] / n - float(probs[t])) if counts else None
    worst = ""
    if worst_tok is not None:
        worst = (
            f"{_tok(worst_tok, decode(worst_tok))} drawn {counts[worst_tok] / n:.1%} of the time, "
            f"target probability {float(probs[worst_tok]):.1%}"
        )
    return DistributionTest(
        prompt_index=i,
        position=pos,
        samples=n,
        chi2=chi2,
        dof=dof,
        p_value=p_value,
        loglik_z=z,
        tv=tv,
        threshold=threshold,
        worst=worst,
    )


def _chi2_sf(chi2: float, dof: int) -> float:
    """P(X ≥ chi2) for X ~ chi-square(dof): the regularised upper incomplete gamma Q(dof/2, chi2/2)."""
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(chi2 / 2.0, dtype=torch.float64)))


def _loglik_z(toks: list[int], probs: torch.Tensor) -> float:
    """Sensitive where chi-square is not (flat targets, few big cells): tokens the target finds unlikely
    pull the samples' mean log-probability below its exact mean E_p[log p] (CLT over n samples)."""
    p = probs.double()
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    mean = float((p * logp).sum())
    var = float((p * (logp - mean) ** 2).sum())
    if var <= 0 or not toks:
        return 0.0
    if any(float(p[t]) <= 0 for t in toks):
        return -math.inf
    observed = sum(float(logp[t]) for t in toks) / len(toks)
    return (observed - mean) / math.sqrt(var / len(toks))


@torch.inference_mode()
def _next_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The target's next-token logits after ``ids``, from a fresh cache (no speculative path involved)."""
    x = torch.tensor(ids, dtype=torch.long, device=engine.target.device)
    return engine.target.forward(x, engine.target.new_cache(), last_only=True)[-1].float()


def _decode(engine: Engine, token: int | None) -> str:
    if token is None:
        return "<end>"
    if token in engine.eos_ids:
        return "<eos>"
    return str(engine.tokenizer.decode([token]))


def _as_text(engine: Engine, prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else str(engine.tokenizer.decode(list(prompt)))


def _tok(token: int | None, text: str) -> str:
    return "<end of output>" if token is None else f"token {token} {text!r}"


def _short(text: str, n: int = 40) -> str:
    flat = text.replace("\n", "⏎")
    return repr(flat if len(flat) <= n else flat[:n] + "…")
