"""What another process's CPU costs the batched step, in process (no HTTP): the exchange rate behind a server's loss.

A server's batched steps run below the same steps in process because its event loop and its clients take CPU on the
cores the kernel's passes use. This measures that exchange rate directly: a closed loop of ``--sequences`` requests
stepped together by ``Engine.step`` (as ``engine_steps.py``: the load test's prompts, 64 new tokens, greedy, each
finished request replaced by the next), beside a child process that burns ``--burst-us`` microseconds of CPU at a
chosen point of every step: ``draft`` (the step's drafts made, as its target pass begins: where a server's event loop
writes the step before's tokens) or ``pass`` (the step's target pass returned, as the step's Python begins). The
settings alternate round by round, the order rotated (the machine's speed moves by the minute).

Reports per setting: output tokens/s, the tokens lost against no burst (median of the rounds' ratios), the share of
the machine's CPU the bursts took, and **the exchange rate**: tokens lost ÷ CPU share taken (1: a burst costs the step
its own time spread over the cores; 2: twice that, the other thread waiting on the one whose core was taken).

    python benchmarks/contention.py                                     # 16 sequences, tau=3, 0 / 500 / 1000 µs
    python benchmarks/contention.py --burst-us 0 250 1000 --at draft pass --rounds 6 --json contention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
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
from specdec.runtime.heap import freeze_heap  # noqa: E402

POINTS = ("draft", "pass")


def burner(conn: Any, seconds: float) -> None:
    """The child: for each message, spin ``seconds`` of CPU (a busy loop, no sleep); exits when the pipe closes."""
    while True:
        try:
            conn.recv_bytes()
        except EOFError:
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


class Bursts:
    """Asks the child for a burst at the step's chosen point: ``draft`` through ``Engine.step``'s join hook, ``pass``
    through the target's kernel library (its pass call wrapped where Python hands over to it)."""

    def __init__(self, engine: Engine) -> None:
        self.conn: Any = None  # the child's pipe and the point in the step (set per setting by ``main``)
        self.at, self.sent = "", 0
        fused = getattr(engine.target, "_fused", None)
        if fused is None:
            raise SystemExit(
                "contention.py needs the CPU kernel (the native runtime): bursts at a pass are timed there"
            )
        lib, bursts = fused._lib, self

        class Wrapped:
            def __getattr__(self, name: str) -> Any:
                return getattr(lib, name)

            def sd_forward_rows(self, *args: Any) -> Any:
                out = lib.sd_forward_rows(*args)
                if bursts.at == "pass":
                    bursts.fire()
                return out

        fused._lib = Wrapped()

    def fire(self) -> None:
        self.conn.send_bytes(b"x")
        self.sent += 1

    def joined(self) -> list[Any]:  # ``Engine.step``'s join: nothing joins, a burst is asked for
        if self.at == "draft":
            self.fire()
        return []


def closed_loop(engine: Engine, bursts: Bursts, sequences: int, requests: int, policy: str) -> tuple[int, float]:
    """``requests`` requests through ``sequences`` slots; returns the tokens made and the seconds taken."""
    source = itertools.cycle(PROMPTS)
    active = [engine.start(next(source), max_new_tokens=64, policy=policy) for _ in range(min(sequences, requests))]
    started, tokens = len(active), 0
    t0 = time.perf_counter()
    while active:
        events = engine.step(active, bursts.joined)
        tokens += sum(len(e.record.emitted) for e in events if e is not None)
        active = [g for g in active if not g.done]
        while len(active) < sequences and started < requests:
            active.append(engine.start(next(source), max_new_tokens=64, policy=policy))
            started += 1
    return tokens, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--policy", default="fixed:tau=3")
    p.add_argument("--requests", type=int, default=96, help="requests per run (default: 96)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--burst-us", type=int, nargs="+", default=[0, 500, 1000], help="CPU a burst takes (0: none)")
    p.add_argument("--at", nargs="+", choices=POINTS, default=["draft"], help="where in the step a burst begins")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.sequences < 1 or args.requests < 1 or args.rounds < 1 or any(b < 0 for b in args.burst_us):
        p.error("--sequences, --requests and --rounds must be >= 1 and --burst-us >= 0")
    # No burst first (the reference every ratio is taken against, asked for or not), then each burst at each point.
    settings = [(0, "-")] + [(b, at) for b in sorted(set(args.burst_us)) if b > 0 for at in args.at]

    engine = specdec.load()
    engine.prefill_in_step = 256  # the batching server's: prompts come in with their steps
    freeze_heap()
    cores = os.cpu_count() or 1
    ctx = mp.get_context("spawn")
    children: dict[int, tuple[Any, Any]] = {}  # burst µs -> (its child, the pipe's sending end)
    runs: dict[tuple[int, str], list[dict[str, float]]] = {s: [] for s in settings}
    try:
        for burst in sorted({b for b, _ in settings if b > 0}):
            receiving, sending = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=burner, args=(receiving, burst * 1e-6), daemon=True)
            proc.start()
            receiving.close()
            children[burst] = (proc, sending)
        bursts = Bursts(engine)

        def use(burst: int, at: str) -> None:
            bursts.conn, bursts.at = (children[burst][1], at) if burst else (None, "")

        for burst, at in settings:  # warm-up: first steps and allocations
            use(burst, at)
            closed_loop(engine, bursts, args.sequences, args.sequences, args.policy)
        for r in range(args.rounds):
            for burst, at in settings[r % len(settings) :] + settings[: r % len(settings)]:
                use(burst, at)
                sent = bursts.sent
                tokens, seconds = closed_loop(engine, bursts, args.sequences, args.requests, args.policy)
                runs[(burst, at)].append(
                    {"tokens_per_s": tokens / seconds, "seconds": seconds, "bursts": bursts.sent - sent}
                )
    finally:
        for proc, sending in children.values():
            sending.close()  # the child's read ends: it exits
            proc.join(timeout=5)

    rows = []
    base = runs[(0, "-")]
    for burst, at in settings:
        rs = runs[(burst, at)]
        ratio = statistics.median(x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(rs, base))
        share = statistics.median(x["bursts"] * burst * 1e-6 / x["seconds"] / cores for x in rs)
        rows.append(
            {
                "burst_us": burst,
                "at": at,
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                "vs_none": ratio,
                "cpu_share": share,
                "exchange_rate": (1.0 - ratio) / share if share > 0 else None,
                "rounds": rs,
            }
        )
    print(f"{args.sequences} sequences, {args.policy}, {cores} cores, {args.rounds} rounds of {args.requests} requests")
    print("\n| burst µs | at | tok/s | ÷ none | machine's CPU taken | exchange rate (tokens lost ÷ CPU taken) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        rate = "–" if row["exchange_rate"] is None else f"{row['exchange_rate']:.2f}"
        print(
            f"| {row['burst_us']} | {row['at']} | {row['tokens_per_s']:.0f} | {row['vs_none']:.3f} | "
            f"{100 * row['cpu_share']:.1f}% | {rate} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
