"""Throughput of the Ray Serve deployment with one and two replicas, side by side in one run.

Starts a local Ray on 127.0.0.1 (``--cpus`` logical CPUs), then measures each layout in turn, in rounds that
alternate the layouts so drift in the machine's load hits them alike:

- ``process``: a plain ``specdec serve`` (no Ray) for reference;
- ``1 replica x C CPUs`` for each C in ``--replica-cpus``;
- ``2 replicas x 1 CPU``.

Every measurement sends ``--requests`` greedy completions of ``--max-tokens`` tokens from ``--concurrency``
clients and reports output tokens/s over all clients, requests/s and p50/p95 latency; greedy outputs of
every layout are compared (they must be identical). The shipped default pair is served unless
``--target/--draft`` are given.

    python benchmarks/ray_replicas.py --rounds 2 --json docs/data/bench_ray_replicas.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from load_test import PROMPTS as LOAD_PROMPTS  # this folder is on sys.path when run as a script

# Eight of the load benchmark's prompts (the ones this benchmark's recorded runs used).
PROMPTS = [LOAD_PROMPTS[i] for i in (0, 8, 9, 10, 11, 12, 13, 14)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def drive(url: str, requests: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    latencies: list[float] = []
    tokens = 0
    texts: dict[int, str] = {}
    replicas: dict[str, int] = {}

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
            t0 = time.perf_counter()
            r = await http.post(f"{url}/v1/completions", json=body)
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            out = r.json()
            tokens += out["usage"]["completion_tokens"]
            texts[i % len(PROMPTS)] = out["choices"][0]["text"]
            rid = r.headers.get("x-specdec-replica", "-")
            replicas[rid] = replicas.get(rid, 0) + 1

    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "tokens_per_s": tokens / wall,
        "requests_per_s": requests / wall,
        "p50_s": statistics.median(lat),
        "p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
        "wall_s": wall,
        "tokens": tokens,
        "replicas": replicas,
        "texts": texts,
    }


def wait_up(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--cpus", type=int, default=2, help="logical CPUs of the local Ray (default: 2)")
    ap.add_argument("--replica-cpus", type=float, nargs="+", default=[1.0, 2.0], help="layouts of one replica")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-process", action="store_true", help="skip the single-process reference")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the local Ray on 127.0.0.1 only
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    import torch
    from ray import serve

    from specdec.server import ServerSettings
    from specdec.server.ray_serve import RaySettings, build_app, default_model_settings

    # No prefix cache: the same prompts are sent again and again (each repeat would copy its whole prefill).
    model = replace(default_model_settings(), target=args.target, draft=args.draft, prefix_cache="off")
    settings = ServerSettings(model_name="bench")
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    ray_url = f"http://127.0.0.1:{port}"

    layouts: list[tuple[str, dict[str, Any] | None]] = [] if args.no_process else [("process", None)]
    layouts += [(f"1 replica x {c:g} CPU", {"replicas": 1, "num_cpus": c}) for c in args.replica_cpus]
    layouts.append(("2 replicas x 1 CPU", {"replicas": 2, "num_cpus": 1.0}))
    # A replica runs max(1, floor(num_cpus)) torch threads (specdec.server.ray_serve.replica_threads).
    torch_threads = {
        name: torch.get_num_threads() if spec is None else max(1, int(spec["num_cpus"])) for name, spec in layouts
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in layouts}
    try:
        for rnd in range(args.rounds):
            for name, spec in layouts:
                proc = None
                if spec is None:
                    p = free_port()
                    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--port", str(p), "--model-name", "bench"]
                    cmd += ["--log-level", "warning", "--prefix-cache", "off"]  # as the replicas
                    cmd += [
                        x
                        for flag, v in (("--target", args.target), ("--draft", args.draft))
                        if v
                        for x in (flag, str(v))
                    ]
                    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    url = f"http://127.0.0.1:{p}"
                    wait_up(url)
                else:
                    serve.run(build_app(model, settings, RaySettings(**spec)), name="specdec", route_prefix="/")
                    url = ray_url
                try:
                    asyncio.run(drive(url, len(PROMPTS), len(PROMPTS), args.max_tokens))  # warm-up
                    result = asyncio.run(drive(url, args.requests, args.concurrency, args.max_tokens))
                finally:
                    if proc is not None:
                        proc.terminate()
                        proc.wait(30)
                    else:
                        serve.delete("specdec")
                runs[name].append(result)
                print(
                    f"round {rnd + 1} {name:>22}: {result['tokens_per_s']:7.1f} tok/s  "
                    f"p50 {result['p50_s']:.2f} s  p95 {result['p95_s']:.2f} s  replicas {result['replicas']}",
                    flush=True,
                )
    finally:
        serve.shutdown()
        ray.shutdown()

    reference = runs[layouts[0][0]][0]["texts"]
    identical = all(r["texts"] == reference for rs in runs.values() for r in rs)
    print(f"\ngreedy outputs identical across layouts: {identical}")
    print(f"{'layout':>22} | torch threads | tok/s (mean of {args.rounds}) | per round | p50 s | p95 s")
    summary = {}
    for name, rs in runs.items():
        tps = [r["tokens_per_s"] for r in rs]
        summary[name] = {
            "torch_threads": torch_threads[name],
            "tokens_per_s": statistics.mean(tps),
            "tokens_per_s_rounds": tps,
            "p50_s": statistics.mean(r["p50_s"] for r in rs),
            "p95_s": statistics.mean(r["p95_s"] for r in rs),
        }
        rounds = " ".join(f"{t:.1f}" for t in tps)
        print(
            f"{name:>22} | {torch_threads[name]:>13} | {summary[name]['tokens_per_s']:>19.1f} | {rounds:>9} | "
            f"{summary[name]['p50_s']:.2f} | {summary[name]['p95_s']:.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "machine": f"{platform.machine()} {os.cpu_count()} cores (shared with other work: noisy)",
            "ray_cpus": args.cpus,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "target": str(args.target or "default pair"),
            "greedy_outputs_identical": identical,
        }
        args.json.write_text(json.dumps({"meta": meta, "layouts": summary}, indent=2) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
