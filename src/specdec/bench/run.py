"""``specdec bench``: every contender on the same prompts and models in one process, interleaved.

For each prompt, each repeat runs every contender once (A B C ... A B C, the order rotated per
repeat so no contender always runs first); each contender is warmed up first. A contender's
tokens/s is its generated tokens over the sum of its per-prompt median wall times (prefill
included), and every ratio is a ratio of those tokens/s figures. Prompts live in ``prompts``, contenders
in ``contenders``, analysis in ``stats``, table and plot in ``report``.
"""

from __future__ import annotations

import resource
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.contenders import Contender, EngineContender, HFModels, RunResult, Runs, hf_contenders
from specdec.bench.prompts import Prompt
from specdec.bench.stats import best_speculative, costs_from_runs, goals, steps_of, summarize_contender
from specdec.engine import Engine
from specdec.errors import InvalidRequestError

DEFAULT_POLICIES = ("adaptive", "heuristic")
SCHEMA_VERSION = 1

Log = Callable[[str], None]


@dataclass
class BenchConfig:
    prompts: list[Prompt]
    max_new_tokens: int = 128
    taus: list[int] = field(default_factory=lambda: list(range(1, 9)))
    policies: list[str] = field(default_factory=lambda: list(DEFAULT_POLICIES))
    repeats: int = 3
    warmup_tokens: int = 32  # each contender runs once on the first prompt, this long, before timing
    hf: bool = True
    lookup_tokens: int = 10
    trace_prompts: int = 0  # prompts for the trace-overhead comparison (0 = skip)
    quick: bool = False
    ignore_eos: bool = False  # every contender generates exactly max_new_tokens (EOS kept as a token)


@dataclass
class BenchModels:
    """Our engines (one with the drafter, one target-only sharing the same target) and transformers copies."""

    spec: Engine | None  # None when no drafter is loaded
    target_only: Engine
    hf: HFModels | None
    info: dict[str, Any]


def engine_contenders(models: BenchModels, cfg: BenchConfig, notes: list[str]) -> list[Contender]:
    out: list[Contender] = [
        EngineContender("target_only", "specdec target-only", "target_only", models.target_only, tau=0)
    ]
    if models.spec is None:
        notes.append("no drafter loaded: speculative contenders skipped")
        return out
    out += [EngineContender(f"fixed_tau{t}", f"specdec τ={t}", "fixed", models.spec, tau=t) for t in cfg.taus]
    from specdec.policy import POLICIES, make_policy, parse_policy_spec

    for name in cfg.policies:
        if parse_policy_spec(name)[0] in POLICIES:
            make_policy(name)  # bad settings fail here, with the policy's own message
            out.append(EngineContender(f"policy_{name}", f"specdec policy {name}", "policy", models.spec, policy=name))
        else:
            notes.append(f"policy {name!r} is not registered (have: {', '.join(sorted(POLICIES))}): skipped")
    return out


def all_contenders(models: BenchModels, cfg: BenchConfig, notes: list[str]) -> list[Contender]:
    out = engine_contenders(models, cfg, notes)
    if cfg.hf and models.hf is not None:
        out += hf_contenders(models.hf, models.target_only.eos_ids, cfg.lookup_tokens)
        if models.hf.assisted_skipped is not None:
            notes.append(f"transformers assisted generation skipped: {models.hf.assisted_skipped}")
        elif models.hf.draft is None:
            notes.append("no draft model: transformers assisted generation skipped")
    else:
        notes.append("transformers contenders skipped (--no-hf)")
    for c in out:
        c.ignore_eos = cfg.ignore_eos
    return out


def encode_prompts(engine: Engine, prompts: Sequence[Prompt], max_new_tokens: int) -> None:
    for p in prompts:
        p.ids = engine.encode(p.text)
        if len(p.ids) + max_new_tokens > engine.max_context:
            raise InvalidRequestError(
                f"prompt {p.id!r} ({len(p.ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the context "
                f"window of {engine.max_context} tokens",
                "prompts",
            )


def measure(contenders: Sequence[Contender], prompts: Sequence[Prompt], cfg: BenchConfig, log: Log) -> Runs:
    """Warm every contender up, then run them interleaved, prompt by prompt, ``cfg.repeats`` times."""
    warm = prompts[0]
    for c in contenders:
        c.run(warm.ids, min(cfg.warmup_tokens, cfg.max_new_tokens))
    runs: Runs = {c.key: {p.id: [] for p in prompts} for c in contenders}
    n = len(contenders)
    for i, p in enumerate(prompts):
        for r in range(cfg.repeats):
            shift = (i * cfg.repeats + r) % n
            for c in list(contenders[shift:]) + list(contenders[:shift]):
                runs[c.key][p.id].append(c.run(p.ids, cfg.max_new_tokens))
        log(f"  [{i + 1}/{len(prompts)}] {p.id} ({len(p.ids)} prompt tokens) done")
    return runs


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20


def run_bench(
    models: BenchModels, cfg: BenchConfig, log: Log = lambda s: None, extra: Sequence[Contender] = ()
) -> dict[str, Any]:
    """Measure everything and return the report (the JSON written by ``--json``)."""
    notes: list[str] = []
    rss_loaded = peak_rss_mib()
    contenders = all_contenders(models, cfg, notes) + list(extra)
    encode_prompts(models.target_only, cfg.prompts, cfg.max_new_tokens)
    log(
        f"{len(contenders)} contenders × {len(cfg.prompts)} prompts × {cfg.repeats} repeats, "
        f"{cfg.max_new_tokens} new tokens each"
    )
    runs = measure(contenders, cfg.prompts, cfg, log)
    report = summarize(contenders, cfg, runs, notes)
    report["trace_overhead"] = trace_overhead(models, cfg, report, log)
    report["models"] = models.info
    report["peak_rss_mib"] = {
        "after_loading_models": round(rss_loaded, 1),
        "end": round(peak_rss_mib(), 1),
        "note": "one process runs every contender, so the peak is the process's, not per contender",
    }
    return report


def summarize(contenders: Sequence[Contender], cfg: BenchConfig, runs: Runs, notes: list[str]) -> dict[str, Any]:
    ref_key = "target_only"
    reference = {p.id: runs[ref_key][p.id][0].tokens for p in cfg.prompts} if ref_key in runs else None
    hf_ref = {p.id: runs["hf_target"][p.id][0].tokens for p in cfg.prompts} if "hf_target" in runs else None
    t_pass = _target_pass_time(runs.get(ref_key, {}))
    rows = [summarize_contender(c, cfg.prompts, runs[c.key], t_pass, reference, hf_ref) for c in contenders]
    by_key = {r["key"]: r for r in rows}
    for r in rows:
        base, assisted = by_key.get(ref_key), by_key.get("hf_assisted")
        r["speedup_vs_target_only"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["speedup_vs_hf_assisted"] = r["tokens_per_s"] / assisted["tokens_per_s"] if assisted else None
        r["efficiency"] = (
            r["speedup_vs_target_only"] / r["ideal_speedup"]
            if r.get("ideal_speedup") and r["speedup_vs_target_only"] is not None
            else None
        )
        base_decode = base.get("decode_tokens_per_s") if base else None
        r["decode_speedup_vs_target_only"] = (
            r["decode_tokens_per_s"] / base_decode if base_decode and r.get("decode_tokens_per_s") else None
        )
        r["decode_efficiency"] = (
            r["decode_speedup_vs_target_only"] / r["ideal_speedup"]
            if r.get("ideal_speedup") and r["decode_speedup_vs_target_only"] is not None
            else None
        )
        r["decode_efficiency_measured_verify"] = (
            r["decode_speedup_vs_target_only"] / r["ideal_speedup_measured_verify"]
            if r.get("ideal_speedup_measured_verify") and r["decode_speedup_vs_target_only"] is not None
            else None
        )
    best = best_speculative(rows)
    return {
        "version": SCHEMA_VERSION,
        "settings": {
            "max_new_tokens": cfg.max_new_tokens,
            "taus": cfg.taus,
            "policies": cfg.policies,
            "repeats": cfg.repeats,
            "warmup_tokens": cfg.warmup_tokens,
            "prompts": [{"id": p.id, "source": p.source, "tokens": len(p.ids)} for p in cfg.prompts],
            "quick": cfg.quick,
            "greedy": True,
            "eos": (
                "ignored (--ignore-eos): every contender generates exactly max_new_tokens, EOS kept as a token"
                if cfg.ignore_eos
                else "every contender stops at the target's EOS ids; outputs are compared in full (length included) "
                "and each contender's tokens/s counts its own tokens"
            ),
            "timing": "wall time per request, prefill included; per-prompt median over repeats; tokens/s = "
            "tokens / sum of medians; ratios are ratios of tokens/s",
        },
        "contenders": rows,
        "best": best,
        "goals": goals(rows, best),
        "costs": costs_from_runs(runs),
        "notes": notes,
    }


def _target_pass_time(runs_by_prompt: dict[str, list[RunResult]]) -> float | None:
    """Seconds per target pass of a plain decoding step (the c denominator)."""
    plain = steps_of(r for rs in runs_by_prompt.values() for r in rs).verify_by_block.get(1)
    return statistics.median(plain) if plain else None


def trace_overhead(models: BenchModels, cfg: BenchConfig, report: dict[str, Any], log: Log) -> dict[str, Any]:
    """Best fixed τ with and without a JSONL trace, interleaved on the first ``cfg.trace_prompts`` prompts."""
    tau = (report.get("best") or {}).get("fixed_tau")
    if cfg.trace_prompts <= 0:
        return {"skipped": "not requested"}
    if tau is None or models.spec is None:
        return {"skipped": "no speculative contender ran"}
    try:
        from specdec.trace import JsonlTrace
    except ImportError:
        return {"skipped": "specdec.trace.JsonlTrace is not available in this build"}
    import tempfile

    spec = models.spec
    with tempfile.TemporaryDirectory() as tmp:
        trace = JsonlTrace(Path(tmp) / "bench_trace.jsonl")
        traced = Engine(
            spec.target,
            spec.tokenizer,
            spec.drafter,
            spec.policy,
            [*spec.observers, trace],
            max_context=spec.max_context,
        )
        pair = [
            EngineContender("untraced", f"τ={tau}", "fixed", spec, tau=tau),
            EngineContender("traced", f"τ={tau} + JsonlTrace", "trace", traced, tau=tau),
        ]
        for c in pair:
            c.ignore_eos = cfg.ignore_eos
        prompts = cfg.prompts[: cfg.trace_prompts]
        log(f"trace overhead: τ={tau} with and without JsonlTrace on {len(prompts)} prompts")
        runs = measure(pair, prompts, cfg, log)
        close = getattr(trace, "close", None)
        if close:
            close()
    tps = {
        k: sum(len(v[p.id][0].tokens) for p in prompts)
        / sum(statistics.median(r.seconds for r in v[p.id]) for p in prompts)
        for k, v in runs.items()
    }
    return {
        "tau": tau,
        "prompts": len(prompts),
        "tokens_per_s_untraced": tps["untraced"],
        "tokens_per_s_traced": tps["traced"],
        "overhead": tps["untraced"] / tps["traced"] - 1.0,
    }
