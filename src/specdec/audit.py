"""Losslessness audit: is a speculative configuration's output exactly the target's?

Greedy: replay prompts with target-only decoding (τ = 0, same engine, same runtime) and with the
speculative configuration; compare token by token; the first divergence is the finding.
Sampling: draw many seeded completions from the speculative configuration and test the first
positions' token frequencies against the target's exact distributions (one target forward per
context), with a chi-square goodness-of-fit test and a log-likelihood z-test. Tests are
Bonferroni-corrected, so a correct engine fails an audit with probability at most ``alpha`` (default 1e-3).
Batched (``batch`` > 1): the speculative runs are served up to ``batch`` at a time through shared steps, joining
mid-flight in a seeded order and leaving when done, as a server with ``--max-batch`` serves them; each greedy output
is still compared with its solo target-only run, so a row that depends on its company shows as a divergence.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specdec.engine import Engine, Generation, GenerationResult
from specdec.logits_rules import LogitsRules, RulesState
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
    # Batched audits: the speculative step that emitted the divergent position, and its pass's company.
    step: int | None = None
    sequences: int | None = None  # sequences that shared that step's passes
    rows: int | None = None  # rows of that step's target pass
    request: str | None = None  # trace audits: the served request, "<request id> in <trace file>"

    def describe(self) -> str:
        near = ""
        if self.logit_margin is not None and abs(self.logit_margin) < 1e-2:
            near = (
                f" (near tie: target logits differ by {self.logit_margin:.1e}; likely a numerical difference "
                "between block and single-token kernels, e.g. bf16)"
            )
        where = ""
        if self.step is not None:
            where = f" (step {self.step}, its pass shared by {self.sequences} sequence(s), {self.rows} rows)"
        served = f", request {self.request}" if self.request is not None else ""
        return (
            f"prompt {self.prompt_index} ({_short(self.prompt)}{served}): first divergence at generated position "
            f"{self.position}{where}: target-only {_tok(self.expected, self.expected_text)}, speculative "
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
    batch: int = 1  # speculative runs served at once (1: one at a time)
    steps: int = 0  # batched audits: speculative steps over all runs (one per run per step)
    shared_steps: int = 0  # of those, steps whose passes held other sequences too
    max_sequences: int = 0  # the most sequences in one step
    max_rows: int = 0  # the most rows in one target pass
    prefill_in_step: int = 0  # batched audits: the engine's prompt budget per step (0: prompts prefilled alone)

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
        if self.batch > 1:
            head += (
                f"; served up to {self.batch} at a time: {self.shared_steps} of {self.steps} steps shared their "
                f"passes (up to {self.max_sequences} sequences, {self.max_rows} rows a pass; "
                + (
                    f"prompts taken in by the steps, up to {self.prefill_in_step} tokens a step)"
                    if self.prefill_in_step
                    else "each prompt prefilled in a pass of its own)"
                )
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
            "batch": self.batch,
            "steps": self.steps,
            "shared_steps": self.shared_steps,
            "max_sequences": self.max_sequences,
            "max_rows": self.max_rows,
            "prefill_in_step": self.prefill_in_step,
        }

    def count_steps(self, engine: Engine, generations: Sequence[Generation]) -> None:
        """Add the company the runs' steps kept (batched audits)."""
        self.prefill_in_step = engine.prefill_in_step
        for g in generations:
            for r in g.records:
                self.steps += 1
                self.shared_steps += r.batch_size > 1
                self.max_sequences = max(self.max_sequences, r.batch_size)
                self.max_rows = max(self.max_rows, r.rows)


def serve_in_batches(engine: Engine, requests: Sequence[dict[str, Any]], batch: int, seed: int = 0) -> list[Generation]:
    """Run ``requests`` (``Engine.start`` keyword arguments) up to ``batch`` at a time through ``Engine.step``, as a
    continuously batching server would (prompts taken in as ``engine.prefill_in_step`` says): in an order shuffled by
    ``seed``, each step fills every free slot half the time and otherwise admits between one request and as many as
    there are free slots (uniformly), so batches run full and requests still join mid-flight, meet different company,
    and leave the moment they finish. Returns the finished generations in the order of ``requests``."""
    rng = random.Random(seed)
    order = list(range(len(requests)))
    rng.shuffle(order)
    gens: list[Generation | None] = [None] * len(requests)
    active: list[Generation] = []
    while order or active:
        free = min(batch - len(active), len(order))
        for _ in range(free if free and rng.random() < 0.5 else rng.randint(1, free) if free else 0):
            i = order.pop()
            g = gens[i] = engine.start(**requests[i])
            active.append(g)
        engine.step(active)
        active = [g for g in active if not g.done]
    return [g for g in gens if g is not None]


def audit_greedy(
    engine: Engine,
    prompts: Sequence[Prompt],
    max_new_tokens: int | Sequence[int] = 64,
    recorded: Sequence[Sequence[int]] | None = None,
    batch: int = 1,
    seed: int = 0,
    request_kwargs: Sequence[Mapping[str, Any]] | None = None,
    **spec_kwargs: Any,
) -> AuditResult:
    """Compare greedy outputs token by token: target-only vs speculative (or vs ``recorded`` outputs,
    e.g. the ones a trace says were served). ``max_new_tokens``: one limit, or one per prompt.
    ``request_kwargs``: each prompt's own ``Engine.start`` arguments for both runs (its logits rules: penalties,
    ``logit_bias``, ``min_tokens``, ``ignore_eos``, e.g. as a trace recorded them).
    ``spec_kwargs`` (tau, policy) choose the speculative run (default: the engine's configuration).
    ``batch`` > 1: the speculative runs share steps, up to ``batch`` at a time (``serve_in_batches``, ``seed``);
    the target-only references still run alone."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if batch > 1 and recorded is not None:
        raise ValueError("a batched audit runs the speculative side itself; recorded outputs have no runs to batch")
    result = AuditResult(mode="greedy", prompts=len(prompts), batch=batch)
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    own = [dict(kw) for kw in request_kwargs] if request_kwargs is not None else [{} for _ in prompts]
    for kw, limit in zip(own, limits):
        # A recorded output a stop string cut may be shorter than its min_tokens: over the positions compared, EOS is
        # masked at every one either way.
        if kw.get("min_tokens", 0) > limit:
            kw["min_tokens"] = limit
    runs: list[GenerationResult] | None = None
    if batch > 1:
        requests = [
            dict(prompt=p, max_new_tokens=n, temperature=0.0, **kw, **spec_kwargs)
            for p, n, kw in zip(prompts, limits, own)
        ]
        gens = serve_in_batches(engine, requests, batch, seed)
        result.count_steps(engine, gens)
        runs = [g.result() for g in gens]
    for i, prompt in enumerate(prompts):
        ref = engine.generate(prompt, max_new_tokens=limits[i], temperature=0.0, tau=0, **own[i]).token_ids
        run: GenerationResult | None = None
        if recorded is not None:
            got = list(recorded[i])
        else:
            run = runs[i] if runs is not None else None
            if run is None:
                run = engine.generate(prompt, max_new_tokens=limits[i], temperature=0.0, **own[i], **spec_kwargs)
            got = run.token_ids
        n = min(len(ref), len(got))
        result.tokens_compared += n
        pos = next((j for j in range(n) if ref[j] != got[j]), n)
        if pos < max(len(ref), len(got)):
            d = _divergence(engine, i, prompt, ref, got, pos, margin=not own[i])
            if batch > 1 and run is not None:
                _locate(d, run)
            result.divergences.append(d)
    return result


def _locate(d: Divergence, run: GenerationResult) -> None:
    """The step of ``run`` that emitted position ``d.position``, and its company."""
    emitted = 0
    for r in run.records:
        emitted += len(r.emitted)
        if emitted > d.position:
            d.step, d.sequences, d.rows = r.step, r.batch_size, r.rows
            return


def _divergence(
    engine: Engine, i: int, prompt: Prompt, ref: list[int], got: list[int], pos: int, margin: bool = True
) -> Divergence:
    """The first divergence, with the target's raw logit margin there (``margin``: not for a request whose logits
    rules moved its logits)."""
    exp = ref[pos] if pos < len(ref) else None
    out = got[pos] if pos < len(got) else None
    gap = None
    if margin and exp is not None and out is not None:
        logits = _next_logits(engine, engine.encode(prompt) + ref[:pos])
        gap = float(logits[exp] - logits[out])
    return Divergence(
        prompt_index=i,
        prompt=_as_text(engine, prompt),
        position=pos,
        expected=exp,
        got=out,
        expected_text=_decode(engine, exp),
        got_text=_decode(engine, out),
        logit_margin=gap,
    )


def audit_sampling(
    engine: Engine,
    prompts: Sequence[Prompt],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    runs: int = 400,
    positions: int = 2,
    seed: int = 0,
    alpha: float = 1e-3,
    max_new_tokens: int | None = None,
    batch: int = 1,
    rules: Mapping[str, Any] | None = None,
    **spec_kwargs: Any,
) -> AuditResult:
    """Chi-square goodness of fit of the first ``positions`` generated tokens against the target.

    Position 1 is tested against p(· | prompt); position 2 within each group of runs that share the
    first token y1 against p(· | prompt, y1). ``max_new_tokens`` defaults to positions + 8 so that the
    first step drafts a full block. ``batch`` > 1: the runs of all prompts share steps, up to ``batch`` at
    a time (``serve_in_batches``, shuffled by ``seed``); each run keeps its own seed. ``rules``: logits rules of every
    run (``Engine.start`` arguments: penalties, ``logit_bias``, ``min_tokens``, ``ignore_eos``), applied to the target's
    distributions the runs are tested against as target-only decoding applies them.
    """
    rules = dict(rules or {})
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if params.greedy:
        raise ValueError("audit_sampling needs temperature > 0; use audit_greedy for greedy decoding")
    result = AuditResult(mode="sampling", prompts=len(prompts), alpha=alpha, batch=batch)
    eos = min(engine.eos_ids) if engine.eos_ids else None
    limit = max_new_tokens or positions + 8
    requests = [
        dict(
            prompt=prompt,
            max_new_tokens=limit,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed + r,
            **rules,
            **spec_kwargs,
        )
        for prompt in prompts
        for r in range(runs)
    ]
    if batch > 1:
        gens = serve_in_batches(engine, requests, batch, seed)
        result.count_steps(engine, gens)
        results = [g.result() for g in gens]
    else:
        results = [engine.generate(**kw) for kw in requests]
    raw: list[tuple[int, list[int], list[list[int]]]] = []
    for i, prompt in enumerate(prompts):
        samples = []
        for res in results[i * runs : (i + 1) * runs]:
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
    checked = LogitsRules.checked(**rules, vocab_size=engine.side.vocab_size, max_new_tokens=limit)
    prompt_lens = {i: len(ids) for i, ids, _ in raw}
    for i, pos, context, toks in planned:
        probs = _target_probs(engine, context, params, eos, checked, prompt_lens[i])
        result.tests.append(fit_test(i, pos, toks, probs, threshold, lambda t: _decode(engine, t)))
    return result


def _target_probs(
    engine: Engine,
    context: list[int],
    params: SamplingParams,
    eos: int | None,
    rules: LogitsRules | None = None,
    prompt_len: int | None = None,
) -> torch.Tensor:
    """The target's next-token distribution after ``context`` as target-only decoding samples it: its logits under
    ``rules`` (the tokens after ``prompt_len`` counted as generated), then temperature, top-k, top-p and min-p."""
    logits = _next_logits(engine, context)[None]
    if rules is not None and rules.active:
        start = len(context) if prompt_len is None else prompt_len
        matcher = engine.formats.matcher(rules.output_format) if rules.output_format is not None else None
        state = RulesState(rules, context[:start], logits.shape[-1], engine.eos_ids, logits.device, matcher)
        state.commit(context[start:])
        logits = state.apply(logits)
    probs = logits_to_probs(logits, params)[0]  # [V]
    if eos is not None and not (rules is not None and rules.ignore_eos):  # every EOS id ends it alike: one category
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
