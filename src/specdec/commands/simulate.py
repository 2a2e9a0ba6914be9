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
    p.add_argument(
        "--arrivals",
        default=None,
        metavar="SPEC",
        help="serve the requests under load with continuous batching: poisson:rate=R (open loop, R requests/s) "
        "or clients:N (closed loop: N clients, each sends its next request when its last finishes); throughput "
        "is then tokens over the whole run and latency runs from arrival to finish (queueing included). "
        "Without it requests run one at a time, alone",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="with --arrivals: sequences sharing each step's passes (as specdec serve --max-batch; default: 16)",
    )
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
    from specdec.simulate.workloads import LOAD_WORKLOADS, WORKLOADS, Workload, get_workload

    if args.list:
        for w in [*WORKLOADS.values(), *LOAD_WORKLOADS.values()]:
            print(f"{w.name:<18} {w.kind:<10} {w.description}")
        for name in COSTS:
            c = load_costs(name)
            print(
                f"cost {name:<13} verify {1e3 * c.verify_base_s:.2f} ms + {1e3 * c.verify_per_extra_s:.3f} ms/extra "
                f"token, draft {1e3 * c.draft_per_token_s:.2f} ms/token (c = {c.c:.3f}); {c.source}"
            )
            if c.batch_source:
                print(
                    f"     batched: a pass of 1/16/64 rows {1e3 * c.verify_rows(1):.2f}/{1e3 * c.verify_rows(16):.2f}/"
                    f"{1e3 * c.verify_rows(64):.2f} ms, a draft forward over 1/16 sequences "
                    f"{1e3 * c.draft_forward(1):.2f}/{1e3 * c.draft_forward(16):.2f} ms, "
                    f"{1e3 * c.step_other(1):.2f} ms per sequence per step; {c.batch_source}"
                )
        print(f"(measured costs are read from {measured_costs_path()} when present)")
        return 0
    if args.seeds is not None and args.seeds < 1:
        raise InvalidRequestError(f"--seeds must be >= 1, got {args.seeds}", "seeds")
    if args.requests is not None and args.requests < 1:
        raise InvalidRequestError(f"--requests must be >= 1, got {args.requests}", "requests")
    if args.max_batch < 1:
        raise InvalidRequestError(f"--max-batch must be >= 1, got {args.max_batch}", "max_batch")
    if args.check_goals:
        return _check_goals(args)
    if args.arrivals is not None:
        return _run_load(args)
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


def _run_load(args: argparse.Namespace) -> int:
    """``--arrivals``: every policy serves the workloads' requests under the arrival process, batched."""
    import json
    from dataclasses import replace

    from specdec.simulate.arrivals import parse_arrivals
    from specdec.simulate.costs import load_costs
    from specdec.simulate.report import policy_factory
    from specdec.simulate.runner import simulate_batched
    from specdec.simulate.workloads import LOAD_WORKLOADS, get_workload

    arrivals = parse_arrivals(args.arrivals)
    names = list(args.workload or []) + [f"replay:{t}" for t in args.trace or []]
    workloads = [get_workload(n) for n in names] if names else list(LOAD_WORKLOADS.values())
    if args.requests is not None:
        workloads = [replace(w, requests=args.requests) for w in workloads]
    specs = args.policy or ["fixed:tau=0", "fixed:tau=1", "fixed:tau=2", "fixed:tau=4", "adaptive"]
    factories = {spec: policy_factory(spec) for spec in specs}
    seeds = list(range(args.seeds or 3))
    head = (
        f"{'workload':<14} {'policy':<20} {'tok/s':>8} {'vs plain':>8} {'mean lat':>9} {'p95 lat':>9} "
        f"{'batch':>6} {'rows':>6} {'tau':>5}"
    )
    print(f"arrivals {arrivals.label}, max batch {args.max_batch}")
    print(head)
    print("-" * len(head))
    out = []
    for w in workloads:
        cost = load_costs(args.cost or w.cost or "cpu")
        plain = None
        for spec, factory in factories.items():
            runs = [simulate_batched(factory(), w, cost, s, arrivals, args.max_batch, label=spec) for s in seeds]
            sums = [r.summary() for r in runs]
            mean = {k: sum(x[k] for x in sums) / len(sums) for k in sums[0] if isinstance(sums[0][k], (int, float))}
            if spec == "fixed:tau=0":
                plain = mean["tokens_per_s"]
            ratio = f"{mean['tokens_per_s'] / plain:>7.2f}x" if plain else f"{'-':>8}"
            print(
                f"{w.name[:14]:<14} {spec[:20]:<20} {mean['tokens_per_s']:>8.1f} {ratio} "
                f"{1e3 * mean['mean_latency_s']:>7.0f}ms {1e3 * mean['p95_latency_s']:>7.0f}ms "
                f"{mean['mean_batch']:>6.1f} {mean['rows_per_pass']:>6.1f} {mean['mean_tau']:>5.2f}"
            )
            out.append({"policy": spec, "workload": w.name, "cost": cost.name, **mean, "seeds": seeds})
    print(
        f"(mean over seeds {seeds}; tok/s = output tokens over the whole run; latency = arrival to finish, "
        "queueing included; batch = sequences per pass, rows = target rows per pass, tau = draft tokens per "
        "sequence-step)"
    )
    if args.json:
        meta = {"seeds": seeds, "arrivals": arrivals.label, "max_batch": args.max_batch}
        with open(args.json, "w") as f:
            f.write(json.dumps({"meta": meta, "results": out}, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
