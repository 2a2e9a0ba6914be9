"""Per-call latency of the native runtime vs the transformers runtime on small Llama shapes.

Random weights (timing only). For each shape, dtype, thread count and block size k, both runtimes
hold ~100 tokens in cache; each call runs k tokens and is then rolled back, so the context stays put.
Runtimes alternate in rounds (A B A B ...) so machine noise hits both alike; medians and the ratio are
reported. ``--profile`` prints a torch.profiler breakdown of native decode steps (k=1).

    python benchmarks/runtime_micro.py                       # all shapes, bf16+fp32, 1 and 2 threads
    python benchmarks/runtime_micro.py --shapes draft --dtypes fp32 --threads 1 --profile
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # 8.4M params, the shape of the C++ reference figure (0.65 ms/token bf16) in MEASUREMENTS.md
    "8L-d256": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8
    ),
    # the default target and draft shapes
    "target": dict(
        hidden_size=640, intermediate_size=1728, num_hidden_layers=4, num_attention_heads=10, num_key_value_heads=5
    ),
    "draft": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4
    ),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def write_checkpoint(root: Path, name: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = root / name
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, tie_word_embeddings=True, max_position_embeddings=1024, **SHAPES[name])
    LlamaForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    return out


def load_runners(path: Path, dtype: torch.dtype, compile: bool) -> dict[str, Any]:
    from specdec.runtime.hf import HFRunner
    from specdec.runtime.native import NativeRunner

    runners: dict[str, Any] = {"native": NativeRunner.from_pretrained(path, dtype=dtype)}
    if compile:
        runners["native-compiled"] = NativeRunner.from_pretrained(path, dtype=dtype, compile=True)
    runners["hf"] = HFRunner.from_pretrained(path, dtype=dtype)
    return runners


def time_calls(runner: Any, cache: Any, block: torch.Tensor, context: int, n: int) -> list[float]:
    """Seconds per ``forward(block)`` with ``context`` tokens in cache, rolled back after each call."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        runner.forward(block, cache)
        out.append(time.perf_counter() - t0)
        cache.crop(context)
    return out


def bench_k(runners: dict[str, Any], k: int, context: int, rounds: int, per_round: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(k)
    prompt = torch.randint(0, 8192, (context,), generator=gen)
    block = torch.randint(0, 8192, (k,), generator=gen)
    caches = {}
    for name, r in runners.items():
        caches[name] = r.new_cache()
        r.forward(prompt, caches[name])
        time_calls(r, caches[name], block, context, 10)  # warm-up (and compilation)
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, r in runners.items():
            samples[name] += time_calls(r, caches[name], block, context, per_round)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def profile_native(runner: Any, context: int, steps: int = 200) -> str:
    from torch.profiler import ProfilerActivity, profile

    cache = runner.new_cache()
    runner.forward(torch.randint(0, 8192, (context,)), cache)
    block = torch.tensor([1])
    time_calls(runner, cache, block, context, 20)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_calls(runner, cache, block, context, steps)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=40)
    ap.add_argument("--compile", action="store_true", help="also time NativeRunner(compile=True) (slow to compile)")
    ap.add_argument("--profile", action="store_true", help="print a profiler table of native k=1 steps per setting")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    results = []
    print(f"torch {torch.__version__}; ms per call, median; {args.context} tokens in cache")
    print(f"{'shape':8} {'dtype':5} {'thr':>3} {'k':>2} " + " ".join(f"{n:>16}" for n in ("native", "hf", "hf/native")))
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            path = write_checkpoint(Path(tmp), shape)
            for dname in args.dtypes.split(","):
                runners = load_runners(path, DTYPES[dname], args.compile)
                for threads in (int(t) for t in args.threads.split(",")):
                    torch.set_num_threads(threads)
                    for k in (int(x) for x in args.ks.split(",")):
                        ms = bench_k(runners, k, args.context, args.rounds, args.per_round)
                        row = dict(shape=shape, dtype=dname, threads=threads, k=k, ms=ms)
                        results.append(row)
                        extra = "".join(f" {n}={v:.3f}" for n, v in ms.items() if n not in ("native", "hf"))
                        print(
                            f"{shape:8} {dname:5} {threads:>3} {k:>2} {ms['native']:16.3f} {ms['hf']:16.3f} "
                            f"{ms['hf'] / ms['native']:16.2f}{extra}",
                            flush=True,
                        )
                    if args.profile:
                        print(profile_native(runners["native"], args.context))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
