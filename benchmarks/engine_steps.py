"""What the engine's own Python costs around the kernel's passes, in process (no HTTP, no event loop).

A closed loop of ``--sequences`` requests stepped together by ``Engine.step`` (the server's batched step), each
finished one replaced by the next (the load test's prompts, 64 new tokens, greedy, prompts taken in by the steps as
the batching server does), for each policy of ``--policies`` in turn, the order rotated each round. The CPU kernel's
calls (target passes, lockstep drafts) are timed where they enter the native library; everything else in a step is
the engine's Python: planning, drafting's and verification's bookkeeping, commit, stop checks, detokenising, records,
the policy's learning. A pass streams the weights through every cache, so that Python runs on cold caches, several
times slower than a micro-benchmark of it shows; this measures it where it runs.

Reports per sequences and policy: output tokens/s, ms per step, of which in the kernel's calls (the target's passes
+ the draft model's forwards) and in the rest (median of the rounds), and the rest per sequence-step. ``--by-depth``
adds the steps of every round by their depth (the deepest draft of the step; "+p": prompt rows in the pass): a
policy's steps beside a fixed τ's at the same depth tell what it loses by its choices (tokens a step, kernel time)
from what it loses by its own work (the rest).

    python benchmarks/engine_steps.py                                   # 1 and 16 sequences, plain, tau=2, adaptive
    python benchmarks/engine_steps.py --sequences 16 --policies fixed:tau=2 adaptive --rounds 5 --json steps.json
    python benchmarks/engine_steps.py --sequences 4 --policies fixed:tau=2 fixed:tau=3 adaptive --by-depth
    python benchmarks/engine_steps.py --sequences 16 --policies fixed:tau=3 fixed:tau=3+trace   # what a trace costs
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_test import PROMPTS  # noqa: E402

import specdec  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.errors import InvalidRequestError  # noqa: E402
from specdec.policy import make_policy  # noqa: E402
from specdec.trace import JsonlTrace  # noqa: E402


class NativeClock:
    """Seconds spent inside the kernel's native calls of the runners given by name (their ``_fused`` library handles
    are wrapped: each call timed where Python hands over to the library): in all (``seconds``) and by runner
    (``by_runner``: the target's passes apart from the draft model's forwards and catch-up)."""

    CALLS = ("sd_forward_rows", "sd_draft_greedy")

    def __init__(self, **runners: Any) -> None:
        self.seconds = 0.0
        self.by_runner: dict[str, float] = {}
        for name, runner in runners.items():
            fused = getattr(runner, "_fused", None)
            if fused is not None:
                self.by_runner[name] = 0.0
                fused._lib = self._wrapped(fused._lib, name)

    def _wrapped(self, lib: Any, runner: str) -> Any:
        clock = self

        class Timed:
            def __getattr__(self, name: str) -> Any:
                return getattr(lib, name)

        timed = Timed()
        for name in self.CALLS:
            native = getattr(lib, name)

            def call(*args: Any, _native: Any = native) -> Any:
                t0 = time.perf_counter()
                try:
                    return _native(*args)
                finally:
                    dt = time.perf_counter() - t0
                    clock.seconds += dt
                    clock.by_runner[runner] += dt

            setattr(timed, name, call)
        return timed


TRACED = "+trace"  # a policy named with this suffix runs with a JSONL trace observer (what tracing costs a step)


def run(engine: Engine, clock: NativeClock, policy: str, sequences: int, requests: int) -> dict[str, Any]:
    """``requests`` requests through a closed loop of ``sequences``; the figures of the steps after the first
    ``sequences`` requests have joined (a full batch from then on, until the source runs dry). A policy named
    ``NAME+trace`` runs NAME with every step written to a JSONL trace (a temporary file)."""
    if policy.endswith(TRACED):
        with tempfile.TemporaryDirectory() as tmp, JsonlTrace(Path(tmp) / "steps.jsonl") as trace:
            engine.observers.append(trace)
            try:
                return run(engine, clock, policy.removesuffix(TRACED), sequences, requests)
            finally:
                engine.observers.remove(trace)
    source = itertools.cycle(PROMPTS)
    start = lambda: engine.start(next(source), max_new_tokens=64, policy=policy)  # noqa: E731
    active = [start() for _ in range(sequences)]
    started, steps, tokens = sequences, 0, 0
    depths: dict[str, list[float]] = {}  # depth -> [steps, tokens, seconds, kernel seconds]
    native0, t0 = clock.seconds, time.perf_counter()
    split0 = dict(clock.by_runner)
    policy0 = engine.policy_seconds
    while active:
        n0, s0 = clock.seconds, time.perf_counter()
        events = engine.step(active)
        records = [e.record for e in events if e is not None]
        made = sum(len(r.emitted) for r in records)
        steps += 1
        tokens += made
        if records:
            depth = f"{max(r.draft_passes for r in records)}{'+p' if records[0].prompt_rows else ''}"
            d = depths.setdefault(depth, [0, 0, 0.0, 0.0])
            d[0], d[1], d[2], d[3] = d[0] + 1, d[1] + made, d[2] + time.perf_counter() - s0, d[3] + clock.seconds - n0
        still = [g for g in active if not g.done]
        while len(still) < sequences and started < requests:
            still.append(start())
            started += 1
        active = still
    wall, native = time.perf_counter() - t0, clock.seconds - native0
    return {
        "tokens_per_s": tokens / wall,
        "ms_per_step": 1e3 * wall / steps,
        "native_ms_per_step": 1e3 * native / steps,
        "rest_ms_per_step": 1e3 * (wall - native) / steps,
        "rest_us_per_sequence_step": 1e6 * (wall - native) / steps / sequences,
        # of the rest, the policies' own work (their plans and their learning: ``Engine.policy_seconds``)
        "policy_ms_per_step": 1e3 * (engine.policy_seconds - policy0) / steps,
        # the kernel's time by runner: the target's passes, the draft model's forwards (and its catch-up)
        **{f"{name}_ms_per_step": 1e3 * (t - split0[name]) / steps for name, t in clock.by_runner.items()},
        "steps": steps,
        "by_depth": depths,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, nargs="+", default=[1, 16])
    p.add_argument(
        "--policies",
        nargs="+",
        default=["fixed:tau=0", "fixed:tau=2", "adaptive"],
        help="policies to compare (a policy named NAME+trace: NAME with every step written to a JSONL trace)",
    )
    p.add_argument("--requests", type=int, default=0, help="requests per run (default: 4 x sequences, at least 8)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--by-depth", action="store_true", help="also the steps of every round by their depth")
    args = p.parse_args(argv)
    for policy in args.policies:
        try:
            make_policy(policy.removesuffix(TRACED))
        except InvalidRequestError as e:
            p.error(f"--policies: {e}")
    engine = specdec.load()
    engine.prefill_in_step = 256  # the batching server's: prompts come in with their first step
    clock = NativeClock(target=engine.target, draft=getattr(engine.drafter, "runner", None))
    rows: list[dict[str, Any]] = []
    for n in args.sequences:
        requests = args.requests or max(8, 4 * n)
        for policy in args.policies:  # warm-up: the policies' first plans and the caches' first allocations
            run(engine, clock, policy, n, n)
        runs: dict[str, list[dict[str, Any]]] = {q: [] for q in args.policies}
        for r in range(args.rounds):
            order = args.policies[r % len(args.policies) :] + args.policies[: r % len(args.policies)]
            for policy in order:
                runs[policy].append(run(engine, clock, policy, n, requests))
        for policy in args.policies:
            med = {k: statistics.median(x[k] for x in runs[policy]) for k in runs[policy][0] if k != "by_depth"}
            depths: dict[str, list[float]] = {}
            for x in runs[policy]:
                for depth, sums in x["by_depth"].items():
                    depths[depth] = [a + b for a, b in zip(depths.get(depth, [0, 0, 0.0, 0.0]), sums)]
            rows.append({"sequences": n, "policy": policy, **med, "by_depth": depths, "rounds": runs[policy]})
    print(
        "| sequences | policy | tok/s | ms/step | kernel ms/step (target + draft) | rest ms/step "
        "| of which the policy's ms/step | rest µs per sequence-step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        split = f" ({row.get('target_ms_per_step', 0.0):.3f} + {row.get('draft_ms_per_step', 0.0):.3f})"
        print(
            f"| {row['sequences']} | {row['policy']} | {row['tokens_per_s']:.0f} | {row['ms_per_step']:.3f} | "
            f"{row['native_ms_per_step']:.3f}{split} | {row['rest_ms_per_step']:.3f} | "
            f"{row['policy_ms_per_step']:.3f} | {row['rest_us_per_sequence_step']:.1f} |"
        )
    if args.by_depth:
        print("\n| sequences | policy | depth | steps | tokens a step | ms a step | kernel ms | rest ms | tokens/ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            order = sorted(row["by_depth"], key=lambda d: (d.endswith("+p"), int(d.removesuffix("+p"))))
            for depth in order:
                count, made, seconds, native = row["by_depth"][depth]
                print(
                    f"| {row['sequences']} | {row['policy']} | {depth} | {count} | {made / count:.2f} | "
                    f"{1e3 * seconds / count:.3f} | {1e3 * native / count:.3f} | {1e3 * (seconds - native) / count:.3f} | "
                    f"{made / seconds * 1e-3:.2f} |"
                )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
