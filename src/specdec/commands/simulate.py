"""``specdec simulate``: compare τ policies on simulated workloads and cost models, without models."""

from __future__ import annotations

import argparse
import sys

from specdec.errors import InvalidRequestError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="compare tau policies on simulated workloads (no models needed)",
        description="Deterministic (seeded) replay of acceptance processes under cost models, driving the real "
        "policy objects. Speedup is over target-only decoding on the same requests.",
    )
    p.add_argument(
        "--workload",
        action="append",
        default=None,
        metavar="NAME",
        help="workload (repeatable; default: all shipped). 'replay:TRACE.jsonl' replays a recorded trace",
    )
    p.add_argument("--trace", action="append", default=None, metavar="FILE", help="same as --workload replay:FILE")
    p.add_argument("--list", action="store_true", help="list the shipped workloads and cost models, then exit")
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="SPEC",
        help="policy spec, e.g. adaptive, fixed:tau=4, confidence:threshold=0.3, oracle (repeatable)",
    )
    p.add_argument(
        "--cost",
        default=None,
        metavar="NAME|FILE",
        help="cost model: cpu (measured on this machine, or defaults), gpu-70b, or a JSON file "
        "(default: each workload's own, else cpu)",
    )
    p.add_argument(
        "--seeds", type=int, default=None, help="seeds 0..N-1 to average over (default: 3; 5 with --check-goals)"
    )
    p.add_argument("--requests", type=int, default=None, help="requests per workload (default: the workload's)")
    p.add_argument("--json", default=None, metavar="FILE", help="write results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE", help="write a PNG bar chart of speedups (matplotlib)")
    p.add_argument(
        "--check-goals",
        action="store_true",
        help="check the policy goals over 5 seeds on cpu and gpu-70b costs; exit 1 if one fails",
    )
    p.set_defaults(func=run, loads_models=False)  # no models: cli.main leaves transformers unloaded


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from specdec.simulate.costs import COSTS, CostModel, load_costs, measured_costs_path
    from specdec.simulate.workloads import WORKLOADS, Workload, get_workload

    if args.list:
        for w in WORKLOADS.values():
            print(f"{w.name:<18} {w.kind:<10} {w.description}")
        for name in COSTS:
            c = load_costs(name)
            print(
                f"cost {name:<13} verify {1e3 * c.verify_base_s:.2f} ms + {1e3 * c.verify_per_extra_s:.3f} ms/extra "
                f"token, draft {1e3 * c.draft_per_token_s:.2f} ms/token (c = {c.c:.3f}); {c.source}"
            )
        print(f"(measured costs are read from {measured_costs_path()} when present)")
        return 0
    if args.seeds is not None and args.seeds < 1:
        raise InvalidRequestError(f"--seeds must be >= 1, got {args.seeds}", "seeds")
    if args.requests is not None and args.requests < 1:
        raise InvalidRequestError(f"--requests must be >= 1, got {args.requests}", "requests")
    if args.check_goals:
        return _check_goals(args)
    from specdec.simulate.report import DEFAULT_POLICIES, format_table, plot, run_grid, write_json

    names = list(args.workload or []) + [f"replay:{t}" for t in args.trace or []]
    workloads = [get_workload(n) for n in names] if names else list(WORKLOADS.values())
    if args.requests is not None:
        workloads = [replace(w, requests=args.requests) for w in workloads]
    fixed_cost = load_costs(args.cost) if args.cost else None

    def cost_for(w: Workload) -> CostModel:
        return fixed_cost or load_costs(w.cost or "cpu")

    seeds = list(range(args.seeds or 3))
    rows = run_grid(args.policy or DEFAULT_POLICIES, workloads, cost_for, seeds)
    print(format_table(rows))
    print(
        f"(mean over seeds {seeds}; speedup = tokens/s over target-only on the same requests; passes = target "
        "verify passes per request; cut = requests ended by a pass budget)"
    )
    if args.json:
        write_json(rows, args.json, {"seeds": seeds, "costs": {w.name: cost_for(w).to_json() for w in workloads}})
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _check_goals(args: argparse.Namespace) -> int:
    from specdec.simulate.goals import check_goals

    costs = [args.cost] if args.cost else ["cpu", "gpu-70b"]
    seeds = list(range(args.seeds or 5))
    goals = check_goals(costs, seeds, args.requests)
    for g in goals:
        print(g.line())
    failed = sum(not g.passed for g in goals)
    print(f"{len(goals) - failed}/{len(goals)} goals met (seeds {seeds[0]}..{seeds[-1]})")
    return 1 if failed else 0
