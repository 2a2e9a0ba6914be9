"""Record what the engine tells a policy and what it answers, then replay it into a fresh policy: the same answers, and
the policy's own work timed alone.

A policy is deterministic in what it is told (step contexts, step records, request ends, measured costs), so a
recording of every call the engine makes into it (``prime``, ``begin``, ``allowance``, ``plan``, ``next_tau``,
``observe_step``, ``observe``, ``end``) with each answer (the decisions' τ, reason and stop rule) can be replayed into
a new instance of the policy: every answer must come back the same. That makes a change meant only to make the policy
cheaper checkable exactly (record with the code before, replay with the code after), and the replay times the
policy's work by call on warm caches, with no kernel and no engine around it (in a step the same work runs on caches
the passes have just emptied, several times slower: ``engine_steps.py`` measures it there).

    python benchmarks/policy_replay.py record calls.pkl                     # 16 sequences, then 32 at a batch of 16
    python benchmarks/policy_replay.py replay calls.pkl --repeat 3          # 0 mismatches, and where the time went

The recording is a pickle of this checkout's objects (records, contexts): replay it with the same code base, not
across versions that change those classes.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specdec.policy import make_policy  # noqa: E402
from specdec.policy.base import Policy  # noqa: E402

METHODS = ("prime", "begin", "allowance", "plan", "next_tau", "observe_step", "observe", "end")


def answer(x: Any) -> Any:
    """What is compared of an answer: each decision's τ, reason and stop rule (as its repr); other values as they are."""
    if isinstance(x, list):
        return [answer(d) for d in x]
    if hasattr(x, "tau") and hasattr(x, "reason"):
        return (x.tau, x.reason, repr(getattr(x, "rule", None)))
    return x


def record(path: Path, policy: str, runs: list[tuple[int, int, int]]) -> int:
    """Runs closed loops of the engine (``engine_steps.py``'s: (sequences, requests, max batch) each) with ``policy``,
    recording every call the engine makes into the policy's class; returns the calls recorded."""
    import engine_steps

    import specdec
    from specdec.tune import starting_costs

    log: list[tuple[str, bytes, Any]] = []
    inside = [0]  # calls the policy makes into itself (plan -> next_tau) are not the engine's
    cls = type(make_policy(policy))
    originals = {name: getattr(cls, name) for name in METHODS}

    def wrap(name: str) -> Any:
        method = originals[name]

        def recorded(self: Policy, *args: Any, **kwargs: Any) -> Any:
            top = inside[0] == 0
            blob = pickle.dumps((args, kwargs)) if top else b""
            inside[0] += 1
            try:
                out = method(self, *args, **kwargs)
            finally:
                inside[0] -= 1
            if top:
                log.append((name, blob, answer(out)))
            return out

        return recorded

    for name in METHODS:
        setattr(cls, name, wrap(name))
    try:
        engine = specdec.load()
        engine.prefill_in_step = 256  # the batching server's
        costs, _ = starting_costs(engine)
        engine.prime(costs)
        clock = engine_steps.NativeClock(target=engine.target, draft=getattr(engine.drafter, "runner", None))
        for sequences, requests, max_batch in runs:
            engine_steps.run(engine, clock, policy, sequences, requests, max_batch)
    finally:
        for name, method in originals.items():
            setattr(cls, name, method)
    with open(path, "wb") as f:
        pickle.dump({"policy": policy, "calls": log}, f)
    return len(log)


def replay(path: Path, repeat: int = 1) -> tuple[int, int, dict[str, float]]:
    """Replays a recording into a fresh policy ``repeat`` times; returns the calls, the answers that differed (in the
    first replay) and the seconds by method (the fastest replay's)."""
    with open(path, "rb") as f:
        saved = pickle.load(f)
    calls = [(name, pickle.loads(blob), want) for name, blob, want in saved["calls"]]
    mismatches, best = 0, None
    for r in range(repeat):
        policy = make_policy(saved["policy"])
        seconds: collections.Counter[str] = collections.Counter()
        for i, (name, (args, kwargs), want) in enumerate(calls):
            t0 = time.perf_counter()
            out = getattr(policy, name)(*args, **kwargs)
            seconds[name] += time.perf_counter() - t0
            if r == 0 and answer(out) != want:
                mismatches += 1
                if mismatches <= 3:
                    print(f"call {i} ({name}) answered\n  {answer(out)!r}\nwhere the recording has\n  {want!r}")
        if best is None or sum(seconds.values()) < sum(best.values()):
            best = dict(seconds)
    return len(calls), mismatches, best or {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the engine and record every call into the policy")
    rec.add_argument("file", type=Path)
    rec.add_argument("--policy", default="adaptive")
    rec.add_argument(
        "--runs",
        nargs="+",
        default=["16:256", "32:256:16", "4:128"],
        help="closed loops SEQUENCES:REQUESTS[:MAX_BATCH] (default: 16:256 32:256:16 4:128)",
    )
    rep = sub.add_parser("replay", help="replay a recording into a fresh policy: every answer the same, and its time")
    rep.add_argument("file", type=Path)
    rep.add_argument("--repeat", type=int, default=1)
    args = p.parse_args(argv)
    if args.command == "record":
        runs = []
        for spec in args.runs:
            parts = spec.split(":")
            if len(parts) not in (2, 3) or not all(x.isdigit() and int(x) > 0 for x in parts):
                p.error(f"--runs: {spec!r} is not SEQUENCES:REQUESTS[:MAX_BATCH] (positive integers)")
            runs.append((int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else 0))
        n = record(args.file, args.policy, runs)
        print(f"recorded {n} calls into {args.policy} ({args.file})")
        return 0
    if not args.file.is_file():
        p.error(f"no recording at {args.file}")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    n, mismatches, seconds = replay(args.file, args.repeat)
    spent = ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]))
    print(f"replayed {n} calls: {mismatches} answers differed; the policy's work {1e3 * sum(seconds.values()):.1f} ms")
    print(f"by call: {spent}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
