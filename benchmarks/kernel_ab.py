"""A/B of the CPU kernel against another checkout's kernel, in one process, interleaved.

Loads ``<baseline>/src/specdec/runtime/native_kernel.py`` (its own C++ source and weight layout) next to this
tree's kernel, runs the same checkpoint through both, and times verify blocks of k rows (``--batch``: batches of k
sequences, one row each, every sequence with its own cache of ``--context`` tokens) with the two kernels taking turns
(A B, then B A), so machine noise hits both alike. Prints medians and the B/A ratio per k.

    python benchmarks/kernel_ab.py --baseline /path/to/other/checkout --shapes default qwen2.5-0.5b --ks 1 2 4 6 8 16
    python benchmarks/kernel_ab.py --baseline ../main --ks 64 128 --context 16   # prefill-sized blocks
    python benchmarks/kernel_ab.py --baseline ../main --batch --ks 1 4 16 --context 300  # k sequences, a row each
    python benchmarks/kernel_ab.py --baseline ../main --batch --rows 3 --ks 16  # 16 sequences' verify blocks of 3
    python benchmarks/kernel_ab.py --baseline ../main --products 3456x640 640x1728 --ks 16 64  # products alone

Shapes: ``default`` (the shipped target), ``draft`` (the shipped draft) or a name of ``specdec.real_shapes.SHAPES``.
``--products MxN ...``: the products alone instead of passes, ``PackedWeight.matmul`` of k rows by each M x N matrix
(outputs x inputs, random bf16), ``--copies`` copies of it cycled so that their weights come from memory as a pass's
do where they outgrow the caches (``--copies 1``: the same matrix over and over, from the caches).
Besides the ratio of the medians, each round's B/A (A and B alternate within a round) is reported as a median and
range: on a machine whose memory changes speed within minutes, the two kernels' rounds are what share a state.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_baseline(checkout: Path) -> Any:
    path = checkout / "src" / "specdec" / "runtime" / "native_kernel.py"
    spec = importlib.util.spec_from_file_location("specdec_baseline_native_kernel", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no kernel module at {path}")
    mod = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would be: a module-level dataclass looks its module up there.
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def runner_with(fused_cls: Any, path: Path, dtype: torch.dtype, kv_dtype: str) -> Any:
    import specdec.runtime.native as native

    base_cls = fused_cls

    class Fused(base_cls):  # type: ignore[misc, valid-type]
        """Older kernels: no key blocks (caches of max_context positions), no restricted head, fp32 caches only."""

        def __init__(
            self, cfg: Any, weights: Any, dtype: Any, max_context: int, head: Any = None, kv: Any = None
        ) -> None:
            try:
                super().__init__(cfg, weights, dtype, max_context, head, kv)
            except TypeError:
                if kv not in (None, torch.float32):
                    raise SystemExit("the baseline kernel keeps fp32 caches only: run with --kv-dtype fp32") from None
                try:
                    super().__init__(cfg, weights, dtype, max_context, head)
                except TypeError:
                    super().__init__(cfg, weights, dtype, max_context)
            if not hasattr(self, "positions"):
                self.positions, self.key_block = max_context, 1
            if not hasattr(self, "head_ids"):
                self.head_ids = None
            if not hasattr(self, "kv_dtype"):
                self.kv_dtype = torch.float32

    fused_cls = Fused
    saved = native.FusedLlama
    native.FusedLlama = fused_cls
    try:
        return native.NativeRunner.from_pretrained(path, dtype=dtype, kernel=True, max_context=1024, kv_dtype=kv_dtype)
    finally:
        native.FusedLlama = saved


def run_pass(
    runner: Any,
    caches: list[Any],
    rows: list[int],
    k: int,
    batch: bool,
    context: int,
    per: int = 1,
    argmax: bool = False,
) -> torch.Tensor:
    """One pass of k rows: a block in ``caches[0]``, or (``batch``) a block of ``per`` rows in each of ``caches[:k]``
    (k x per rows), then (``argmax``) its rows' argmax as greedy verification reads it; every cache is then cropped
    back to ``context`` tokens."""
    if batch:
        blocks = [(rows[i * per : (i + 1) * per], c) for i, c in enumerate(caches[:k])]
        out = runner.forward_blocks(blocks, [per] * k, argmax_only=argmax)
    else:
        out = runner.forward_blocks([(rows[:k], caches[0])], [k], argmax_only=argmax)
    if argmax:
        runner.pass_argmax(out)  # the baseline kernel (no argmax in its pass): argmax_rows
    for c in caches[: k if batch else 1]:
        c.crop(context)
    return out


def table(samples: dict[tuple[str, int], list[float]], ks: list[int], unit: float, label: str) -> None:
    """The timing table: medians (and minima) of A and B per k, their ratios, and B/A round by round."""
    med = {key: statistics.median(v) for key, v in samples.items()}
    low = {key: min(v) for key, v in samples.items()}
    print("medians (and minima) over rounds; ratios of medians (of minima); B/A round by round: median (range)")
    print(f"{'k':>4} {'A ' + label:>15} {'B ' + label:>15} {'B/A':>13} {'A k/1':>6} {'B k/1':>6} {'B/A by round':>20}")
    for k in ks:
        a, b, la, lb = med[("A", k)], med[("B", k)], low[("A", k)], low[("B", k)]
        a1, b1 = med.get(("A", 1), float("nan")), med.get(("B", 1), float("nan"))
        per = [y / x for x, y in zip(samples[("A", k)], samples[("B", k)])]
        print(
            f"{k:>4} {a * unit:>7.2f} ({la * unit:>5.2f}) {b * unit:>7.2f} ({lb * unit:>5.2f}) {b / a:>6.3f} ({lb / la:.3f})"
            f" {a / a1:>6.2f} {b / b1:>6.2f} {statistics.median(per):>7.3f} ({min(per):.2f}-{max(per):.2f})"
        )
    sys.stdout.flush()


def products_ab(base: Any, nk: Any, shape: tuple[int, int], ks: list[int], rounds: int, copies: int) -> None:
    """A and B's products of k rows by ``copies`` random bf16 matrices of ``shape`` in turn, interleaved by round."""
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(*shape, generator=gen) * 0.05 for _ in range(copies)]
    packed = {name: [mod.PackedWeight(w, torch.bfloat16) for w in mats] for name, mod in (("A", base), ("B", nk))}
    xs = {k: torch.randn(k, shape[1], generator=gen) for k in ks}
    threads = torch.get_num_threads()
    k_max = max(ks)
    diff = max(
        float((a.matmul(xs[k_max], threads=threads) - b.matmul(xs[k_max], threads=threads)).abs().max())
        for a, b in zip(packed["A"], packed["B"])
    )
    print(
        f"\nproducts {shape[0]} x {shape[1]}, {copies} copies: max absolute difference A vs B at k={k_max}: {diff:.2e}"
    )
    samples: dict[tuple[str, int], list[float]] = {(name, k): [] for name in packed for k in ks}
    for rnd in range(rounds):
        for k in ks:
            for name in list(packed)[:: 1 if rnd % 2 == 0 else -1]:
                for w in packed[name][:2]:  # the caches as the other side left them, warmed on this side's calls
                    w.matmul(xs[k], threads=threads)
                t0 = time.perf_counter()
                for w in packed[name]:
                    w.matmul(xs[k], threads=threads)
                samples[(name, k)].append((time.perf_counter() - t0) / copies)
    table(samples, ks, 1e6, "µs")


def parse_product(text: str) -> tuple[int, int]:
    try:
        m, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a product is MxN (outputs x inputs), got {text!r}") from None
    if m < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"a product's sizes must be positive, got {text!r}")
    return m, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout whose kernel is A")
    ap.add_argument("--shapes", nargs="+", default=["default"], help="default, draft or a real-shape name")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--kv-dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto", help="both kernels' caches")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-seconds", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (default: torch's)")
    ap.add_argument("--batch", action="store_true", help="k sequences of one row each, not a block of k rows")
    ap.add_argument("--rows", type=int, default=1, help="with --batch: rows per sequence (a verify block each)")
    ap.add_argument(
        "--argmax",
        action="store_true",
        help="each pass followed by its rows' argmax, as greedy verification reads it (from a kernel of ABI 17 on, "
        "taken in the pass; before, a call of its own; from ABI 22, where the build has one, from the int8 head "
        "without logits)",
    )
    ap.add_argument(
        "--products", type=parse_product, nargs="+", metavar="MxN", help="time products alone (see above), not passes"
    )
    ap.add_argument("--copies", type=int, default=12, help="with --products: matrices cycled (default 12)")
    args = ap.parse_args()
    if args.copies < 1:
        ap.error("--copies must be at least 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from specdec import real_shapes
    from specdec.runtime import native_kernel as nk

    shipped = {"default": "target", "draft": "draft"}
    known = [*shipped, *real_shapes.SHAPES]
    unknown = [shape for shape in args.shapes if shape not in known]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r}; known: {', '.join(known)}")

    base = load_baseline(args.baseline.resolve())
    print(f"A = {args.baseline} ({base.kernel_status()}), B = this tree ({nk.kernel_status()}), {args.dtype}")
    if args.products:
        print(f"threads {torch.get_num_threads()}, products alone, bf16 weights")
        for product in args.products:
            products_ab(base, nk, product, args.ks, args.rounds, args.copies)
        return
    print(f"threads {torch.get_num_threads()}, context {args.context}, caches {args.kv_dtype}")
    for shape in args.shapes:
        path = ROOT / "src/specdec/models" / shipped[shape] if shape in shipped else real_shapes.checkpoint(shape)
        runners = {
            "A": runner_with(base.FusedLlama, path, DTYPES[args.dtype], args.kv_dtype),
            "B": runner_with(nk.FusedLlama, path, DTYPES[args.dtype], args.kv_dtype),
        }
        gen = torch.Generator().manual_seed(0)
        k_max = max(args.ks)
        rows = torch.randint(0, 8192, (k_max * args.rows,), generator=gen).tolist()
        # One sequence (blocks), or one per row (--batch), each holding its own prompt of --context tokens.
        prompts = [torch.randint(0, 8192, (args.context,), generator=gen) for _ in range(k_max if args.batch else 1)]
        caches: dict[str, list[Any]] = {}
        for name, r in runners.items():
            caches[name] = [r.new_cache() for _ in prompts]
            for prompt, cache in zip(prompts, caches[name]):
                r.forward(prompt, cache, last_only=True)

        def call(name: str, k: int) -> torch.Tensor:
            return run_pass(runners[name], caches[name], rows, k, args.batch, args.context, args.rows, args.argmax)  # noqa: B023

        # Same logits? (A and B round differently; report the largest relative difference at k = max.)
        outs = {name: call(name, k_max) for name in runners}
        what = "batch" if args.batch else "block"
        if min(out.shape[1] for out in outs.values()) == 0:  # --argmax on a kernel with an int8 head: no logits
            best = {name: runners[name]._pass_best for name in runners}
            print(
                f"\n{shape}: argmax A vs B at {what} k={k_max}: {'the same' if best['A'] == best['B'] else 'DIFFERENT'}"
            )
        else:
            diff = float((outs["A"] - outs["B"]).abs().max() / outs["A"].abs().max())
            print(f"\n{shape}: max relative logit difference A vs B at {what} k={k_max}: {diff:.2e}")
        counts: dict[tuple[str, int], int] = {}
        for name in runners:
            for k in args.ks:
                t0 = time.perf_counter()
                call(name, k)
                counts[(name, k)] = max(1, int(args.min_seconds / (time.perf_counter() - t0)) + 1)
        samples: dict[tuple[str, int], list[float]] = {key: [] for key in counts}
        for rnd in range(args.rounds):
            for k in args.ks:
                # A B in even rounds, B A in odd ones: whichever runs second after a change of k found the machine
                # in another state (identical kernels measured B/A 0.93 at 16 sequences in a fixed order).
                for name in list(runners)[:: 1 if rnd % 2 == 0 else -1]:
                    n = counts[(name, k)]
                    t0 = time.perf_counter()
                    for _ in range(n):
                        call(name, k)
                    samples[(name, k)].append((time.perf_counter() - t0) / n)
        table(samples, args.ks, 1e3, "ms")


if __name__ == "__main__":
    main()
