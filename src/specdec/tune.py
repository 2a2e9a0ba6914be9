"""``specdec tune``: which draft, which policy, how far to draft, answered from the user's own prompts.

For each candidate draft: run the prompts at τ = ``max_tau`` (greedy) and target-only, measure the
per-position conditional acceptance a_k and the costs (draft seconds per token, verify seconds for a
block of 1 and of τ+1 tokens, c = draft per token / verify of 1), and predict the speedup of every τ:

    speedup(τ) = E[n̂+1 | τ] / (τ·t_draft + t_verify(τ+1) + t_other)  ×  (t_verify(1) + t_other)

Then recommend the draft with the best prediction and a policy, and measure that configuration
against target-only on the same prompts, interleaved, to print predicted vs measured.
"""

from __future__ import annotations

import functools
import json
import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.analysis import StepAggregate, calibration
from specdec.bench.prompts import DEFAULT_PROMPTS
from specdec.bench.prompts import load_prompts as load_prompt_file
from specdec.policy.base import MeasuredCosts
from specdec.policy.estimates import expected_emitted_all
from specdec.records import StepRecord
from specdec.simulate.costs import CostModel, fit_costs, measured_costs_path


def load_prompts(path: str | Path | None, limit: int | None = None) -> list[str]:
    """Prompt texts from a JSONL file (format and errors: :func:`specdec.bench.prompts.load_prompts`; default: the shipped
    held-out set), the first ``limit`` of them if given."""
    prompts = [p.text for p in load_prompt_file(path if path is not None else DEFAULT_PROMPTS)]
    return prompts[:limit] if limit else prompts


@dataclass
class DraftReport:
    draft: str
    rates: list[float]  # conditional acceptance a_k by draft position (measured at τ = max_tau)
    acceptance_rate: float  # α = accepted / drafted
    alpha_by_prompt: list[float]
    costs: dict[str, Any]  # the fitted CostModel as JSON
    c: float
    predicted: dict[int, float]  # τ -> predicted speedup over target-only
    best_tau: int
    calibration: list[tuple[float, float, int]] = field(default_factory=list)  # (bin low, P(accept), count)

    @property
    def best_speedup(self) -> float:
        return self.predicted[self.best_tau]


def position_rates(records: Sequence[StepRecord], max_tau: int) -> list[float]:
    """Conditional acceptance by position from steps' n̂ (only the accepted prefix and first rejection count),
    each shrunk toward the position before: deep positions are rare."""
    return StepAggregate.of(records).shrunk_rates(max_tau)


def predict(rates: list[float], cost: CostModel) -> dict[int, float]:
    emitted = expected_emitted_all(rates)
    plain = cost.verify(1) + cost.other_s
    return {
        tau: emitted[tau] / (tau * cost.draft_per_token_s + cost.verify(tau + 1) + cost.other_s) * plain
        for tau in range(len(rates) + 1)
    }


Runner = Callable[..., tuple[list[StepRecord], float, int, float]]


def run_prompts(
    engine: Any, prompts: list[str], max_new_tokens: int, **kwargs: Any
) -> tuple[list[StepRecord], float, int, float]:
    """Generate each prompt greedily; returns (records, decode seconds, new tokens, prefill s per token)."""
    records: list[StepRecord] = []
    decode = 0.0
    tokens = 0
    prefill, prompt_tokens = 0.0, 0
    for i, prompt in enumerate(prompts):
        res = engine.generate(prompt, max_new_tokens=max_new_tokens, request_id=f"tune-{i}", **kwargs)
        records.extend(res.records)
        decode += res.stats.latency - res.stats.prefill_time
        tokens += res.stats.new_tokens
        prefill += res.stats.prefill_time
        prompt_tokens += res.stats.prompt_tokens
    return records, decode, tokens, prefill / max(1, prompt_tokens)


def measure_draft(engine: Any, name: str, prompts: list[str], max_new_tokens: int, max_tau: int) -> DraftReport:
    for tau in (0, max_tau):  # warm-up: first calls of each shape pay allocation
        run_prompts(engine, prompts[:1], max_new_tokens, tau=tau)
    plain_recs, _, _, prefill = run_prompts(engine, prompts, max_new_tokens, tau=0)
    spec_recs, _, _, _ = run_prompts(engine, prompts, max_new_tokens, tau=max_tau)
    cost = fit_costs(plain_recs + spec_recs, name=f"measured:{name}", prefill_per_token_s=prefill)
    rates = position_rates(spec_recs, max_tau)
    by_prompt: dict[str, list[StepRecord]] = {}
    for r in spec_recs:
        by_prompt.setdefault(r.request_id, []).append(r)
    pred = predict(rates, cost)
    best = max(pred, key=lambda t: (pred[t], -t))
    return DraftReport(
        draft=name,
        rates=rates,
        acceptance_rate=StepAggregate.of(spec_recs).alpha or 0.0,
        alpha_by_prompt=[a for recs in by_prompt.values() if (a := StepAggregate.of(recs).alpha) is not None],
        costs=cost.to_json(),
        c=cost.c,
        predicted=pred,
        best_tau=best,
        calibration=calibration(spec_recs),
    )


@dataclass
class Recommendation:
    draft: str | None
    policy: str
    settings: dict[str, Any]
    predicted_speedup: float
    why: str


def recommend(reports: list[DraftReport], margin: float = 0.03) -> Recommendation:
    best = max(reports, key=lambda r: r.best_speedup)
    if best.best_speedup < 1.0 + margin:
        return Recommendation(
            None,
            "fixed",
            {"tau": 0},
            1.0,
            f"no draft beats target-only by {100 * margin:.0f}% (best {best.best_speedup:.2f}x)",
        )
    spread = _spread(best.alpha_by_prompt)
    if spread >= 0.2:
        return Recommendation(
            best.draft,
            "adaptive",
            {"max_tau": max(8, 2 * best.best_tau)},
            best.best_speedup,
            f"acceptance varies by prompt (10th-90th percentile spread {spread:.2f}): adapt τ per request",
        )
    return Recommendation(
        best.draft,
        "fixed",
        {"tau": best.best_tau},
        best.best_speedup,
        f"acceptance is steady across prompts (spread {spread:.2f}): one τ fits",
    )


def _spread(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    s = sorted(xs)
    return s[int(0.9 * (len(s) - 1))] - s[int(0.1 * (len(s) - 1))]


def measure_recommended(engine: Any, rec: Recommendation, prompts: list[str], max_new_tokens: int) -> dict[str, float]:
    """Recommended config vs target-only, interleaved per prompt so drift hits both alike."""
    kwargs: dict[str, Any] = {"tau": rec.settings["tau"]} if rec.policy == "fixed" else {}
    if rec.policy != "fixed":
        from specdec.policy import make_policy

        kwargs["policy"] = make_policy(rec.policy, **rec.settings)
    spec_s = plain_s = 0.0
    spec_n = plain_n = 0
    for i, prompt in enumerate(prompts):
        for which in ("plain", "spec"):
            t0 = time.perf_counter()
            res = engine.generate(
                prompt,
                max_new_tokens=max_new_tokens,
                request_id=f"measure-{which}-{i}",
                **(kwargs if which == "spec" else {"tau": 0}),
            )
            seconds = res.stats.latency - res.stats.prefill_time if res.stats.latency else time.perf_counter() - t0
            if which == "spec":
                spec_s, spec_n = spec_s + seconds, spec_n + res.stats.new_tokens
            else:
                plain_s, plain_n = plain_s + seconds, plain_n + res.stats.new_tokens
    spec_tps, plain_tps = spec_n / spec_s, plain_n / plain_s
    return {"tokens_per_s": spec_tps, "target_only_tokens_per_s": plain_tps, "speedup": spec_tps / plain_tps}


def to_json(reports: list[DraftReport], rec: Recommendation, measured: dict[str, float] | None) -> dict[str, Any]:
    return {"drafts": [asdict(r) for r in reports], "recommendation": asdict(rec), "measured": measured}


BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
STEP_SEQUENCES = 16  # a measured pass of r rows: min(r, 16) sequences of equal blocks, the shape of a speculative step
DRAFT_SEQUENCES = (1, 4, 16)  # lockstep drafts measured over this many sequences ...
DRAFT_DEPTHS = (1, 6)  # ... at these depths: the first forward and each further one
CONTEXT = 64  # tokens in every measured sequence's cache


def _timed(
    calls: dict[Any, Callable[[], float | None]],
    rounds: int,
    min_seconds: float,
    pick: Callable[[list[float]], float] = statistics.median,
) -> dict[Any, float]:
    """Seconds of each call over ``rounds`` (their median, or ``pick``: ``min`` where only a busy machine can make a
    call slower), the calls taking turns (machine noise hits them alike); a call returning seconds times itself (the
    part of it that is measured), else the whole call is timed. Each sample is the mean of as many calls as last
    ``min_seconds`` of wall time (a call that lasts that long alone is one sample, its sizing call the first)."""

    def once(fn: Callable[[], float | None]) -> tuple[float, float]:
        t0 = time.perf_counter()
        own = fn()
        wall = time.perf_counter() - t0
        return (own if own is not None else wall), wall

    counts = {}
    samples: dict[Any, list[float]] = {key: [] for key in calls}
    for key, fn in calls.items():  # warm up, then size each measurement to about min_seconds
        once(fn)
        seconds, wall = once(fn)
        counts[key] = max(1, math.ceil(min_seconds / max(wall, 1e-6)))
        if counts[key] == 1:
            samples[key].append(seconds)
    for _ in range(rounds):
        for key, fn in calls.items():
            if len(samples[key]) < rounds:
                samples[key].append(sum(once(fn)[0] for _ in range(counts[key])) / counts[key])
    return {key: pick(v) for key, v in samples.items()}


def measure_batched_costs(
    engine: Any,
    rows: tuple[int, ...] = BATCH_ROWS,
    rounds: int = 3,
    min_seconds: float = 0.02,
    pick: Callable[[list[float]], float] = statistics.median,
) -> dict[str, Any]:
    """The batched cost fields of a cost file, measured on ``engine`` in the shapes a speculative step runs:
    ``rows_table``, a target pass of r rows over min(r, 16) sequences of equal blocks (one row each up to 16; 16 × 2,
    16 × 4 ... beyond: a step's ragged blocks, which cost 10-20% less than as many rows of one-row sequences on the
    CPU kernel); ``draft_lines``, by sequences drafting, a lockstep greedy draft's first forward and each further one,
    each draft run behind a target pass as in a step (the first forward finds the draft's weights cold and takes in
    two tokens per sequence); ``draft_forward_s`` / ``draft_row_frac``, the mean forward of a 6-deep draft over one
    sequence and its growth per further sequence (the simulator's batched cost model); and the models they were
    measured on (``model``), so a reader can tell whether they apply. Empty where the target cannot batch (the
    transformers runtime runs one sequence per pass). About a second on the default pair with ``rounds=1``."""
    import torch

    target = engine.target
    if getattr(target, "forward_batch", None) is None:
        return {"batch_source": f"not measured: {type(target).__name__} runs one sequence per pass"}
    granule = int(getattr(target, "row_granule", 0) or 0)
    if granule and granule < max(rows):  # the first row past a group: what a further group costs
        rows = tuple(sorted({*rows, granule + 1}))
    rows = tuple(r for r in rows if CONTEXT + -(-r // STEP_SEQUENCES) <= target.max_context)
    gen = torch.Generator().manual_seed(0)
    vocab = int(target.vocab_size)

    def filled(runner: Any, n: int) -> list[Any]:
        """``n`` caches holding the same CONTEXT tokens: one prefilled, the rest its forks (``fork_cache``: a copy
        where the runtime can make one; a prefill of a 1B model costs ~0.3 s on these CPUs)."""
        prompt = torch.randint(0, vocab, (CONTEXT,), generator=gen)
        first = runner.new_cache()
        runner.forward(prompt, first, last_only=True)
        return [first] + [runner.fork_cache(first, prompt.tolist()) for _ in range(n - 1)]

    sequences = max(min(r, STEP_SEQUENCES) for r in rows)
    caches = filled(target, sequences)
    tokens = torch.randint(0, vocab, (max(rows),), generator=gen)

    def target_pass(n: int, k: int) -> None:
        target.forward_batch([(tokens[i * k : (i + 1) * k], caches[i]) for i in range(n)], keep=[k] * n)
        for c in caches[:n]:
            c.crop(CONTEXT)

    calls: dict[Any, Callable[[], float | None]] = {}
    for r in rows:
        n = min(r, STEP_SEQUENCES)
        calls[("pass", r)] = functools.partial(target_pass, n, -(-r // n))
    draft = getattr(engine.drafter, "runner", None)
    if draft is not None and getattr(draft, "forward_batch", None) is not None:
        draft_caches = filled(draft, max(DRAFT_SEQUENCES))
        dvocab = min(vocab, int(draft.vocab_size))
        pending = [[int(t) % dvocab for t in tokens[2 * i : 2 * i + 2]] for i in range(len(draft_caches))]

        def draft_run(n: int, depth: int) -> float:
            target_pass(n, 2)  # as in a step: the target's pass streams its weights through the caches first
            t0 = time.perf_counter()
            blocks = [(pending[i], draft_caches[i]) for i in range(n)]
            if draft.drafts_natively:
                draft.draft_greedy(blocks, [depth] * n, [None] * n, dvocab)
            else:
                feed = [torch.tensor(p) for p, _ in blocks]
                for j in range(depth):
                    draft.forward_batch([(f if j == 0 else f[-1:], c) for f, (_, c) in zip(feed, blocks)], True)
            seconds = time.perf_counter() - t0
            for c in draft_caches[:n]:
                c.crop(CONTEXT)
            return seconds

        for n in DRAFT_SEQUENCES:
            for depth in DRAFT_DEPTHS:
                calls[("draft", n, depth)] = functools.partial(draft_run, n, depth)
    times = _timed(calls, rounds, min_seconds, pick)
    out: dict[str, Any] = {
        "rows_table": {r: times[("pass", r)] for r in rows},
        "row_granule": granule,
        "batch_source": (
            f"measured: a target pass of r rows over min(r, {STEP_SEQUENCES}) sequences of equal blocks, "
            f"{CONTEXT} tokens of context"
        ),
    }
    if draft is not None and ("draft", 1, 1) in times:
        lo, hi = DRAFT_DEPTHS
        lines = {}
        for n in DRAFT_SEQUENCES:
            further = max(0.0, (times[("draft", n, hi)] - times[("draft", n, lo)]) / (hi - lo))
            lines[n] = (max(times[("draft", n, lo)] - (lo - 1) * further, 1e-9), further)
        out["draft_lines"] = {n: list(v) for n, v in lines.items()}
        mean = {n: times[("draft", n, hi)] / hi for n in DRAFT_SEQUENCES}
        many = max(DRAFT_SEQUENCES)
        out["draft_forward_s"] = mean[1]
        out["draft_row_frac"] = max(0.0, (mean[many] / mean[1] - 1.0) / (many - 1))
    return out


def model_identity(engine: Any) -> dict[str, Any]:
    """What measured costs belong to: the target and draft checkpoints, their dtypes and KV cache types, the backend
    and the compute threads (a pass on one thread costs up to twice one on two; a 16-sequence pass at 500 tokens of
    context reads its fp32 caches in 2.6 ms, its bf16 ones in 1.6)."""

    from specdec.draft_vocab import head_size
    from specdec.draft_window import window_of
    from specdec.runtime import native_kernel
    from specdec.runtime.native import kv_dtype_of

    target, drafter = engine.target, engine.drafter
    draft_runner = getattr(drafter, "runner", None)
    return {
        "threads": native_kernel.pass_threads(),
        "draft_threads": native_kernel.draft_threads(),
        "target": str(target.name),
        "target_dtype": str(target.dtype).replace("torch.", ""),
        "draft": str(draft_runner.name) if draft_runner is not None else (drafter.name if drafter else None),
        "draft_dtype": str(draft_runner.dtype).replace("torch.", "") if draft_runner is not None else None,
        # the draft's output head (draft_vocab): its forward's cost
        "draft_head": head_size(draft_runner),
        "draft_window": window_of(draft_runner),  # the draft's attention window (draft_window): its forward's cost
        "kv_dtype": kv_dtype_of(target),  # the caches' element type (both models'): the attention's bytes
        "backend": str(getattr(target, "backend", type(target).__name__)),
        "device": str(target.device),
    }


def costs_of(doc: dict[str, Any]) -> MeasuredCosts:
    """The batched costs of a cost file's fields (``measure_batched_costs``) as a policy is primed with them."""
    drafts: dict[int, float] = {}
    if doc.get("draft_forward_s"):
        one, frac = float(doc["draft_forward_s"]), float(doc.get("draft_row_frac", 0.05))
        drafts = {n: one * (1.0 + frac * (n - 1)) for n in (1, 16)}
    return MeasuredCosts(
        passes={int(k): float(v) for k, v in (doc.get("rows_table") or {}).items()},
        draft_forwards=drafts,
        draft_lines={int(k): (float(v[0]), float(v[1])) for k, v in (doc.get("draft_lines") or {}).items()},
        row_granule=int(doc.get("row_granule") or 0),
    )


def matching_costs(engine: Any, path: Path | None = None) -> tuple[MeasuredCosts, str]:
    """The batched pass costs of a cost file (``specdec tune --save-costs``; default ``$SPECDEC_COSTS`` or
    ``~/.cache/specdec/costs.json``) when they were measured on the engine's models, and a line saying what was used
    and why. A file measured on other models, or none, gives empty costs."""
    path = path or measured_costs_path()
    none = MeasuredCosts()
    if not path.is_file():
        return none, f"no measured costs ({path})"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return none, f"measured costs {path} unreadable ({e}): not used"
    here = model_identity(engine)
    measured = doc.get("model") or {}
    if measured != here:
        if {**measured, "threads": here["threads"], "draft_threads": here["draft_threads"]} == here:
            return none, (
                f"measured costs {path} were measured with {measured.get('threads')} compute threads (drafts on "
                f"{measured.get('draft_threads', 'as many')}), these passes run on {here['threads']} (drafts on "
                f"{here['draft_threads']}): not used (specdec tune --threads {here['threads']} --save-costs)"
            )
        return none, f"measured costs {path} are for other models or settings: not used (re-run specdec tune)"
    costs = costs_of(doc)
    if not costs.passes:
        return none, f"measured costs {path} have no batched passes: not used"
    why = implausible_costs(
        {"rows_table": costs.passes, "draft_lines": costs.draft_lines, "row_granule": costs.row_granule}
    )
    if why is not None:  # a file from before tune checked its measurements, or edited
        return none, f"measured costs {path} are implausible ({why}: a busy machine?): not used (re-run specdec tune)"
    return costs, f"batch costs from {path} ({len(costs.passes)} pass sizes measured)"


def _on_own_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own, which ends with it. A thread that runs a parallel pass keeps a pool of OpenMP
    helper threads until it ends. A server's passes run on its worker thread; measured on the main thread instead, the
    server's passes stayed 8-14% slower for good (1 client, five of five interleaved runs against a server that
    measured nothing; measured on a thread that ended: even). With a second pool alive libgomp counts more threads than
    CPUs and throttles its spinning at barriers, so every barrier of a pass sleeps and is woken through the kernel: the
    caller's own team goes first (``release_thread_team``), or the measured passes run that way (a caller that had
    run 2-thread passes measured each further lockstep draft forward of 16 sequences at 1.0-1.2 ms instead of 0.35-0.38)."""
    from specdec.runtime.native_kernel import release_thread_team

    release_thread_team()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="specdec-measure")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["out"]


# A server's start: batch costs measured over this many rounds (the least of each), up to this many times while what
# they say cannot be the machine's own (``implausible_costs``), a random pause of up to this many seconds between.
START_ROUNDS = 3
START_ATTEMPTS = 4
START_PAUSE_S = 2.0


def implausible_costs(measured: dict[str, Any]) -> str | None:
    """Why batch costs measured at a start cannot be the machine's own, or None: a pass of more rows measured well
    below one of fewer (a pass of 16 rows at 18 ms and one of 32 at 9) or well above its share of rows (32 rows at
    8.4 ms where 16 took 2.7: a pass of twice the rows costs at most twice as much), or a lockstep draft whose further
    forwards cost nothing (its deeper draft measured faster than its shallower one). All are what passes pre-empted
    by another process leave: two servers started at the same moment on two cores measured each other's loading,
    16-sequence draft lines of (8.5 ms, 0) and (44 ms, 0) against (1.0, 0.43) alone, and the one whose policy started
    from them served 0.73-0.83x a fixed tau = 2 for its whole life where the others served 0.90-1.00x."""
    table = measured.get("rows_table") or {}
    sizes = sorted(table)
    granule = int(measured.get("row_granule") or 0)
    for a, b in zip(sizes, sizes[1:]):
        # Past a whole number of row groups a pass may pay for a further group whole (``row_granule``).
        share = max(b / a, -(-b // granule) / -(-a // granule)) if granule else b / a
        if table[b] < 0.85 * table[a] or table[b] > 1.15 * table[a] * share:
            return f"a pass of {b} rows measured {table[b] * 1e3:.2f} ms, of {a} rows {table[a] * 1e3:.2f} ms"
    for n, (_, further) in sorted((measured.get("draft_lines") or {}).items()):
        if further <= 0.0:
            return f"a draft over {n} sequences measured no cost per further forward"
    return None


def starting_costs(engine: Any, path: Path | None = None, measure: bool = True) -> tuple[MeasuredCosts, str]:
    """What a server's batch cost curves start from, and a line saying so: a cost file measured on its models
    (``matching_costs``), else, with ``measure``, its passes measured now (``measure_batched_costs``, the least of
    START_ROUNDS rounds, about a second: a server started cold priced deeper drafts from its first steps' noise and
    served 0.90-0.94x a fixed τ at 16 clients), again after a random pause while they are implausible (a busy
    machine: ``implausible_costs``), and nothing after START_ATTEMPTS such tries (the curves then learn from steps
    alone, which served better than starting from a busy machine's figures); without ``measure``, nothing.
    Measured only where the target's passes batch (the CPU kernel): elsewhere a step runs one pass per sequence,
    and a larger model's measurement would take minutes."""
    costs, note = matching_costs(engine, path)
    if costs:
        return costs, note
    if not getattr(engine.target, "batches", False):  # one pass per sequence (transformers, the operator path)
        return costs, note + ": batch costs learnt from steps (this target runs one pass per sequence)"
    if not measure:
        return costs, note + ": batch costs learnt from steps"
    t0 = time.perf_counter()
    measured, attempts, why = plausible_batched_costs(
        lambda: measure_batched_costs(engine, rounds=START_ROUNDS, min_seconds=0.01, pick=min)
    )
    if why is None:
        again = f", {attempts} tries: the machine was busy" if attempts > 1 else ""
        return costs_of(measured), (
            f"{note}: batch costs measured now in {time.perf_counter() - t0:.1f} s{again} "
            "(specdec tune --threads auto --save-costs keeps them in a file)"
        )
    return costs, (
        f"{note}: batch costs learnt from steps (measured {attempts} times at start, implausible each time, "
        f"the machine busy: {why})"
    )


def plausible_batched_costs(
    measure: Callable[[], dict[str, Any]], attempts: int = START_ATTEMPTS
) -> tuple[dict[str, Any], int, str | None]:
    """``measure()`` (``measure_batched_costs`` on an engine, run on a thread of its own) up to ``attempts`` times,
    after a random pause each time its figures are implausible (``implausible_costs``): the last figures, the tries
    taken and why they are implausible (None: plausible). Servers started together pause for different times."""
    pause = random.Random()  # seeded from the OS
    for attempt in range(1, attempts + 1):
        measured = _on_own_thread(measure)
        why = implausible_costs(measured)
        if why is None or attempt == attempts:
            return measured, attempt, why
        time.sleep(pause.uniform(0.25, 1.0) * START_PAUSE_S)
    raise AssertionError("unreachable")


def prime_for_serving(engine: Any, settings: Any) -> str:
    """Prime a server's engine with the pass costs ``settings.costs`` names (``ServerSettings.costs``) and return the
    line that says where they came from (``/health``'s ``costs``). A cost file named but not measured on these models
    is an error (``InvalidRequestError``); without one, a batching server with a drafter measures its passes now."""
    from specdec.errors import InvalidRequestError

    if settings.costs == "none":
        note = "batch costs learnt from steps (--costs none)"
    else:
        if settings.costs:
            costs, note = matching_costs(engine, Path(settings.costs))
            if not costs:
                raise InvalidRequestError(f"--costs: {note}", "costs")
        else:
            costs, note = starting_costs(engine, measure=settings.max_batch > 1 and engine.drafter is not None)
        engine.prime(costs)
    engine.costs_note = note
    return note
