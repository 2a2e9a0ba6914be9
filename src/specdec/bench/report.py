"""The human table and the PNG plot of a ``specdec bench`` report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.bench.stats import ideal_speedup
from specdec.errors import SpecdecError

COLUMNS = ("contender", "tok/s", "×target", "×HF asst", "α", "acc.len", "c", "ideal", "eff", "identical")


def _f(value: Any, fmt: str, approx: bool = False) -> str:
    if value is None:
        return "-"
    return ("~" if approx else "") + format(value, fmt)


def _identical(row: dict[str, Any]) -> str:
    if row.get("identical_to_target_only") is None:
        return "-"
    if row["identical_to_target_only"]:
        return "yes"
    m = row["mismatches"]
    return f"NO {len(m)} (first @{m[0]['position']})"


def table(report: dict[str, Any]) -> str:
    """One line per contender; α marked ~ where inferred from forward-call counts."""
    lines = [tuple(_cells(r)) for r in report["contenders"]]
    widths = [max(len(str(x)) for x in col) for col in zip(COLUMNS, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*COLUMNS), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    return "\n".join(out)


def summary(report: dict[str, Any]) -> str:
    """Goals, trace overhead, costs, memory and notes, a few lines."""
    s = report["settings"]
    out = [
        f"{len(s['prompts'])} prompts, {s['max_new_tokens']} new tokens, greedy, {s['repeats']} repeat(s); "
        f"acc.len = tokens per target pass incl. the correction token; c = draft s/token ÷ target s/pass",
        "α = accepted / drafted; ideal = (1 − a^(τ+1)) / ((1 − a)(τc + 1)) with the per-token acceptance "
        "a = accepted / (accepted + rejections), the α of Leviathan et al.",
    ]
    for g in report["goals"]:
        value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        out.append(f"goal: {g['goal']}: {value} ({g['contender']}) -> {'MET' if g['met'] else 'not met'}")
    rows = {r["key"]: r for r in report["contenders"]}
    fixed = rows.get(report["best"].get("fixed_key") or "")
    if fixed and fixed.get("decode_speedup_vs_target_only") is not None:
        out.append(
            f"decode only (prefill excluded) at the best fixed τ={fixed['tau']}: "
            f"{fixed['decode_speedup_vs_target_only']:.2f}× target-only, "
            f"efficiency {fixed['decode_efficiency']:.0%} of the ideal formula"
        )
    if fixed and fixed.get("decode_efficiency_measured_verify") is not None:
        out.append(
            f"with the measured verify cost (a {fixed['tau'] + 1}-token pass = {fixed['verify_cost_ratio']:.2f}× a "
            f"one-token pass) the formula gives {fixed['ideal_speedup_measured_verify']:.2f}×: decode-only "
            f"efficiency {fixed['decode_efficiency_measured_verify']:.0%} (the rest: host overhead, clustered rejections)"
        )
    t = report.get("trace_overhead") or {}
    if "overhead" in t:
        out.append(
            f"trace overhead at τ={t['tau']}: {t['overhead']:+.1%} ({t['tokens_per_s_untraced']:.1f} -> "
            f"{t['tokens_per_s_traced']:.1f} tok/s)"
        )
    elif t.get("skipped"):
        out.append(f"trace overhead: skipped ({t['skipped']})")
    costs = report.get("costs") or {}
    if costs.get("t_verify"):
        verify = ", ".join(f"k={k} {v * 1e3:.2f}" for k, v in costs["t_verify"].items())
        draft = costs.get("t_draft_per_token")
        out.append(f"measured ms: draft/token {_f(draft and draft * 1e3, '.3f')}; target pass by block size: {verify}")
    rss = report.get("peak_rss_mib") or {}
    if rss:
        out.append(
            f"peak RSS: {rss.get('end', 0):.0f} MiB (after loading models: {rss.get('after_loading_models', 0):.0f})"
        )
    out += [f"note: {n}" for n in report.get("notes", [])]
    if report.get("elapsed_s") is not None:
        out.append(f"bench took {report['elapsed_s']:.0f} s (model loading included)")
    return "\n".join(out)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """tokens/s and speedup vs τ, with the ideal curve and the other contenders as horizontal lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecdecError(
            "--plot needs matplotlib: pip install matplotlib (or pip install 'specdec[bench]')"
        ) from None
    rows = report["contenders"]
    fixed = sorted((r for r in rows if r["kind"] == "fixed"), key=lambda r: r["tau"])
    others = [r for r in rows if r["kind"] != "fixed"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    taus = [r["tau"] for r in fixed]
    ax1.plot(taus, [r["tokens_per_s"] for r in fixed], "o-", label="specdec fixed τ")
    ax2.plot(taus, [r["speedup_vs_target_only"] for r in fixed], "o-", label="measured")
    ideal = [(r["tau"], r["ideal_speedup"]) for r in fixed if r["ideal_speedup"] is not None]
    if ideal:
        ax2.plot(*zip(*ideal), "s--", label="ideal (measured α, c)")
    priced = [(r["tau"], r["ideal_speedup_measured_verify"]) for r in fixed if r.get("ideal_speedup_measured_verify")]
    if priced:
        ax2.plot(*zip(*priced), "^:", label="ideal, verify at its measured cost")
    _ideal_curve(ax2, fixed)
    for i, r in enumerate(others):
        style = dict(color=f"C{(i + 2) % 10}", linestyle=":" if r["kind"].startswith("hf_") else "-.", linewidth=1.2)
        ax1.axhline(r["tokens_per_s"], label=r["label"], **style)
        if r["speedup_vs_target_only"] is not None and r["kind"] != "target_only":
            ax2.axhline(r["speedup_vs_target_only"], label=r["label"], **style)
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax1.set(xlabel="τ (draft tokens per step)", ylabel="tokens/s (prefill included)", title="Throughput")
    ax2.set(xlabel="τ (draft tokens per step)", ylabel="× specdec target-only", title="Speedup")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    s = report["settings"]
    fig.suptitle(f"specdec bench: {len(s['prompts'])} prompts, {s['max_new_tokens']} new tokens, greedy", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def _ideal_curve(ax: Any, fixed: list[dict[str, Any]]) -> None:
    """The formula as a smooth curve over τ with the pooled α and c of the fixed-τ runs."""
    pts = [r for r in fixed if r.get("alpha_per_token") is not None and r["c"] is not None]
    if not pts:
        return
    alpha = sum(r["alpha_per_token"] for r in pts) / len(pts)
    c = sum(r["c"] for r in pts) / len(pts)
    xs = [x / 10 for x in range(0, 10 * max(r["tau"] for r in pts) + 1)]
    ax.plot(
        xs,
        [ideal_speedup(alpha, x, c) if x > 0 else 1.0 for x in xs],
        color="grey",
        alpha=0.5,
        label=f"formula, mean per-token α={alpha:.2f}, c={c:.3f}",
    )


def markdown(report: dict[str, Any]) -> str:
    """The table, goals and measured costs as Markdown (docs/benchmarks.md is built from this)."""
    head = "| " + " | ".join(COLUMNS) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|"
    lines = [head, rule] + ["| " + " | ".join(_cells(r)) + " |" for r in report["contenders"]]
    out = ["\n".join(lines), ""]
    for g in report["goals"]:
        value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        margin = "" if g["margin"] is None else f" ({g['margin']:.0%} of the goal)"
        out.append(f"- {g['goal']}: **{value}** with `{g['contender']}`{margin}: {'met' if g['met'] else 'not met'}")
    out.append("")
    out.append("```")
    out.append(summary(report))
    out.append("```")
    return "\n".join(out)


def _cells(r: dict[str, Any]) -> list[str]:
    approx = not r.get("counts_exact", True)
    return [
        r["label"],
        _f(r["tokens_per_s"], ".1f"),
        _f(r["speedup_vs_target_only"], ".2f"),
        _f(r["speedup_vs_hf_assisted"], ".2f"),
        _f(r["alpha"], ".2f", approx),
        _f(r["mean_accepted_length"], ".2f", approx),
        _f(r["c"], ".3f"),
        _f(r["ideal_speedup"], ".2f"),
        _f(r["efficiency"], ".0%"),
        _identical(r),
    ]
