"""Policy specs, running a grid (policies × workloads × seeds), aggregating, table / JSON / plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import InvalidRequestError
from specdec.policy import Policy, make_policy, parse_policy_spec
from specdec.simulate.costs import CostModel
from specdec.simulate.oracle import OraclePolicy
from specdec.simulate.runner import RunResult, simulate
from specdec.simulate.workloads import Workload

DEFAULT_POLICIES = ["fixed:tau=0", "fixed:tau=2", "fixed:tau=4", "fixed:tau=8", "heuristic", "confidence", "adaptive"]


def policy_factory(spec: str) -> Callable[[], Policy]:
    """``name`` or ``name:key=value,key=value`` (e.g. ``fixed:tau=4``, ``adaptive:margin=0.05``); ``oracle``."""
    name, kwargs = parse_policy_spec(spec)
    if name == "oracle":
        return lambda: OraclePolicy(**kwargs)
    make_policy(spec)  # fail now, with the policy's own message, not mid-run
    return lambda: make_policy(spec)


@dataclass
class Row:
    """One policy on one workload, averaged over seeds."""

    policy: str
    workload: str
    cost: str
    runs: list[dict[str, Any]]
    baseline_tps: float  # target-only tokens/s on the same workload, seeds and costs

    def mean(self, key: str) -> float | None:
        vals = [r[key] for r in self.runs if r[key] is not None]
        return sum(vals) / len(vals) if vals else None

    def to_json(self) -> dict[str, Any]:
        keys = [
            "tokens_per_s",
            "tokens_per_request",
            "passes_mean",
            "max_window_passes",
            "p95_latency_s",
            "slo_attainment",
            "budget_cut",
            "acceptance_rate",
        ]
        out: dict[str, Any] = {"policy": self.policy, "workload": self.workload, "cost": self.cost}
        out.update({k: self.mean(k) for k in keys})
        out["passes_max"] = max(r["passes_max"] for r in self.runs)
        out["speedup"] = (out["tokens_per_s"] or 0.0) / self.baseline_tps if self.baseline_tps else None
        out["seeds"] = [r["seed"] for r in self.runs]
        out["speedup_by_seed"] = [r["tokens_per_s"] / self.baseline_tps for r in self.runs] if self.baseline_tps else []
        return out


def run_grid(
    specs: list[str], workloads: list[Workload], costs: Callable[[Workload], CostModel], seeds: list[int]
) -> list[Row]:
    """Each policy spec gets a fresh long-lived instance per (workload, seed), as an engine would."""
    factories = {spec: policy_factory(spec) for spec in specs}
    base_factory = policy_factory("fixed:tau=0")
    rows = []
    for w in workloads:
        cost = costs(w)
        base = [simulate(base_factory(), w, cost, s).tokens_per_s for s in seeds]
        base_tps = sum(base) / len(base)
        for spec, factory in factories.items():
            runs: list[RunResult] = [simulate(factory(), w, cost, s, label=spec) for s in seeds]
            rows.append(Row(spec, w.name, cost.name, [r.summary() for r in runs], base_tps))
    return rows


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'workload':<18} {'policy':<22} {'tok/s':>8} {'speedup':>8} {'passes/req':>10} {'max':>5} "
        f"{'p95 lat':>9} {'SLO met':>8} {'cut':>6} {'tok/req':>8}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        j = row.to_json()
        slo_met = "-" if j["slo_attainment"] is None else f"{100 * j['slo_attainment']:.0f}%"
        lines.append(
            f"{row.workload[:18]:<18} {row.policy[:22]:<22} {j['tokens_per_s']:>8.1f} {j['speedup']:>7.2f}x "
            f"{j['passes_mean']:>10.2f} {j['passes_max']:>5d} {1e3 * j['p95_latency_s']:>7.0f}ms {slo_met:>8} "
            f"{100 * j['budget_cut']:>5.0f}% {j['tokens_per_request']:>8.1f}"
        )
    return "\n".join(lines)


def write_json(rows: list[Row], path: str | Path, meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "results": [r.to_json() for r in rows]}, indent=2) + "\n")


def plot(rows: list[Row], path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidRequestError("--plot needs matplotlib: pip install matplotlib", "plot") from None
    workloads = list(dict.fromkeys(r.workload for r in rows))
    policies = list(dict.fromkeys(r.policy for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(workloads) * max(1, len(policies)) / 4), 4.5))
    width = 0.8 / max(1, len(policies))
    for i, pol in enumerate(policies):
        ys = [
            next((r.to_json()["speedup"] for r in rows if r.workload == w and r.policy == pol), 0.0) for w in workloads
        ]
        ax.bar([x + i * width for x in range(len(workloads))], ys, width, label=pol)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=20, ha="right")
    ax.set_ylabel("speedup over target-only (tokens/s)")
    ax.set_title("specdec simulate")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
