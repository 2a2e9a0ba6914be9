"""Load benchmark for a running ``specdec serve``: throughput and latency at several concurrency levels,
with speculation and with plain target decoding, side by side on the same server.

Plain decoding is the same server asked for ``"speculative": {"tau": 0}``, so both modes share the
models, the scheduler and the HTTP path; they alternate in rounds so machine noise hits both alike.
Every request streams (``stream_options.include_usage``) so time to first token is measured too.

    specdec serve --port 8000 &
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --concurrency 1 4 16 --requests 32

Reports, per mode and concurrency: output tokens/s (all clients together), requests/s, p50/p95 request
latency, p50 time to first token, and the speculative/plain throughput ratio. Greedy outputs of the two
modes are compared (speculation is lossless, so they must match).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPTS = [
    "def quicksort(items):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "    for i, line in enumerate(lines):\n",
    "def read_json(path):\n    with open(path",
    "class Node:\n    def __init__(self, value, next=None):\n",
    "if __name__ == '__main__':\n",
]


@dataclass
class Sample:
    latency: float
    ttft: float
    tokens: int
    text: str


@dataclass
class Result:
    mode: str
    concurrency: int
    requests: int = 0
    wall: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    texts: dict[int, set[str]] = field(default_factory=dict)  # prompt index -> outputs seen

    def summary(self) -> dict[str, Any]:
        lat = sorted(s.latency for s in self.samples)
        tokens = sum(s.tokens for s in self.samples)
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "requests": len(self.samples),
            "errors": len(self.errors),
            "tokens_per_s": tokens / self.wall if self.wall else 0.0,
            "requests_per_s": len(self.samples) / self.wall if self.wall else 0.0,
            "p50_latency_s": _pct(lat, 50),
            "p95_latency_s": _pct(lat, 95),
            "p50_ttft_s": _pct(sorted(s.ttft for s in self.samples), 50),
            "mean_tokens": tokens / len(self.samples) if self.samples else 0.0,
        }


def _pct(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with few samples it is an observed value)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, round(q / 100 * len(sorted_values) + 0.4999))
    return sorted_values[min(rank, len(sorted_values)) - 1]


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> Sample:
    t0 = time.perf_counter()
    ttft = float("nan")
    text: list[str] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    if not text:
                        ttft = time.perf_counter() - t0
                    text.append(choice["text"])
    return Sample(latency=time.perf_counter() - t0, ttft=ttft, tokens=tokens, text="".join(text))


def request_body(args: argparse.Namespace, mode: str, i: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.model:
        body["model"] = args.model
    if mode == "plain":
        body["speculative"] = {"tau": 0}
    elif args.policy:
        body["speculative"] = {"policy": args.policy}
    return body


async def run_level(
    client: httpx.AsyncClient, args: argparse.Namespace, mode: str, concurrency: int, result: Result
) -> None:
    """``args.requests`` requests through ``concurrency`` clients, each sending its next one when done."""
    counter = iter(range(args.requests))

    async def worker() -> None:
        for i in counter:
            try:
                sample = await one_request(client, request_body(args, mode, i))
                result.samples.append(sample)
                result.texts.setdefault(i % len(PROMPTS), set()).add(sample.text)
            except (httpx.HTTPError, RuntimeError) as e:
                result.errors.append(str(e))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall += time.perf_counter() - t0


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        health = (await client.get("/health")).json()
        models = (await client.get("/v1/models")).json()
        for mode in args.modes:  # warm-up: first requests pay one-off costs
            await one_request(client, {**request_body(args, mode, 0), "max_tokens": 8})
        results = {(m, c): Result(m, c) for c in args.concurrency for m in args.modes}
        for concurrency in args.concurrency:
            for _ in range(args.rounds):
                for mode in args.modes:
                    await run_level(client, args, mode, concurrency, results[(mode, concurrency)])
                    print(f"  {mode:>5} x{concurrency:<3} done", file=sys.stderr, flush=True)
    rows = [r.summary() for r in results.values()]
    identical = None
    if args.temperature == 0:  # greedy: every request with the same prompt, in either mode, must match
        outputs: dict[int, set[str]] = {}
        for r in results.values():
            for k, v in r.texts.items():
                outputs.setdefault(k, set()).update(v)
        identical = sum(len(v) == 1 for v in outputs.values()), len(outputs)
    return {
        "server": health,
        "model": models["data"][0],
        "settings": vars(args),
        "rows": rows,
        "greedy_identical": identical,
    }


def render(report: dict[str, Any]) -> str:
    rows = report["rows"]
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    lines = [
        "| mode | clients | requests | errors | output tok/s | req/s | p50 latency s | p95 latency s | p50 TTFT s |"
        " spec/plain tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = ""
        plain = by.get(("plain", r["concurrency"]))
        if r["mode"] == "spec" and plain and plain["tokens_per_s"]:
            ratio = f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}×"
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.1f} | "
            f"{r['requests_per_s']:.2f} | {r['p50_latency_s']:.3f} | {r['p95_latency_s']:.3f} | "
            f"{r['p50_ttft_s']:.3f} | {ratio} |"
        )
    same = report["greedy_identical"]
    if same is not None:
        lines.append(
            f"\nPrompts whose greedy outputs were identical in every request of both modes: {same[0]}/{same[1]}."
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model id to send (default: none, the server's)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per mode, concurrency level and round")
    p.add_argument("--rounds", type=int, default=1, help="alternations of the modes at each level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--policy", default=None, help="policy for the speculative mode (default: the server's)")
    p.add_argument("--modes", nargs="+", default=["spec", "plain"], choices=["spec", "plain"])
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the full report as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(main_async(args))
    except httpx.ConnectError as e:
        print(f"load_test: error: cannot reach a server at {args.url}: {e}", file=sys.stderr)
        return 2
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if any(r["errors"] for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
