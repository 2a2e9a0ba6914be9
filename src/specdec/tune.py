"""``specdec tune``: which draft, which policy, how far to draft, answered from the user's own prompts.

For each candidate draft: run the prompts at τ = ``max_tau`` (greedy) and target-only, measure the
per-position conditional acceptance a_k and the costs (draft seconds per token, verify seconds for a
block of 1 and of τ+1 tokens, c = draft per token / verify of 1), and predict the speedup of every τ:

    speedup(τ) = E[n̂+1 | τ] / (τ·t_draft + t_verify(τ+1) + t_other)  ×  (t_verify(1) + t_other)

Then recommend the draft with the best prediction and a policy, and measure that configuration
against target-only on the same prompts, interleaved, to print predicted vs measured.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.analysis import StepAggregate, calibration
from specdec.bench.prompts import DEFAULT_PROMPTS
from specdec.bench.prompts import load_prompts as load_prompt_file
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


BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64)


def measure_batched_costs(engine: Any, rows: tuple[int, ...] = BATCH_ROWS, rounds: int = 3) -> dict[str, Any]:
    """The batched cost fields of a cost file, measured on ``engine``: a target pass over r sequences of one
    row each (``rows_table``, the shape of a busy server's plain step; a speculative step's ragged blocks cost
    about the same per row), a lockstep draft forward over 1 and 16 sequences (``draft_forward_s``,
    ``draft_row_frac``), and the models they were measured on (``model``), so a reader can tell whether they
    apply. Empty where the target cannot batch (the transformers runtime runs one sequence per pass)."""
    from specdec.real_shapes import pass_times  # torch-heavy; only when measuring

    target = engine.target
    usable = tuple(r for r in rows if 64 + r <= target.max_context)
    times = pass_times(target, usable, batches=True, rounds=rounds, min_seconds=0.02)
    if not times.batch:
        return {"batch_source": f"not measured: {times.batch_missing}"}
    out: dict[str, Any] = {
        "rows_table": {int(k): v for k, v in sorted(times.batch.items())},
        "batch_source": "measured by specdec tune (one pass over r sequences of one row each, 64 tokens of context)",
    }
    draft_runner = getattr(engine.drafter, "runner", None)
    if draft_runner is not None:
        d = pass_times(draft_runner, (1, 16), batches=True, rounds=rounds, min_seconds=0.02)
        if d.batch:
            one, many = d.batch[1], d.batch[16]
            out["draft_forward_s"] = one
            out["draft_row_frac"] = max(0.0, (many / one - 1.0) / 15.0)
    return out


def model_identity(engine: Any) -> dict[str, Any]:
    """What measured costs belong to: the target and draft checkpoints, their dtypes, the backend and the compute
    threads (a pass on one thread costs up to twice one on two: ``specdec serve`` computes on the CPUs less one)."""
    import torch

    from specdec.draft_vocab import head_size
    from specdec.draft_window import window_of
    from specdec.runtime import native_kernel

    target, drafter = engine.target, engine.drafter
    draft_runner = getattr(drafter, "runner", None)
    split = native_kernel.threads_config()
    return {
        "threads": int(torch.get_num_threads()) if split is None else f"{split[0]}, {split[1]} from {split[2]} rows",
        "target": str(target.name),
        "target_dtype": str(target.dtype).replace("torch.", ""),
        "draft": str(draft_runner.name) if draft_runner is not None else (drafter.name if drafter else None),
        "draft_dtype": str(draft_runner.dtype).replace("torch.", "") if draft_runner is not None else None,
        # the draft's output head (draft_vocab): its forward's cost
        "draft_head": head_size(draft_runner),
        "draft_window": window_of(draft_runner),  # the draft's attention window (draft_window): its forward's cost
        "backend": str(getattr(target, "backend", type(target).__name__)),
        "device": str(target.device),
    }


def matching_costs(engine: Any, path: Path | None = None) -> tuple[dict[int, float], dict[int, float], str]:
    """The batched pass costs of a cost file (``specdec tune --save-costs``; default ``$SPECDEC_COSTS`` or
    ``~/.cache/specdec/costs.json``) when they were measured on the engine's models: (seconds of a target pass
    by rows, seconds of a lockstep draft forward by sequences, a line saying what was used and why). A file
    measured on other models, or none, gives empty tables: the policy then learns its curves from steps alone."""
    path = path or measured_costs_path()
    if not path.is_file():
        return {}, {}, f"no measured costs ({path}): batch costs learnt from steps"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return {}, {}, f"measured costs {path} unreadable ({e}): not used"
    here = model_identity(engine)
    measured = doc.get("model") or {}
    if measured != here:
        if {**measured, "threads": here["threads"]} == here:
            return (
                {},
                {},
                (
                    f"measured costs {path} were measured with {measured.get('threads')} compute threads, these passes "
                    f"run on {here['threads']}: not used (specdec tune --threads "
                    f"{'auto' if isinstance(here['threads'], str) else here['threads']} --save-costs)"
                ),
            )
        return {}, {}, f"measured costs {path} are for other models or settings: not used (re-run specdec tune)"
    rows = {int(k): float(v) for k, v in (doc.get("rows_table") or {}).items()}
    drafts: dict[int, float] = {}
    if doc.get("draft_forward_s"):
        one, frac = float(doc["draft_forward_s"]), float(doc.get("draft_row_frac", 0.05))
        drafts = {n: one * (1.0 + frac * (n - 1)) for n in (1, 16)}
    if not rows:
        return {}, {}, f"measured costs {path} have no batched passes: batch costs learnt from steps"
    return rows, drafts, f"batch costs from {path} ({len(rows)} pass sizes measured)"
