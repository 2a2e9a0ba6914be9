"""Per-call latency of one native-runtime step vs the transformers runtime, plus a profile of one decode step.

Builds random-init Llama checkpoints of the reference shapes (timing only, weights do not matter):

- ``8L-d256``: the 8.4M-parameter 8-layer model of the C++ (llama.cpp) reference figure: hidden 256,
  8 layers, 4 heads, intermediate 688, vocab 8192, tied embeddings;
- ``target`` / ``draft``: the configs of the shipped default pair (src/specdec/models/{target,draft}).

For each shape, runtime/dtype and block size k, the runner holds ~100 tokens in cache; each call runs
k tokens and is rolled back, so the context stays put. All contenders of a shape take turns in rounds
(A B C ... A B C ...) so machine noise hits them alike; the table gives medians (and ms per token).
Then a profile of one step: for the operator path a torch.profiler table of k=1 decode steps (top ops by
self CPU time, per step); for the CPU kernel (one opaque call) its own per-phase timers, k=1 and k=4.

    python benchmarks/native_step.py                               # all shapes, 1 thread
    python benchmarks/native_step.py --shapes 8L-d256 --threads 1 2 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODELS = Path(__file__).resolve().parents[1] / "src" / "specdec" / "models"
REF_8L = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (runtime, dtype) contenders: "kernel" is the native runtime's one-call C++ CPU kernel (its default on CPU),
# "native" the same runtime through PyTorch operators (kernel=False); hf bf16 is slow where the CPU lacks
# native bf16 products (AVX2-only).
CONTENDERS = ["kernel-bf16", "kernel-fp32", "native-bf16", "native-fp32", "hf-bf16", "hf-fp32"]


def shape_config(name: str) -> dict[str, Any]:
    if name == "8L-d256":
        return dict(REF_8L)
    cfg = json.loads((MODELS / name / "config.json").read_text())
    return {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "dtype")}


def write_checkpoint(root: Path, name: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape_config(name)))
    out = root / name
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def load(path: Path, contender: str) -> Any:
    from specdec.runtime.hf import HFRunner
    from specdec.runtime.native import NativeRunner

    runtime, dt = contender.split("-")
    if runtime in ("native", "kernel"):
        return NativeRunner.from_pretrained(path, dtype=DTYPES[dt], kernel=runtime == "kernel")
    return HFRunner.from_pretrained(path, dtype=DTYPES[dt])


def bench_shape(
    path: Path, contenders: list[str], ks: list[int], context: int, rounds: int, per_round: int
) -> dict[tuple[str, int], list[float]]:
    """Seconds per call for each (contender, k), contenders interleaved in rounds."""
    runners = {}
    for c in contenders:
        try:
            runners[c] = load(path, c)
        except RuntimeError as e:  # e.g. an older native runtime whose bf16 packing needs AVX-512
            print(f"<!-- {c} failed to load: {str(e).splitlines()[0]} -->")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 8192, (context,), generator=gen)
    caches = {}
    for c, r in runners.items():
        caches[c] = r.new_cache()
        r.forward(prompt, caches[c])
    times: dict[tuple[str, int], list[float]] = {(c, k): [] for c in runners for k in ks}
    blocks = {k: torch.randint(0, 8192, (k,), generator=gen) for k in ks}
    for c, r in runners.items():  # warm-up: first calls allocate and pick kernels
        for k in ks:
            for _ in range(3):
                r.forward(blocks[k], caches[c])
                caches[c].crop(context)
    for _ in range(rounds):
        for k in ks:
            for c, r in runners.items():
                cache, block = caches[c], blocks[k]
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    r.forward(block, cache)
                    times[(c, k)].append(time.perf_counter() - t0)
                    cache.crop(context)
    return times


def profile_step(path: Path, contender: str, context: int, steps: int, rows: int) -> str:
    """torch.profiler table of ``steps`` k=1 decode steps, sorted by self CPU time (totals, and per step)."""
    from torch.profiler import ProfilerActivity, profile

    runner = load(path, contender)
    cache = runner.new_cache()
    runner.forward(torch.arange(context) % 8192, cache)
    tok = torch.tensor([7])
    if contender.startswith("kernel"):  # one opaque call: the kernel times its own phases
        return kernel_profile(contender, runner, cache, context, steps)
    for _ in range(20):
        runner.forward(tok, cache)
        cache.crop(context)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.forward(tok, cache)
            cache.crop(context)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    lines = [
        f"{contender}, k=1, {steps} steps, {torch.get_num_threads()} thread(s); "
        f"profiled step {total / steps / 1e3:.3f} ms (the profiler adds ~1 µs per op)",
        f"{'op':40s} {'self %':>7s} {'self µs/step':>13s} {'calls/step':>11s}",
    ]
    for e in events[:rows]:
        lines.append(
            f"{e.key:40s} {100 * e.self_cpu_time_total / total:6.1f}% "
            f"{e.self_cpu_time_total / steps:13.1f} {e.count / steps:11.1f}"
        )
    return "\n".join(lines)


def kernel_profile(contender: str, runner: Any, cache: Any, context: int, steps: int) -> str:
    """The CPU kernel's per-phase times (thread 0, after each phase's barrier) for k = 1 and a 4-token block."""
    lines = []
    for k, last_only in ((1, True), (4, False)):
        ids = torch.arange(k) + 7
        prof = runner._fused.profile(ids, cache.kv, context, last_only, steps)
        total = prof.pop("total")
        lines.append(
            f"kernel, k={k}, {steps} calls, {torch.get_num_threads()} thread(s): {total * 1e3:.3f} ms per call"
        )
        lines.append(f"{'phase (all layers)':48s} {'share':>6s} {'µs/call':>9s}")
        lines += [f"{name:48s} {100 * v / total:5.1f}% {v * 1e6:9.1f}" for name, v in prof.items()]
        lines.append("")
    return "\n".join(lines).rstrip()


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["8L-d256", "target", "draft"])
    ap.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--threads", nargs="+", type=int, default=[1])
    ap.add_argument("--context", type=int, default=100, help="tokens in cache before each timed call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=200, help="0: no profile")
    ap.add_argument("--profile-rows", type=int, default=18)
    ap.add_argument("--profile-shape", default="8L-d256")
    ap.add_argument("--json", type=Path, help="also write the medians here")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*deprecated.*")
    print(f"# native_step: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# load average at start: {os.getloadavg()[0]:.2f}; context {args.context} tokens\n")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {s: write_checkpoint(Path(tmp), s) for s in args.shapes}
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"## {threads} thread(s): median ms per call (ms per token)\n")
            print("| shape | k | " + " | ".join(args.contenders) + " |")
            print("|---|---|" + "---|" * len(args.contenders))
            for shape, path in paths.items():
                times = bench_shape(path, args.contenders, args.ks, args.context, args.rounds, args.per_round)
                for k in args.ks:
                    cells = []
                    for c in args.contenders:
                        if (c, k) not in times:
                            cells.append("error")
                            continue
                        ms = 1e3 * statistics.median(times[(c, k)])
                        results.append(dict(shape=shape, threads=threads, k=k, contender=c, ms=ms))
                        cells.append(f"{ms:.2f} ({ms / k:.2f})")
                    print(f"| {shape} | {k} | " + " | ".join(cells) + " |")
                sys.stdout.flush()
            print(f"\n(load average now {os.getloadavg()[0]:.2f})\n")
            if args.profile_steps and args.profile_shape in paths:
                for c in (c for c in args.contenders if c.startswith(("native", "kernel"))):
                    try:
                        table = profile_step(
                            paths[args.profile_shape], c, args.context, args.profile_steps, args.profile_rows
                        )
                    except RuntimeError as e:  # as above
                        table = f"{c}: {str(e).splitlines()[0]}"
                    print(f"```\n{table}\n```\n")
    if args.json:
        args.json.write_text(json.dumps(dict(machine=machine(), results=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
