"""What the prefix cache buys a server, side by side: ``specdec serve --prefix-cache off`` and ``--prefix-cache auto``
on loopback, the same requests through the same clients, the two servers taking turns in rounds.

Four workloads, every prompt sent once per server (none is ever repeated whole, so no request's whole prefill is
saved by having been sent before):

- ``preamble``: a shared preamble (a system prompt, few-shot examples, a document; default: the first shipped
  held-out prompts joined, ~500 tokens; ``--preamble-file``) ahead of a short tail of its own per request;
- ``turns``: conversations of ``--turns`` turns, each turn's prompt the one before it, its output and a new tail
  (what a chat client resends every turn);
- ``unique``: the tails alone, no two alike from their first tokens (nothing to find: what keeping and looking up
  prefixes costs a server whose prompts share nothing);
- ``burst``: waves of as many requests as clients, sent together, each wave's preamble new to the server (a batch
  job's prompts with their few-shot preamble: what requests arriving together share before any of them finished).

Reports, per workload, server and clients: output tokens/s, p50/p95 latency, p50 time to first token, and the share of
prompt tokens the server found cached (``usage.prompt_tokens_details.cached_tokens``); greedy outputs of the two
servers must be identical (the exit code is 1 where one is not).

    python benchmarks/prefix_cache.py --concurrency 1 8 --rounds 2 --json prefix.json
    python benchmarks/prefix_cache.py --workloads unique --rounds 3   # what the cache costs where nothing is found
    python benchmarks/prefix_cache.py --workloads burst --concurrency 8 16   # requests arriving together
    python benchmarks/prefix_cache.py --serve-args "--target DIR --draft DIR" --preamble-file system.txt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_test  # type: ignore[import-not-found]  # noqa: E402

HELDOUT = Path(__file__).resolve().parents[1] / "src" / "specdec" / "data" / "heldout_prompts.jsonl"
SERVERS = ("off", "auto")


def default_preamble() -> str:
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    return "\n\n".join(r["prompt"] for r in rows[:3])


def tail(k: int) -> str:
    """A short request of its own (never the same twice in a run)."""
    return f'\n\n\ndef task_{k}(items, limit={k % 97}):\n    """Return the first {k} items."""\n'


async def complete(conn: Any, args: argparse.Namespace, prompt: str) -> Any:
    body = {
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.policy:
        body["speculative"] = {"policy": args.policy}
    return await load_test.one_request(conn, body)


async def run(url: str, args: argparse.Namespace, workload: str, clients: int, base: int) -> dict[str, Any]:
    """``args.requests`` requests (``turns``: that many turns, in conversations of ``args.turns``) through ``clients``
    keep-alive connections; request k's tail is ``tail(base + k)``."""
    conns = [load_test.StreamConnection(url, {}, args.timeout) for _ in range(clients)]
    samples: list[Any] = []
    texts: dict[int, str] = {}
    preamble = args.preamble_text
    if workload == "burst":
        waves = [list(range(w, min(w + clients, args.requests))) for w in range(0, args.requests, clients)]
    elif workload != "turns":
        jobs = iter([[k] for k in range(args.requests)])
    else:
        convs = max(1, args.requests // args.turns)
        jobs = iter([[c * args.turns + t for t in range(args.turns)] for c in range(convs)])

    async def one(conn: Any, prompt: str, k: int) -> str:
        sample = await complete(conn, args, prompt)
        samples.append(sample)
        texts[k] = sample.text
        return str(sample.text)

    async def worker(conn: Any) -> None:
        for job in jobs:
            start = preamble if workload == "preamble" else ""
            prompt = start
            for k in job:
                prompt = (prompt if workload == "turns" else start) + tail(base + k)
                text = await one(conn, prompt, k)
                if workload == "turns":
                    prompt += text

    async def bursts() -> None:
        for wave in waves:  # a preamble of its own (its first line), sent by every client at once
            head = f"# batch {base + wave[0]}\n{preamble}"
            await asyncio.gather(*(one(conn, head + tail(base + k), k) for conn, k in zip(conns, wave)))

    for conn in conns:
        await conn.connect()
    t0 = time.perf_counter()
    try:
        if workload == "burst":
            await bursts()
        else:
            await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for conn in conns:
            await conn.close()
    wall = time.perf_counter() - t0
    lat = sorted(s.latency for s in samples)
    prompt_tokens = sum(s.prompt_tokens for s in samples)
    return {
        "requests": len(samples),
        "wall_s": wall,
        "tokens_per_s": sum(s.tokens for s in samples) / wall,
        "p50_latency_s": load_test._pct(lat, 50),
        "p95_latency_s": load_test._pct(lat, 95),
        "p50_ttft_s": load_test._pct(sorted(s.ttft for s in samples if s.ttft == s.ttft), 50),
        "mean_prompt_tokens": prompt_tokens / len(samples),
        "cached_share": sum(s.cached_tokens for s in samples) / prompt_tokens if prompt_tokens else 0.0,
        "texts": texts,
    }


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one (workload, server, clients): tokens/s over the summed wall time, the medians of the rest."""
    out = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0] if k not in ("texts", "requests", "wall_s")}
    out["tokens_per_s"] = sum(r["tokens_per_s"] * r["wall_s"] for r in runs) / sum(r["wall_s"] for r in runs)
    out["requests"] = sum(r["requests"] for r in runs)
    out["rounds_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in runs]
    return out


async def main_async(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, Any]:
    for name in SERVERS:  # warm-up (one-off costs), with tails no measured request uses
        conn = load_test.StreamConnection(urls[name], {}, args.timeout)
        await complete(conn, args, "def warm_up():\n")
        await conn.close()
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    differing = checked = 0
    base = 10_000
    for workload in args.workloads:
        for clients in args.concurrency:
            for r in range(args.rounds):
                order = SERVERS if r % 2 == 0 else SERVERS[::-1]
                got = {}
                for name in order:
                    got[name] = await run(urls[name], args, workload, clients, base)
                    results.setdefault((workload, name, clients), []).append(got[name])
                    print(
                        f"  {workload:8s} {name:4s} x{clients:<3d} round {r + 1}: "
                        f"{got[name]['tokens_per_s']:7.1f} tok/s, TTFT p50 {got[name]['p50_ttft_s']:.3f} s, "
                        f"cached {100 * got[name]['cached_share']:.0f}%",
                        flush=True,
                    )
                for k, text in got["off"]["texts"].items():
                    checked += 1
                    differing += text != got["auto"]["texts"].get(k)
                base += args.requests
    rows = [
        {"workload": w, "server": f"--prefix-cache {n}", "concurrency": c, **merge(runs)}
        for (w, n, c), runs in results.items()
    ]
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "preamble_text"},
        "preamble_chars": len(args.preamble_text),
        "rows": rows,
        "identity": {"requests": checked, "differing": differing},
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        "| workload | server | clients | requests | mean prompt tokens | cached | output tok/s | p50 latency s |"
        " p95 latency s | p50 TTFT s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['workload']} | {r['server']} | {r['concurrency']} | {r['requests']} | {r['mean_prompt_tokens']:.0f} "
            f"| {100 * r['cached_share']:.0f}% | {r['tokens_per_s']:.1f} | {r['p50_latency_s']:.3f} | "
            f"{r['p95_latency_s']:.3f} | {r['p50_ttft_s']:.3f} |"
        )
    same = report["identity"]
    lines.append(
        f"\nGreedy outputs differing between the two servers: {same['differing']} of {same['requests']} requests."
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-args", default="", help="extra 'specdec serve' arguments for both servers (models, ...)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=24, help="requests per workload, level, server and round")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (workload turns)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the servers' order swapped each round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--policy", default="adaptive", help="the requests' speculative policy ('' for the server's)")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=["preamble", "turns", "unique", "burst"],
        default=["preamble", "turns", "unique", "burst"],
    )
    p.add_argument("--preamble-file", type=Path, default=None, help="the shared preamble (default: held-out code)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.preamble_file is not None:
        try:
            args.preamble_text = args.preamble_file.read_text()
        except OSError as e:
            p.error(f"--preamble-file: {e}")
    else:
        args.preamble_text = default_preamble()
    if args.requests < 1 or args.turns < 1 or args.rounds < 1 or min(args.concurrency) < 1:
        p.error("--requests, --turns, --rounds and --concurrency must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    head = [sys.executable, "-m", "specdec.cli", "serve", "--log-level", "warning", *shlex.split(args.serve_args)]
    commands = [(name, lambda port, n=name: [*head, "--port", str(port), "--prefix-cache", n]) for name in SERVERS]
    with load_test.running_servers(commands) as urls:
        report = asyncio.run(main_async(args, urls))
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")
    return 1 if report["identity"]["differing"] else 0


if __name__ == "__main__":
    sys.exit(main())
