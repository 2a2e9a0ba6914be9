"""What a joining request's prefill costs the requests already running, in process (no HTTP): a closed loop of
``--sequences`` requests stepped together by ``Engine.step``, each finished one replaced by the next, with the
prompt prefilled in a pass of its own at ``Engine.start`` (``prefill_in_step=0``) or taken in by the steps, in
the passes shared with the batch, at most 256 prompt tokens per step (``prefill_in_step=256``, the server's
default when it batches: a longer prompt comes in pieces). Both settings take turns in each round. Prompt sets:
the load test's (8-23 tokens), held-out prompts of at most 256 tokens, and long ones (three held-out prompts
joined, 500-900 tokens).

Reports, per prompt set and setting: output tokens/s, and the gap between consecutive steps of the running
requests (what each of them waits between two pieces of output) in steps where nobody joined and in steps
where one or more requests joined (their admission included), p50/p95/p99.

    python benchmarks/join_latency.py                      # load-test prompts and held-out prompts <= 256 tokens
    python benchmarks/join_latency.py --rounds 3 --json join.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_test import PROMPTS  # noqa: E402

import specdec  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.tune import load_prompts  # noqa: E402


def quantile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


def run(engine: Engine, prompts: list[str], in_step: int, sequences: int, requests: int, tau: int) -> dict[str, Any]:
    engine.prefill_in_step = in_step
    source = itertools.cycle(prompts)
    active, started, tokens = [], 0, 0
    quiet: list[float] = []  # step gaps of a full batch where nobody joined
    joins: list[float] = []  # ... where someone did (admissions included)
    t_start = time.perf_counter()
    while active or started < requests:
        t0, joined = time.perf_counter(), 0
        while len(active) < sequences and started < requests:
            active.append(engine.start(next(source), max_new_tokens=64, tau=tau))
            started += 1
            joined += 1
        engine.step(active)
        if len(active) == sequences:
            (joins if joined else quiet).append(time.perf_counter() - t0)
        tokens += sum(len(g.result().token_ids) for g in active if g.done)
        active = [g for g in active if not g.done]
    every = quiet + joins
    return {
        "prefill_in_step": in_step,
        "tokens_per_s": tokens / (time.perf_counter() - t_start),
        "gap_ms_no_join_p50": 1e3 * quantile(quiet, 0.5),
        "gap_ms_join_p50": 1e3 * quantile(joins, 0.5),
        "gap_ms_join_p95": 1e3 * quantile(joins, 0.95),
        "gap_ms_all_p95": 1e3 * quantile(every, 0.95),
        "gap_ms_all_p99": 1e3 * quantile(every, 0.99),
        "steps_with_joins": len(joins),
        "steps": len(every),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--requests", type=int, default=96, help="requests per setting, prompt set and round")
    p.add_argument("--tau", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    engine = specdec.load()
    every = load_prompts(None, 40)
    held_out = [q for q in every if len(engine.encode(q)) <= 256][:12]
    long = ["\n".join(every[i : i + 3]) for i in range(0, len(every) - 2, 3)]
    long = [q for q in long if len(engine.encode(q)) + 64 <= engine.max_context][:12]
    report: dict[str, Any] = {"sequences": args.sequences, "tau": args.tau, "sets": {}}
    sets = (("load-test prompts", PROMPTS), ("held-out prompts <= 256 tokens", held_out), ("long prompts", long))
    for name, prompts in sets:
        lengths = [len(engine.encode(q)) for q in prompts]
        print(f"{name}: {min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f})")
        runs = report["sets"][name] = []
        for _ in range(args.rounds):
            for in_step in (0, 256):
                r = run(engine, prompts, in_step, args.sequences, args.requests, args.tau)
                runs.append(r)
                print(
                    f"  prefill_in_step={in_step:3d}: {r['tokens_per_s']:6.0f} tok/s | gap ms: no join p50 "
                    f"{r['gap_ms_no_join_p50']:.2f} | joins p50 {r['gap_ms_join_p50']:.2f} p95 {r['gap_ms_join_p95']:.2f}"
                    f" | all p95 {r['gap_ms_all_p95']:.2f} p99 {r['gap_ms_all_p99']:.2f} "
                    f"| {r['steps_with_joins']}/{r['steps']} steps with joins",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
