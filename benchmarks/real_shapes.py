"""What a target pass of 1..16 rows costs at real model shapes, next to the machine's limits, measured in one run.

For each shape (random-init checkpoints with the published bodies of SmolLM2-135M, Qwen2.5-0.5B, Llama-3.2-1B;
**vocabulary cut to the shipped 8,192-token tokenizer** unless ``--vocab published`` asks for the published one, see
``specdec.real_shapes``; or a checkpoint directory of your own, as it is) it measures, on the CPU kernel:

- t(k) of a verify block (one sequence, k consecutive tokens) and of a batch (k sequences, one token each,
  through ``forward_batch``), k = 1..16, at 64 tokens of context, row counts taking turns in rounds;
- the memory floor: the bytes of weights a pass reads ÷ the read bandwidth of the kernel's threads, measured here;
- the multiply-add peak of the products' instruction (fp32 FMA at the build's vector width, or VDPBF16PS for bf16
  weights on an AVX512-BF16 build), measured here;
- each pass as % of the floor (floor ÷ t) and % of the peak (flops ÷ t ÷ peak);
- the speedup greedy speculation would give by the ideal formula with the measured t(k), α ∈ {0.6, 0.7, 0.8},
  and the shipped draft's measured one-token cost c = t_draft(1) / t(1).

Writes JSON and a PNG (t(k)/t(1) against k per shape, with the floor and the compute bound).

    python benchmarks/real_shapes.py                        # the three shapes, bf16, ~5 minutes
    python benchmarks/real_shapes.py --dtype fp32 --shapes qwen2.5-0.5b
    python benchmarks/real_shapes.py --quick --out /tmp/rs  # a tiny shape, seconds (smoke test)
    python benchmarks/real_shapes.py --shapes qwen2.5-0.5b --vocab published   # its 151,936-token head too
    python benchmarks/real_shapes.py --shapes ~/models/my-llama               # a checkpoint of your own

Checkpoints go to ``$SPECDEC_CACHE_DIR/real_shapes`` (else ``~/.cache/specdec/real_shapes``), not the repo.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ALPHAS = (0.6, 0.7, 0.8)
DEFAULT_SHAPES = ["smollm2-135m", "qwen2.5-0.5b", "llama3.2-1b"]


def plot(result: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'specdec[bench]'): no plot"
    shapes = result["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, (name, s) in zip(axes[0], shapes.items()):
        ks = [int(k) for k in s["block"]]
        t1 = s["block"]["1"]["seconds"]
        ax.plot(ks, [s["block"][str(k)]["seconds"] / t1 for k in ks], "o-", label="verify block (1 sequence)")
        if s["batch"]:
            kb = [int(k) for k in s["batch"]]
            ax.plot(kb, [s["batch"][str(k)]["seconds"] / t1 for k in kb], "s--", label="batch (k sequences)")
        bound = [max(s["floor_seconds"], s["flops_per_row"] * k / result["limits"]["peak_flops"]) / t1 for k in ks]
        ax.plot(ks, bound, ":", color="k", label="max(memory floor, FMA peak)")
        ax.axhline(s["floor_seconds"] / t1, color="gray", lw=0.8)
        label = Path(name).name or name  # a checkpoint directory: its last part
        ax.set_title(f"{label} ({s['weight_mb']:.0f} MB {result['dtype']}, {s['vocab']:,}-token head)", fontsize=9)
        ax.set_xlabel("rows k")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("t(k) / t(1)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"{result['cpu'].get('model', '?')}, {result['kernel']}, {result['threads']} threads, {result['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


@dataclass
class ShapeSource:
    """Where a shape's checkpoint comes from: a named shape written here at ``vocab`` tokens, or a directory."""

    name: str
    directory: Path | None = None
    vocab: int = 0
    published_vocab: int | None = None
    root: Path | None = None

    def path(self) -> Path:
        if self.directory is not None:
            return self.directory
        from specdec import real_shapes as rs

        return rs.checkpoint(self.name, self.root, vocab=self.vocab)


def parse_vocab(text: str) -> str | int:
    """``--vocab``: ``shipped``, ``published`` or a positive number; SystemExit naming the value otherwise."""
    if text in ("shipped", "published"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise SystemExit(f"--vocab must be shipped, published or a positive number, got {text!r}")
    return n


def shape_source(shape: str, vocab: str | int, root: Path | None) -> ShapeSource:
    """``shape`` resolved: a named shape (with ``vocab``: shipped, published or a number) or a checkpoint directory;
    SystemExit naming what is wrong otherwise."""
    from specdec import real_shapes as rs

    if shape in rs.SHAPES:
        published = int(rs.SHAPES[shape]["published_vocab_size"])
        n = rs.VOCAB if vocab == "shipped" else published if vocab == "published" else int(vocab)
        return ShapeSource(shape, vocab=n, published_vocab=published, root=root)
    d = Path(shape).expanduser()
    if d.is_dir():
        if not (d / "config.json").is_file():
            raise SystemExit(f"{shape}: a directory without config.json is not a checkpoint")
        from specdec.errors import SpecdecError
        from specdec.runtime.native_config import read_config

        try:  # before any measuring: a model the CPU kernel does not run is said at once
            read_config(d)
        except SpecdecError as e:
            raise SystemExit(f"{shape}: the CPU kernel cannot run it: {e}") from None
        return ShapeSource(shape, directory=d.resolve())
    raise SystemExit(f"unknown shape {shape!r}: one of {', '.join(rs.SHAPES)} or a checkpoint directory")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help=f"named shapes or checkpoint directories (default: {' '.join(DEFAULT_SHAPES)})",
    )
    ap.add_argument(
        "--vocab",
        default="shipped",
        help="vocabulary of the named shapes' checkpoints: shipped (the shipped tokenizer's 8,192, default), "
        "published (each model's own) or a number; a checkpoint directory keeps its own",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--max-rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="the tiny shape, few rows and rounds (smoke test)")
    ap.add_argument("--out", type=Path, default=Path("."), help="directory for real_shapes-<date>.json/.png")
    ap.add_argument("--checkpoints", type=Path, default=None, help="where checkpoints are written (default: cache)")
    args = ap.parse_args()
    from specdec import real_shapes as rs
    from specdec.errors import SpecdecError
    from specdec.runtime import native_kernel as nk
    from specdec.runtime.native import NativeRunner

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not nk.kernel_available():
        raise SystemExit(f"the CPU kernel is unavailable: {nk.kernel_status()}")
    shapes = args.shapes or (["tiny"] if args.quick else DEFAULT_SHAPES)
    vocab_wanted = parse_vocab(args.vocab)
    sources = {s: shape_source(s, vocab_wanted, args.checkpoints) for s in shapes}
    if args.max_rows < 1 or args.context < 1 or args.rounds < 1:
        raise SystemExit("--max-rows, --context and --rounds must be positive")
    ks = [1, 2, 3, 4, 6, 8] if args.quick else list(range(1, args.max_rows + 1))
    ks = [k for k in ks if k <= args.max_rows]
    rounds, min_seconds, mib = (2, 0.01, 64) if args.quick else (args.rounds, 0.05, 512)
    dtype = DTYPES[args.dtype]
    threads = max(1, torch.get_num_threads())
    kind = {"avx512bf16": "bf16dot", "amx": "amx"}.get(nk.kernel_isa(), "fp32") if dtype == torch.bfloat16 else "fp32"
    elem = torch.tensor([], dtype=dtype).element_size()

    def limits() -> tuple[float, float]:
        return rs.read_bandwidth(threads, mib=mib), rs.fma_peak(threads, kind, seconds=0.05 if args.quick else 0.2)

    t_start = time.time()
    bw0, peak0 = limits()
    draft_path = ROOT / "src" / "specdec" / "models" / "draft"
    draft_t1 = None
    if (draft_path / "config.json").exists():
        draft = NativeRunner.from_pretrained(draft_path, dtype=dtype, kernel=True, max_context=args.context + 32)
        draft_t1 = rs.pass_times(draft, [1], context=args.context, batches=False, rounds=rounds).block[1]
        del draft
    per_shape: dict[str, Any] = {}
    probe = rs.read_probe(threads, mib=mib, reps=3)  # its buffer allocated once: see rs.read_probe
    for name in shapes:
        path = sources[name].path()
        try:
            runner = NativeRunner.from_pretrained(
                path, dtype=dtype, kernel=True, max_context=args.context + max(ks) + 8
            )
        except (SpecdecError, ValueError, OSError, KeyError) as e:  # one the native runtime cannot load: say which
            raise SystemExit(f"{name}: cannot load {path} on the CPU kernel: {e}") from None
        # The memory's bandwidth is read again at every round, right before its one-row pass: on a shared host it
        # moves (a Zen 4 read 29-64 GB/s within minutes), and a floor read minutes away says little about a pass.
        times = rs.pass_times(runner, ks, context=args.context, rounds=rounds, min_seconds=min_seconds, probe=probe)
        fused = runner._fused  # how its products read their weights (native_kernel.streams_weights, cuts_columns)
        reads = {"one_row_one_panel": bool(fused.stream), "cut_columns": bool(fused.cut)} if fused else {}
        per_shape[name] = {"config": runner.config, "times": times, "path": str(path), "reads": reads}
        del runner
    bw1, peak1 = limits()  # again after the passes; the best of both (a shared machine only slows things down)
    bw, peak = max(bw0, bw1), max(peak0, peak1)
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": rs.cpu_info(),
        "kernel": nk.kernel_status(),
        "torch": torch.__version__,
        "threads": threads,
        "dtype": args.dtype,
        "context": args.context,
        "vocab": args.vocab,
        "limits": {
            "read_bytes_per_s": bw,
            "read_bytes_per_s_start_end": [bw0, bw1],
            "peak_kind": kind,
            "peak_flops": peak,
            "peak_flops_start_end": [peak0, peak1],
        },
        "draft": {"path": str(draft_path), "t1_seconds": draft_t1},
        "seconds": None,
        "shapes": {},
    }
    print(
        f"{result['cpu'].get('model', '?')}, L3 {result['cpu'].get('l3', '?')}, {result['kernel']}, {threads} threads"
    )
    print(f"read bandwidth {bw / 1e9:.1f} GB/s, {kind} peak {peak / 1e9:.0f} GFLOP/s, {args.dtype}")
    for name, entry in per_shape.items():
        cfg = entry["config"]
        times = entry["times"]
        vocab = cfg.vocab_size
        wbytes = rs.matrix_params(cfg, vocab) * elem
        floor = wbytes / bw
        flops1 = rs.pass_flops(cfg, vocab, 1, args.context)

        t1 = times.block[1]

        def row(
            k: int, t: float, cfg: Any = cfg, floor: float = floor, t1: float = t1, vocab: int = vocab
        ) -> dict[str, float]:
            flops = rs.pass_flops(cfg, vocab, k, args.context)
            return {
                "seconds": t,
                "vs_one_row": t / t1,
                "pct_floor": 100 * floor / t,
                "pct_peak": 100 * flops / t / peak,
            }

        s: dict[str, Any] = {
            "checkpoint": entry["path"],
            "vocab": vocab,
            "published_vocab": sources[name].published_vocab,
            "matrix_params": rs.matrix_params(cfg, vocab),
            "weight_mb": wbytes / 1e6,
            "floor_seconds": floor,
            "flops_per_row": flops1,
            # how the kernel reads this model's weights (decided from its size against the last-level cache)
            "reads": entry["reads"],
            "block": {str(k): row(k, t) for k, t in times.block.items()},
            # each round's one-row pass against the floor of the bandwidth read just before it
            "round_floor": {
                "read_bytes_per_s": times.probes,
                "one_row_seconds": times.block_rounds[1],
                "one_row_vs_floor": [t * b / wbytes for t, b in zip(times.block_rounds[1], times.probes)],
            },
            "batch": {str(k): row(k, t) for k, t in times.batch.items()},
            "batch_missing": times.batch_missing,
        }
        if draft_t1 is not None:
            c = draft_t1 / t1
            s["draft_cost_c"] = c
            s["ideal_speculative"] = {
                str(a): dict(zip(("tau", "speedup"), rs.ideal_speedup(times.block, c, a))) for a in ALPHAS
            }
        result["shapes"][name] = s
        cut = " (blocks cut their columns)" if entry["reads"].get("cut_columns") else ""
        print(f"\n{name}: {wbytes / 1e6:.0f} MB of weights ({vocab:,}-token head), floor {floor * 1e3:.2f} ms{cut}")
        rf = s["round_floor"]
        if rf["one_row_vs_floor"]:
            ratio = rf["one_row_vs_floor"]
            print(
                f"one-row pass ÷ the floor of its own round: median {statistics.median(ratio):.2f}x "
                f"({min(ratio):.2f}-{max(ratio):.2f}; bandwidth read {min(rf['read_bytes_per_s']) / 1e9:.0f}-"
                f"{max(rf['read_bytes_per_s']) / 1e9:.0f} GB/s over the rounds)"
            )
        print(
            f"{'k':>3} {'block ms':>9} {'/t1':>5} {'%floor':>6} {'%peak':>6}   {'batch ms':>9} {'/t1':>5} {'%peak':>6}"
        )
        for k in ks:
            b = s["block"][str(k)]
            line = f"{k:>3} {b['seconds'] * 1e3:>9.2f} {b['vs_one_row']:>5.2f} {b['pct_floor']:>6.1f} {b['pct_peak']:>6.1f}"
            if str(k) in s["batch"]:
                q = s["batch"][str(k)]
                line += f"   {q['seconds'] * 1e3:>9.2f} {q['vs_one_row']:>5.2f} {q['pct_peak']:>6.1f}"
            print(line)
        if s["batch_missing"]:
            print(f"batches: {s['batch_missing']}")
        if "ideal_speculative" in s:
            spec = ", ".join(f"α={a}: {v['speedup']:.2f}x (τ={v['tau']})" for a, v in s["ideal_speculative"].items())
            print(f"draft c = {s['draft_cost_c']:.3f}; ideal speculative speedup {spec}")
    result["seconds"] = time.time() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "real_shapes-" + dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d") + ("-quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    why = plot(result, args.out / f"{stem}.png")
    print(f"\nwrote {args.out / (stem + '.json')}" + (f" ({why})" if why else f" and {stem}.png"))


if __name__ == "__main__":
    main()
