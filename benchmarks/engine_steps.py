"""What the engine's own Python costs around the kernel's passes, in process (no HTTP, no event loop).

A closed loop of ``--sequences`` requests stepped together by ``Engine.step`` (the server's batched step), each
finished one replaced by the next (the load test's prompts, 64 new tokens, greedy or ``--temperature``, prompts taken in by the steps as
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
    python benchmarks/engine_steps.py --sequences 16 --policies fixed:tau=3 adaptive --breakdown # the rest by part
    python benchmarks/engine_steps.py --sequences 16 --policies fixed:tau=0 fixed:tau=0+chain4 --interleave  # chained
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_test import PROMPTS, prompt_texts  # noqa: E402

import specdec  # noqa: E402
from specdec.engine import DEFAULT_PREFILL_IN_STEP, Engine, Generation  # noqa: E402
from specdec.errors import InvalidRequestError  # noqa: E402
from specdec.policy import make_policy  # noqa: E402
from specdec.runtime.heap import freeze_heap  # noqa: E402
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


class Breakdown:
    """Seconds in each part of the engine's Python around the kernel's calls (``--breakdown``): the engine's methods
    wrapped where they are defined, each call timed whole (the draft's and the verification's then hold their kernel
    calls, which ``NativeClock`` times apart). A wrapped call costs ~0.3 µs, a few dozen a step: not for the headline
    figures, which run without it.

    Measured this way (session 67, docs/server.md, Compute threads): at 16 sequences the Python between the passes runs
    on caches the passes have just emptied, so what it costs follows the memory it touches more than the bytecode."""

    PARTS = (
        ("plan", "Engine", "_plan"),
        ("draft", "Engine", "_draft"),
        ("verify", "side", "verify"),
        ("contexts", "Generation", "context_for_policy"),
        ("commit", "Generation", "commit_step"),
        ("detokenise", "Generation", "take_step"),
        ("close", "Generation", "close_step"),
        ("starts", "Engine", "start"),
    )

    def __init__(self, engine: Engine) -> None:
        self.seconds: dict[str, float] = {name: 0.0 for name, _, _ in self.PARTS}
        owners = {"Engine": Engine, "Generation": Generation, "side": type(engine.side)}
        for name, owner, method in self.PARTS:
            cls = owners[owner]
            setattr(cls, method, self._timed(name, getattr(cls, method)))

    def _timed(self, part: str, method: Any) -> Any:
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - t0

        return timed


BREAKDOWN: Breakdown | None = None  # set by ``--breakdown``: every loop's steps are then split by part


# ``--temperature``: the loops' requests sampled at this temperature, each with its own seed (0: greedy).
TEMPERATURE = 0.0

TRACED = "+trace"  # a policy named with this suffix runs with a JSONL trace observer (what tracing costs a step)
# A policy named NAME+chainN runs NAME with plain steps chaining up to N target passes (``Engine.chain_plain``).
CHAINED = re.compile(r"\+chain(\d+)$")


def chained_policy(policy: str) -> tuple[str, int]:
    """A policy name without its ``+chainN`` suffix, and N (1 without one)."""
    found = CHAINED.search(policy)
    return (policy[: found.start()], int(found.group(1))) if found else (policy, 1)


class ClosedLoop:
    """One policy's closed loop of ``sequences`` requests (``prompts``: the load test's unless ``--prompts``; 64 new
    tokens, greedy), each finished one replaced by the next until ``requests`` have started; ``step`` runs one
    ``Engine.step`` over them and counts it (its time, kernel time, tokens, depth) once the first ``sequences`` requests
    have joined. The figures are counted in ``chunks`` parts by the requests started (how the policy's standing moves as
    it learns)."""

    def __init__(
        self,
        engine: Engine,
        clock: NativeClock,
        policy: str,
        sequences: int,
        requests: int,
        chunks: int = 4,
        max_batch: int = 0,
        prompts: list[str] = PROMPTS,
    ):
        self.engine, self.clock, self.policy = engine, clock, policy
        self.policy_spec, self.chain = chained_policy(policy)
        self.sequences, self.requests, self.chunks = sequences, requests, chunks
        # At most this many sequences a step (0: all), the steps rotating over them as the server's scheduler does
        # with more requests than --max-batch (``Scheduler._next_batch``).
        self.max_batch, self._turn = max_batch, 0
        self._source = itertools.cycle(prompts)
        self.active = [self._start() for _ in range(sequences)]
        self.started = sequences
        self.steps, self.tokens, self.wall, self.native, self.policy_s = 0, 0, 0.0, 0.0, 0.0
        self.by_runner = {name: 0.0 for name in clock.by_runner}
        self.depths: dict[str, list[float]] = {}  # depth -> [steps, tokens, seconds, kernel seconds]
        self.parts_s = {name: 0.0 for name, _, _ in Breakdown.PARTS} if BREAKDOWN is not None else None
        self.parts = [[0, 0.0] for _ in range(chunks)]  # per chunk of the requests: tokens, seconds
        self._last_end: float | None = None

    @property
    def _step_size(self) -> int:
        return min(self.sequences, self.max_batch) if self.max_batch > 0 else self.sequences

    def _start(self) -> Generation:
        if TEMPERATURE > 0.0:  # seeded by its place in the loop: every policy's loop draws the same requests
            self._seed = getattr(self, "_seed", -1) + 1
            return self.engine.start(
                next(self._source),
                max_new_tokens=64,
                policy=self.policy_spec,
                temperature=TEMPERATURE,
                seed=self._seed,
            )
        return self.engine.start(next(self._source), max_new_tokens=64, policy=self.policy_spec)

    def step(self, aside: bool = False) -> bool:
        """One step of the loop and its admissions; False once every request has finished. ``aside``: the loop's
        requests were set aside since its last step while other loops stepped, and that time is no part of their
        rest (each record's ``other_time``, which the policies learn a step's cost from), as it would not be in a
        server that serves them alone."""
        engine, clock = self.engine, self.clock
        s0 = time.perf_counter()
        if aside and self._last_end is not None:
            for g in self.active:
                g.set_aside(s0 - self._last_end)
        n0, p0, split0 = clock.seconds, engine.policy_seconds, dict(clock.by_runner)
        parts0 = dict(BREAKDOWN.seconds) if BREAKDOWN is not None else None
        batch = self.active
        if 0 < self.max_batch < len(batch):
            start = self._turn % len(batch)
            batch = (batch[start:] + batch[:start])[: self.max_batch]
            self._turn = start + len(batch)
        engine.chain_plain = self.chain
        try:
            events = engine.step(batch)
        finally:
            engine.chain_plain = 1
        if len(batch) < len(self.active):  # rotating: the sequences left out were set aside, as the server does
            left = time.perf_counter() - s0
            in_batch = {id(g) for g in batch}
            for g in self.active:
                if id(g) not in in_batch:
                    g.set_aside(left)
        records = [e.record for e in events if e is not None]
        made = sum(len(r.emitted) for r in records)
        stepped = time.perf_counter()
        still = [g for g in self.active if not g.done]
        while len(still) < self.sequences and self.started < self.requests:
            still.append(self._start())
            self.started += 1
        self.active = still
        end = self._last_end = time.perf_counter()
        dt, native = end - s0, clock.seconds - n0
        self.steps += 1
        self.tokens += made
        self.wall += dt
        self.native += native
        self.policy_s += engine.policy_seconds - p0
        for name, t in clock.by_runner.items():
            self.by_runner[name] += t - split0[name]
        if parts0 is not None and self.parts_s is not None and BREAKDOWN is not None:
            for name, t in BREAKDOWN.seconds.items():
                self.parts_s[name] += t - parts0[name]
        part = self.parts[min(self.chunks - 1, (self.started - 1) * self.chunks // max(self.requests, 1))]
        part[0] += made
        part[1] += dt
        if records:
            depth = f"{max(r.draft_passes for r in records)}{'+p' if records[0].prompt_rows else ''}"
            d = self.depths.setdefault(depth, [0, 0, 0.0, 0.0])
            d[0], d[1], d[2], d[3] = d[0] + 1, d[1] + made, d[2] + stepped - s0, d[3] + native
        return bool(self.active)

    def figures(self) -> dict[str, Any]:
        steps, wall = max(self.steps, 1), max(self.wall, 1e-12)
        return {
            "tokens_per_s": self.tokens / wall,
            "ms_per_step": 1e3 * wall / steps,
            "native_ms_per_step": 1e3 * self.native / steps,
            "rest_ms_per_step": 1e3 * (wall - self.native) / steps,
            "rest_us_per_sequence_step": 1e6 * (wall - self.native) / steps / self._step_size,
            # of the rest, the policies' own work (their plans and their learning: ``Engine.policy_seconds``)
            "policy_ms_per_step": 1e3 * self.policy_s / steps,
            # the kernel's time by runner: the target's passes, the draft model's forwards (and its catch-up)
            **{f"{name}_ms_per_step": 1e3 * t / steps for name, t in self.by_runner.items()},
            "steps": self.steps,
            "by_depth": self.depths,
            # tokens/s by chunk of the requests started (the first chunk holds the loop's filling)
            "chunk_tokens_per_s": [t / s if s > 0 else 0.0 for t, s in self.parts],
            **({"breakdown_us_per_step": self._breakdown(steps)} if self.parts_s is not None else {}),
        }

    def _breakdown(self, steps: int) -> dict[str, float]:
        """µs a step in each part (``Breakdown``): the draft's and the verification's Python without their kernel
        calls, and what is in none of the parts (the loop, the policies' learning, the engine's step between them)."""
        assert self.parts_s is not None
        us = {name: 1e6 * s / steps for name, s in self.parts_s.items()}
        us["draft"] -= 1e6 * self.by_runner.get("draft", 0.0) / steps
        us["verify"] -= 1e6 * self.by_runner.get("target", 0.0) / steps
        us["other"] = 1e6 * (self.wall - self.native) / steps - sum(us.values())
        return us


def run(
    engine: Engine,
    clock: NativeClock,
    policy: str,
    sequences: int,
    requests: int,
    max_batch: int = 0,
    prompts: list[str] = PROMPTS,
) -> dict[str, Any]:
    """``requests`` requests through a closed loop of ``sequences`` (``ClosedLoop``), every step counted. A policy
    named ``NAME+trace`` runs NAME with every step written to a JSONL trace (a temporary file)."""
    if policy.endswith(TRACED):
        with tempfile.TemporaryDirectory() as tmp, JsonlTrace(Path(tmp) / "steps.jsonl") as trace:
            engine.observers.append(trace)
            try:
                return run(engine, clock, policy.removesuffix(TRACED), sequences, requests, max_batch, prompts)
            finally:
                engine.observers.remove(trace)
    loop = ClosedLoop(engine, clock, policy, sequences, requests, max_batch=max_batch, prompts=prompts)
    while loop.step():
        pass
    return loop.figures()


def interleaved(
    engine: Engine,
    clock: NativeClock,
    policies: list[str],
    sequences: int,
    requests: int,
    max_batch: int = 0,
    prompts: list[str] = PROMPTS,
) -> dict[str, dict[str, Any]]:
    """Every policy's closed loop stepped in turn, one step each (``--interleave``): the machine's changes of speed
    (on a shared host, 2x within a minute) fall on every policy alike, step by step, where runs one after another
    each meet their own minute. Each loop's requests are set aside while the others step (``ClosedLoop.step``). No
    policy named NAME+trace (``main`` refuses it with --interleave)."""
    loops = [
        ClosedLoop(engine, clock, policy, sequences, requests, max_batch=max_batch, prompts=prompts)
        for policy in policies
    ]
    running = list(loops)
    while running:
        running = [loop for loop in running if loop.step(aside=True)]
    return {loop.policy: loop.figures() for loop in loops}


def _rate(row: dict[str, Any]) -> float:
    """A row's tokens/s over every round: its tokens ÷ its seconds."""
    made = sum(x["tokens_per_s"] * x["steps"] * x["ms_per_step"] for x in row["rounds"])
    return made / sum(x["steps"] * x["ms_per_step"] for x in row["rounds"])


def standing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of interleaved rounds (``--interleave``): each adaptive-like policy (any not ``fixed:``) against the best of the
    fixed ones at its sequence count, over the rounds' tokens and seconds, round by round, and by chunk of each round
    (a chunk's figures of every policy come from the same minutes)."""
    out = []
    for n in sorted({r["sequences"] for r in rows}):
        level = [r for r in rows if r["sequences"] == n]
        fixed = [r for r in level if r["policy"].startswith("fixed:")]
        if not fixed:
            continue
        best = max(fixed, key=_rate)
        for r in level:
            if r["policy"].startswith("fixed:"):
                continue
            rounds = [
                x["tokens_per_s"] / max(f["rounds"][i]["tokens_per_s"] for f in fixed)
                for i, x in enumerate(r["rounds"])
            ]
            chunks = [
                c / max(max(f["rounds"][i]["chunk_tokens_per_s"][j] for f in fixed), 1e-12)
                for i, x in enumerate(r["rounds"])
                for j, c in enumerate(x["chunk_tokens_per_s"])
            ]
            out.append(
                {
                    "sequences": n,
                    "policy": r["policy"],
                    "best_fixed": best["policy"],
                    "vs_best_fixed": _rate(r) / _rate(best),
                    "rounds": rounds,
                    "chunks": chunks,
                }
            )
    return out


def print_standing(rows: list[dict[str, Any]]) -> None:
    for s in standing(rows):
        print(
            f"\n{s['sequences']} sequences, interleaved: {s['policy']} ÷ the best fixed policy ({s['best_fixed']}) "
            f"{s['vs_best_fixed']:.3f}; round by round "
            + " / ".join(f"{x:.3f}" for x in s["rounds"])
            + "; by chunk of a round "
            + f"{min(s['chunks']):.3f}-{max(s['chunks']):.3f}"
        )


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
    p.add_argument(
        "--prime",
        action="store_true",
        help="start the policies' batch costs as a server without a cost file does (its passes measured now: "
        "tune.starting_costs); without it they learn from the steps alone",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=0,
        help="at most this many sequences a step, the steps rotating over them as a server with more requests than "
        "its --max-batch does (default: every sequence in every step)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="step the policies' loops in turn, one step each, in every round (the machine's changes of speed fall "
        "on all alike) instead of one policy's run after another's",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help='prompts: JSONL, one a line (a JSON string or an object with a "prompt" field, as load_test.py '
        "--prompts takes); default: the load test's own",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also split each step's Python by part (plan, the draft's and the verification's own Python, commit, "
        "detokenising, ...); its timers cost a little, so the other figures are not for comparing with runs without",
    )
    p.add_argument(
        "--prefill-in-step",
        type=int,
        default=DEFAULT_PREFILL_IN_STEP,
        metavar="TOKENS",
        help="prompt tokens a step takes in with its pass (the batching server's --prefill-in-step; default "
        f"{DEFAULT_PREFILL_IN_STEP}); 0: each prompt in a pass of its own as it starts",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the requests sampled at this temperature, each with a seed of its own (default 0: greedy)",
    )
    args = p.parse_args(argv)
    if not 0.0 <= args.temperature <= 2.0:
        p.error(f"--temperature must be between 0 and 2, not {args.temperature}")
    global TEMPERATURE
    TEMPERATURE = args.temperature
    if args.prefill_in_step < 0:
        p.error(f"--prefill-in-step must be 0 or more, not {args.prefill_in_step}")
    prompts = prompt_texts(p, args.prompts)
    if args.interleave and any(q.endswith(TRACED) for q in args.policies):
        p.error("--interleave: a policy named NAME+trace runs only without it")
    for policy in args.policies:
        try:
            spec, chain = chained_policy(policy.removesuffix(TRACED))
            make_policy(spec)
        except InvalidRequestError as e:
            p.error(f"--policies: {e}")
        if chain < 1:
            p.error(f"--policies: {policy}: a chain of at least 1 target pass (+chain1: none)")
    engine = specdec.load()
    engine.prefill_in_step = args.prefill_in_step  # the batching server's: prompts come in with their first step
    if args.prime:
        from specdec.tune import starting_costs

        costs, note = starting_costs(engine)
        engine.prime(costs)
        print(f"primed: {note}", file=sys.stderr)
    clock = NativeClock(target=engine.target, draft=getattr(engine.drafter, "runner", None))
    if args.breakdown:
        global BREAKDOWN
        BREAKDOWN = Breakdown(engine)
    # The loaded heap out of the collector's scans, as `specdec serve` keeps it (``specdec.runtime.heap``): without
    # it a full collection walks torch's and the models' objects (~100 ms) every second or so, inside some step.
    freeze_heap()
    rows: list[dict[str, Any]] = []
    for n in args.sequences:
        requests = args.requests or max(8, 4 * n)
        for policy in args.policies:  # warm-up: the policies' first plans and the caches' first allocations
            run(engine, clock, policy, n, n, args.max_batch, prompts)
        runs: dict[str, list[dict[str, Any]]] = {q: [] for q in args.policies}
        for r in range(args.rounds):
            order = args.policies[r % len(args.policies) :] + args.policies[: r % len(args.policies)]
            if args.interleave:
                for policy, figures in interleaved(engine, clock, order, n, requests, args.max_batch, prompts).items():
                    runs[policy].append(figures)
                continue
            for policy in order:
                runs[policy].append(run(engine, clock, policy, n, requests, args.max_batch, prompts))
        for policy in args.policies:
            med = {
                k: statistics.median(x[k] for x in runs[policy])
                for k in runs[policy][0]
                if k not in ("by_depth", "chunk_tokens_per_s", "breakdown_us_per_step")
            }
            if args.breakdown:
                med["breakdown_us_per_step"] = {
                    part: statistics.median(x["breakdown_us_per_step"][part] for x in runs[policy])
                    for part in runs[policy][0]["breakdown_us_per_step"]
                }
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
    if args.breakdown:
        parts = [*(name for name, _, _ in Breakdown.PARTS), "other"]
        print(
            "\nThe rest by part, µs a step (medians of the rounds; draft and verify: their Python without the kernel)"
        )
        print("| sequences | policy | " + " | ".join(parts) + " |")
        print("|---|---|" + "---|" * len(parts))
        for row in rows:
            us = row["breakdown_us_per_step"]
            print(f"| {row['sequences']} | {row['policy']} | " + " | ".join(f"{us[q]:.1f}" for q in parts) + " |")
    if args.interleave:
        print_standing(rows)
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
        report: dict[str, Any] = {"rows": rows, "interleave": args.interleave, "prime": args.prime}
        if args.interleave:
            report["standing"] = standing(rows)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
