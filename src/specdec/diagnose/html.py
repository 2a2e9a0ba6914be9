"""The self-contained HTML report: ranked findings and its plots as inline SVG (six, and the batched steps by depth
for a batching server's trace)."""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

from specdec.diagnose.svg import bar_chart, xy_chart

if TYPE_CHECKING:
    from specdec.diagnose import Diagnosis

MAX_POINTS = 4000  # scatter points kept per plot (evenly thinned) so huge traces still render

CSS = """body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}
.f{border-left:6px solid #999;padding:.4em 1em;margin:1em 0;background:#fafafa}
.critical{border-color:#b6443b}.warning{border-color:#e08a2c}.info{border-color:#3b6fb6}
.plots{display:flex;flex-wrap:wrap;gap:12px}.sev{font-weight:bold;text-transform:uppercase;font-size:.8em}"""


def render_html(d: Diagnosis) -> str:
    st = d.stats
    status = "no problems found" if not d.problems else f"{len(d.problems)} problem(s) found"
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>specdec diagnose</title>"
        f"<style>{CSS}</style></head><body>",
        f"<h1>specdec diagnose</h1><p>{escape(d.trace.path)}: {st.n_requests} requests, {len(st.steps)} "
        f"steps, {st.emitted} tokens — <b>{status}</b></p>",
        "<h2>Findings (ranked)</h2>",
    ]
    for f in d.findings:
        items = "".join(f"<li>{escape(e)}</li>" for e in f.evidence)
        action = "" if f.code == "summary" else f"<p><b>Recommended:</b> {escape(f.action)}</p>"
        parts.append(
            f"<div class='f {f.severity}'><span class='sev'>{f.severity}</span> <b>{escape(f.title)}</b> "
            f"<code>{f.code}</code><ul>{items}</ul>{action}</div>"
        )
    parts.append("<h2>Plots</h2><div class='plots'>")
    parts += [plot(d) for plot in PLOTS]
    parts.append("</div></body></html>")
    return "\n".join(parts)


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    step = max(1, len(points) // MAX_POINTS)
    return points[::step]


def plot_positions(d: Diagnosis) -> str:
    st = d.stats
    labels = [str(i + 1) for i in range(len(st.position_reached))]
    drafts_with = [sum(1 for s in st.steps if s.tau > i) for i in range(len(labels))]
    uncond = [a / n if n else 0.0 for a, n in zip(st.position_accepted, drafts_with)]
    return bar_chart(
        "Acceptance by draft position",
        labels,
        {"given earlier accepted": st.conditional_acceptance(), "per draft (vLLM)": uncond},
        ylabel="acceptance",
        ymax=1.0,
        xlabel="draft position",
    )


def plot_prompt_buckets(d: Diagnosis) -> str:
    b = d.stats.prompt_buckets
    return bar_chart(
        "Acceptance by prompt length",
        [x.label for x in b],
        {"α": [x.alpha for x in b]},
        ylabel="α",
        ymax=1.0,
        xlabel="prompt tokens",
    )


def plot_time_split(d: Diagnosis) -> str:
    st = d.stats
    total = st.total_time or 1.0
    return bar_chart(
        "Step time split",
        ["draft", "verify", "other"],
        {"share": [st.draft_time / total, st.verify_time / total, st.other_time / total]},
        ylabel="share of step time",
        ymax=1.0,
    )


def plot_verify(d: Diagnosis) -> str:
    st = d.stats
    pts = _thin([(float(s.tau + 1), s.verify_time * 1e3) for s in st.timed_steps])
    typical = [(float(k), v * 1e3) for k, v in st.fit.medians.items()]
    ideal = [(float(k), st.t1 * 1e3) for k in st.fit.medians]
    serial = [(float(k), st.t1 * 1e3 * k) for k in st.fit.medians]
    return xy_chart(
        "Verify time vs block size",
        {"steps": pts, "typical (p25)": typical, "parallel": ideal, "token by token": serial},
        ylabel="ms",
        xlabel="block size τ+1",
        lines=frozenset({"typical (p25)", "parallel", "token by token"}),
    )


def plot_tau(d: Diagnosis) -> str:
    pts = _thin([(float(i), float(s.tau)) for i, s in enumerate(d.stats.steps)])
    acc = _thin([(float(i), float(s.n_accepted)) for i, s in enumerate(d.stats.steps)])
    return xy_chart("τ over time (steps in trace order)", {"τ": pts, "n̂": acc}, ylabel="tokens", xlabel="step")


def plot_batch_depths(d: Diagnosis) -> str:
    """A batching server's trace: tokens/ms of each lockstep depth at the batch size most steps ran."""
    batch = d.stats.batch
    if batch is None:
        return ""
    several = len(batch.policies) > 1
    return bar_chart(
        f"Batched steps of {batch.sequences}: goodput by depth",
        [f"{g.policy + ' ' if several else ''}{g.depth} ({g.steps})" for g in batch.rows],
        {"tokens/ms": [g.tokens_per_ms for g in batch.rows]},
        ylabel="tokens/ms",
        xlabel=f"{'policy, ' if several else ''}lockstep depth (steps)",
    )


def plot_speedup(d: Diagnosis) -> str:
    st = d.stats
    tau = max(1, round(st.mean_tau))
    achieved = st.achieved_speedup() or 0.0
    return bar_chart(
        "Achieved vs ideal speedup",
        ["ideal", "modelled", "achieved"],
        {"× plain decoding": [st.mean_accepted_length, st.model_speedup(tau, with_overhead=True), achieved]},
        ylabel="× plain decoding",
    )


PLOTS = (
    plot_positions,
    plot_prompt_buckets,
    plot_time_split,
    plot_verify,
    plot_tau,
    plot_speedup,
    plot_batch_depths,
)
