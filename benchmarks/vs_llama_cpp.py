"""specdec beside llama.cpp on the same checkpoints converted to GGUF, measured in one run on this machine.

Three parts, each a side-by-side comparison with ratios:

- ``passes``: what a target pass of k rows costs, at ``--context`` tokens of cache, in specdec's CPU kernel
  (``specdec.real_shapes.pass_times``) and in llama.cpp (``llama-bench`` and ``llama-batched-bench``), for the shipped
  target (``default``) and random-init checkpoints with published bodies (``specdec.real_shapes``: SmolLM2-135M,
  Qwen2.5-0.5B, Llama-3.2-1B, the vocabulary cut to the shipped 8,192-token tokenizer). A *block* is one sequence's k
  consecutive tokens (a verify pass; llama.cpp's figure is its prompt pass of k tokens at that depth, which computes
  the output head for the last row only, so it is a lower bound on a llama.cpp verify pass); a *batch* is k sequences
  of one token each (llama.cpp's figure: ``llama-batched-bench``'s generation phase, k sequences per decode, every
  row's logits, as in specdec's). The two systems take turns in ``--rounds`` rounds; medians.
- ``pairs``: one-token passes only, the two systems in close pairs (a few seconds a pair) for ``--seconds`` per shape,
  the memory's read bandwidth read before and after each pair. A one-token pass streams every weight, and a shared
  host's memory can move between states within minutes (a Zen 4 read ~35 and ~60 GB/s by turns), so a comparison
  of passes taken minutes apart says more about the memory than about the code; a pair whose two reads agree is
  classed by them (``fast``/``slow`` where both states were seen), and the ratio is given per class.
- ``serve``: ``llama-server`` (plain decoding with ``--parallel`` slots and continuous batching, and with
  ``--spec`` also with the shipped draft as its speculative draft) beside ``specdec serve``, through
  ``benchmarks/load_test.py``'s clients (``--other``): the same prompts, clients and requests, in turn; tokens/s,
  latency, and each server's greedy outputs against its own solo run. Arguments after ``--`` go to load_test.

    python benchmarks/vs_llama_cpp.py --llama-cpp ~/src/llama.cpp passes --shapes default qwen2.5-0.5b llama3.2-1b
    python benchmarks/vs_llama_cpp.py --llama-cpp ~/src/llama.cpp pairs --shapes llama3.2-1b --seconds 300
    python benchmarks/vs_llama_cpp.py --llama-cpp ~/src/llama.cpp serve --spec -- --concurrency 1 4 16 32
    python benchmarks/vs_llama_cpp.py --llama-cpp ~/src/llama.cpp passes --shapes ~/models/Qwen2.5-0.5B   # your own
    python benchmarks/vs_llama_cpp.py --llama-cpp ~/src/llama.cpp serve --target ~/models/T --draft ~/models/D --spec

``--llama-cpp`` is a llama.cpp source tree built with CMake (``convert_hf_to_gguf.py``, ``gguf-py/`` and the binaries
under ``build/bin``; ``--bin`` names another binaries folder). Where only PyPI is reachable, the source distribution
of ``llama-cpp-python`` carries one (``vendor/llama.cpp``): docs/benchmarks.md shows the commands. Checkpoints are
converted once to bf16 GGUF under ``--out`` (default ``$SPECDEC_CACHE_DIR/llama_cpp``); the conversion uses the
tree's own script, told that the shipped tokenizer (byte-level BPE with GPT-2's split, a hash it does not list) is
GPT-2's, and to skip SentencePiece where a checkpoint has no ``tokenizer.model``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "src" / "specdec" / "models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Run inside llama.cpp's converter: the two things it cannot know about a checkpoint with the shipped tokenizer.
CONVERT = r"""
import json, runpy, sys
from pathlib import Path
tree = sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
try:
    from conversion.base import TextModel
except ImportError:  # an older tree: everything in the one script
    sys.path.insert(0, tree)
    from convert_hf_to_gguf import TextModel
pre, spm = TextModel.get_vocab_base_pre, TextModel._set_vocab_sentencepiece

def get_vocab_base_pre(self, tokenizer):
    try:
        return pre(self, tokenizer)
    except NotImplementedError:  # a hash it does not list: GPT-2's split if the tokenizer says so
        spec = json.loads((Path(self.dir_model) / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
        if spec.get("type") == "ByteLevel" and spec.get("use_regex", True):
            return "gpt-2"
        raise

def set_vocab_sentencepiece(self, *a, **k):
    if not (Path(self.dir_model) / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")  # what the converters catch to try the next vocabulary
    return spm(self, *a, **k)

TextModel.get_vocab_base_pre = get_vocab_base_pre
TextModel._set_vocab_sentencepiece = set_vocab_sentencepiece
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Failure(Exception):
    """A one-line error for the user (a missing tree, a tool that failed)."""


def find_tools(tree: Path, bin_dir: Path | None) -> dict[str, Path]:
    """The tree's converter and the binaries this benchmark runs; a Failure naming what is missing."""
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise Failure(f"{tree}: not a llama.cpp source tree (no convert_hf_to_gguf.py)")
    bins = bin_dir or tree / "build" / "bin"
    tools = {"convert": tree / "convert_hf_to_gguf.py"}
    for name in ("llama-bench", "llama-batched-bench", "llama-server"):
        tools[name] = bins / name
        if not os.access(tools[name], os.X_OK):
            raise Failure(
                f"{tools[name]}: missing; build it (cmake -B build && cmake --build build --target {name}) or name "
                "the binaries' folder with --bin"
            )
    return tools


def hf_dir(shape: str, out: Path) -> Path:
    """The Hugging Face checkpoint of ``shape``: a checkpoint directory of your own, the shipped target or draft, or a
    real-shape checkpoint beside the shipped tokenizer (llama.cpp's converter needs one; specdec's runner reads only
    the weights and config)."""
    if shape in ("default", "draft"):
        return SHIPPED / ("target" if shape == "default" else "draft")
    if Path(shape).is_dir():
        return Path(shape).resolve()
    from specdec import real_shapes as rs

    weights = rs.checkpoint(shape)
    side = out / "hf" / weights.name
    side.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        if not (side / name).exists():
            (side / name).symlink_to(weights / name)
    for name in TOKENIZER_FILES:
        if not (side / name).exists():
            shutil.copy(SHIPPED / "target" / name, side / name)
    return side


def gguf(shape: str, tree: Path, out: Path) -> Path:
    """``shape`` converted to a bf16 GGUF by the tree's own converter (once; kept under ``out``)."""
    src = hf_dir(shape, out)
    name = shape
    if Path(shape).is_dir():  # a directory of one's own: its name and a hash of where it is
        name = f"{src.name}-{hashlib.sha1(str(src).encode()).hexdigest()[:8]}"
    out.mkdir(parents=True, exist_ok=True)
    dst = out / f"{name}-bf16.gguf"
    weights = [p.stat().st_mtime for p in src.glob("*.safetensors")] or [(src / "config.json").stat().st_mtime]
    if dst.exists() and dst.stat().st_mtime >= max(weights):
        return dst
    tmp = dst.with_suffix(f".tmp{os.getpid()}")
    cmd = [sys.executable, "-c", CONVERT, str(tree), str(src), "--outtype", "bf16", "--outfile", str(tmp)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0 or not tmp.exists():
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise Failure(f"converting {src} to GGUF failed: {last}")
    tmp.rename(dst)
    return dst


def _run(cmd: list[str], timeout: float = 1800, stderr_too: bool = False) -> str:
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise Failure(f"{Path(cmd[0]).name} exited with {run.returncode}: {last}")
    return run.stdout + (run.stderr if stderr_too else "")


def parse_llama_bench(text: str) -> dict[tuple[int, int], float]:
    """``llama-bench -o json``: seconds of one run per (prompt tokens, generated tokens), the median sample."""
    return {(r["n_prompt"], r["n_gen"]): statistics.median(r["samples_ns"]) / 1e9 for r in json.loads(text)}


def parse_batched_bench(text: str) -> dict[int, float]:
    """``llama-batched-bench --output-format jsonl``: seconds of one decode of ``pl`` sequences' next tokens (its
    generation phase: ``tg`` decodes of ``pl`` rows)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[int(r["pl"])] = r["t_tg"] / r["tg"]
    return out


def llama_cpp_passes(tools: dict[str, Path], model: Path, ks: list[int], context: int, threads: int) -> dict[str, Any]:
    """llama.cpp's t(k) at ``context`` tokens of cache: blocks (a prompt pass of k tokens at that depth; one token:
    its generation pass) and batches (k sequences, one token each)."""
    common = ["-m", str(model), "-t", str(threads)]
    blocks = [k for k in ks if k > 1]
    bench = parse_llama_bench(
        _run(
            [str(tools["llama-bench"]), *common, "-d", str(context), "-r", "5", "-o", "json"]
            + (["-p", ",".join(map(str, blocks))] if blocks else ["-p", "0"])
            + ["-n", "16"]
        )
    )
    block = {k: bench[(k, 0)] for k in blocks}
    block[1] = bench[(0, 16)] / 16
    batched = parse_batched_bench(
        _run(
            [str(tools["llama-batched-bench"]), *common, "-c", str(max(ks) * (context + 40) + 256)]
            + ["-npp", str(context), "-ntg", "16", "-npl", ",".join(map(str, ks)), "--output-format", "jsonl"],
            stderr_too=True,  # its log lines, the JSON ones among them, reach either stream (seen: split between both)
        )
    )
    return {"block": dict(sorted(block.items())), "batch": batched}


def specdec_passes(path: Path, ks: list[int], context: int, rounds: int) -> dict[str, Any]:
    import torch

    from specdec import real_shapes as rs
    from specdec.runtime.native import NativeRunner

    runner = NativeRunner.from_pretrained(path, dtype=torch.bfloat16, kernel=True, max_context=context + max(ks) + 8)
    times = rs.pass_times(runner, ks, context=context, rounds=rounds)
    return {"block": times.block, "batch": times.batch}


def cmd_passes(args: argparse.Namespace, tools: dict[str, Path]) -> int:
    import torch

    from specdec.runtime import native_kernel as nk

    torch.set_num_threads(args.threads)
    if not nk.kernel_available():
        raise Failure(f"the CPU kernel is unavailable: {nk.kernel_status()}")
    ks = sorted(set(args.ks))
    shapes: dict[str, Any] = {}
    for shape in args.shapes:
        model = gguf(shape, args.llama_cpp, args.out)
        path = hf_dir(shape, args.out)
        runs: dict[str, list[dict[str, Any]]] = {"specdec": [], "llama.cpp": []}
        for r in range(args.rounds):  # the two take turns, the order swapped each round
            order = ["specdec", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "specdec"]
            for who in order:
                if who == "specdec":
                    runs[who].append(specdec_passes(path, ks, args.context, rounds=3))
                else:
                    runs[who].append(llama_cpp_passes(tools, model, ks, args.context, args.threads))
            print(f"  {shape}: round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        med = {
            who: {
                kind: {k: statistics.median(r[kind][k] for r in done) for k in ks if all(k in r[kind] for r in done)}
                for kind in ("block", "batch")
            }
            for who, done in runs.items()
        }
        shapes[shape] = {"gguf": str(model), "median_seconds": med, "rounds": runs}
    return _report(args, tools, shapes, render_passes)


def _report(
    args: argparse.Namespace,
    tools: dict[str, Path],
    shapes: dict[str, Any],
    render: Callable[[dict[str, Any]], str],
) -> int:
    """A part's report: the run's machine, versions and settings around ``shapes``; printed, and written to
    ``--json``."""
    from specdec import real_shapes as rs
    from specdec.runtime import native_kernel as nk

    report = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": rs.cpu_info(),
        "kernel": nk.kernel_status(),
        "llama_cpp": _llama_cpp_version(tools),
        "threads": args.threads,
        "context": args.context,
        "shapes": shapes,
    }
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


def _heading(report: dict[str, Any], what: str) -> str:
    return (
        f"{report['cpu'].get('model', '?')}, {report['threads']} threads, {report['context']} tokens of context; "
        f"specdec {report['kernel']}; llama.cpp {report['llama_cpp']}. {what}"
    )


def render_passes(report: dict[str, Any]) -> str:
    lines = [_heading(report, "Milliseconds per pass (medians over rounds).")]
    for shape, s in report["shapes"].items():
        med = s["median_seconds"]
        lines += [
            f"\n{shape}\n",
            "| rows k | block: specdec | block: llama.cpp* | llama.cpp ÷ specdec | batch: specdec | batch: llama.cpp |"
            " llama.cpp ÷ specdec |",
            "|---|---|---|---|---|---|---|",
        ]
        ks = sorted({int(k) for who in med.values() for kind in who.values() for k in kind})
        for k in ks:
            cells = []
            for kind in ("block", "batch"):
                mine, theirs = med["specdec"][kind].get(k), med["llama.cpp"][kind].get(k)
                cells += [_ms(mine), _ms(theirs), f"{theirs / mine:.2f}×" if mine and theirs else "–"]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append(
        "\n* llama.cpp's block is its prompt pass of k tokens at that depth (the output head on the last row only; a"
        " verify pass needs every row's), its 1-row figure its generation pass: a lower bound on its verify pass."
    )
    return "\n".join(lines)


def llama_cpp_one_row(tools: dict[str, Path], model: Path, context: int, threads: int) -> float:
    """llama.cpp's one-token pass at ``context`` tokens of cache (``llama-bench``: 16 generated tokens, twice)."""
    cmd = [str(tools["llama-bench"]), "-m", str(model), "-t", str(threads), "-d", str(context)]
    bench = parse_llama_bench(_run([*cmd, "-p", "0", "-n", "16", "-r", "2", "-o", "json"]))
    return bench[(0, 16)] / 16


STEADY = 1.15  # a pair's two bandwidth reads within this factor of each other: the memory held one state through it
TWO_STATES = 1.3  # the fastest read over the slowest at least this: two states seen, classed at the midpoint


def summarize_pairs(pairs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Medians of ``pairs`` (``read_before``/``read_after`` bytes/s, ``specdec``/``llama.cpp`` seconds) for all of
    them and per memory state: the pairs whose two reads agree (within ``STEADY``), classed ``fast`` or ``slow`` by
    the midpoint of every read where the reads span ``TWO_STATES`` or more (a pair whose reads lie either side of
    it is in neither), else ``steady``."""
    reads = [p[k] for p in pairs for k in ("read_before", "read_after")]
    groups: dict[str, list[dict[str, float]]] = {"all": list(pairs)}
    if reads:
        lo, hi = min(reads), max(reads)
        mid = (lo + hi) / 2
        for p in pairs:
            a, b = sorted((p["read_before"], p["read_after"]))
            if b > a * STEADY:
                continue
            state = "steady" if hi < lo * TWO_STATES else "fast" if a >= mid else "slow" if b <= mid else None
            if state is not None:
                groups.setdefault(state, []).append(p)
    out = {}
    for name, group in groups.items():
        if not group:
            continue
        ratios = [p["llama.cpp"] / p["specdec"] for p in group]
        out[name] = {
            "pairs": len(group),
            "specdec_seconds": statistics.median(p["specdec"] for p in group),
            "llama_cpp_seconds": statistics.median(p["llama.cpp"] for p in group),
            "llama_cpp_over_specdec": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "read_min": min(min(p["read_before"], p["read_after"]) for p in group),
            "read_max": max(max(p["read_before"], p["read_after"]) for p in group),
        }
    return out


def cmd_pairs(args: argparse.Namespace, tools: dict[str, Path]) -> int:
    import torch

    from specdec import real_shapes as rs
    from specdec.runtime import native_kernel as nk
    from specdec.runtime.native import NativeRunner

    torch.set_num_threads(args.threads)
    if not nk.kernel_available():
        raise Failure(f"the CPU kernel is unavailable: {nk.kernel_status()}")

    read = rs.read_probe(args.threads, mib=512, reps=3)  # its buffer allocated once (a fresh one slows what follows)

    shapes: dict[str, Any] = {}
    for shape in args.shapes:
        model = gguf(shape, args.llama_cpp, args.out)
        runner = NativeRunner.from_pretrained(
            hf_dir(shape, args.out), dtype=torch.bfloat16, kernel=True, max_context=args.context + 8
        )
        pairs: list[dict[str, float]] = []
        end = time.monotonic() + args.seconds
        while time.monotonic() < end or len(pairs) < 2:
            pair = {"read_before": read()}
            for who in ["specdec", "llama.cpp"][:: 1 if len(pairs) % 2 == 0 else -1]:  # who goes first alternates
                if who == "specdec":
                    one = rs.pass_times(runner, [1], context=args.context, batches=False, rounds=1, min_seconds=0.3)
                    pair[who] = one.block[1]
                else:
                    pair[who] = llama_cpp_one_row(tools, model, args.context, args.threads)
            pair["read_after"] = read()
            pairs.append(pair)
        del runner
        shapes[shape] = {"gguf": str(model), "summary": summarize_pairs(pairs), "pairs": pairs}
        print(f"  {shape}: {len(pairs)} pairs", file=sys.stderr, flush=True)
    return _report(args, tools, shapes, render_pairs)


def render_pairs(report: dict[str, Any]) -> str:
    lines = [_heading(report, "One-token passes in close pairs, medians.")]
    for shape, s in report["shapes"].items():
        lines += [
            f"\n{shape}\n",
            "| memory | pairs | read GB/s | specdec ms | llama.cpp ms | llama.cpp ÷ specdec (range) |",
            "|---|---|---|---|---|---|",
        ]
        for state, g in s["summary"].items():
            lines.append(
                f"| {state} | {g['pairs']} | {g['read_min'] / 1e9:.0f}-{g['read_max'] / 1e9:.0f} | "
                f"{_ms(g['specdec_seconds'])} | {_ms(g['llama_cpp_seconds'])} | "
                f"{g['llama_cpp_over_specdec']:.2f}× ({g['ratio_min']:.2f}-{g['ratio_max']:.2f}) |"
            )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.2f}" if seconds else "–"


def _llama_cpp_version(tools: dict[str, Path]) -> str:
    run = subprocess.run([str(tools["llama-server"]), "--version"], capture_output=True, text=True, timeout=60)
    text = (run.stdout + run.stderr).strip().splitlines()
    return next((line for line in text if line.startswith("version")), text[-1] if text else "?")


@contextlib.contextmanager
def llama_servers(
    tools: dict[str, Path], target: Path, draft: Path | None, slots: int, threads: int, draft_max: int
) -> Iterator[dict[str, str]]:
    """``llama-server`` on loopback (load_test's ``running_servers``): plain, and with ``draft`` a second one
    speculating with it; a server that will not start is a Failure with its last line of output."""
    from load_test import running_servers  # type: ignore[import-not-found]

    def server(extra: list[str]) -> Any:
        head = [str(tools["llama-server"]), "-m", str(target), "-t", str(threads), "-np", str(slots)]
        return lambda port: [*head, "-c", str(slots * 1024), "--host", "127.0.0.1", "--port", str(port), *extra]

    variants = [("llama.cpp", server([]))]
    if draft is not None:
        spec = ["-md", str(draft), "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0"]
        variants.append(("llama.cpp-spec", server(spec)))
    with tempfile.TemporaryDirectory(prefix="vs_llama_cpp_") as logs:
        try:
            with running_servers(variants, log_dir=logs) as urls:
                yield urls
        except RuntimeError as e:  # one that would not start (or a failure of the run inside): one line
            raise Failure(str(e)) from None


def cmd_serve(args: argparse.Namespace, tools: dict[str, Path]) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    import load_test  # type: ignore[import-not-found]

    target = gguf(args.target or "default", args.llama_cpp, args.out)
    draft = gguf(args.draft or "draft", args.llama_cpp, args.out) if args.spec else None
    rest = list(args.load_test_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if args.target or args.draft:  # specdec serve on the same checkpoints
        models = [x for flag, d in (("--target", args.target), ("--draft", args.draft)) if d for x in (flag, d)]
        rest += ["--serve-args", " ".join(shlex.quote(x) for x in models)]
    levels = load_test.parse_args(["--spawn", *rest]).concurrency
    with llama_servers(tools, target, draft, max(levels), args.threads, args.draft_max) as urls:
        others = [x for name, url in urls.items() for x in ("--other", f"{name}={url}")]
        # llama-server keeps each slot's prompt for the next request on it (a prefix cache specdec does not have):
        # off, so both do the same work per request.
        argv = ["--spawn", *others, "--other-body", json.dumps({"cache_prompt": False}), *rest]
        return int(load_test.main(argv))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree, built with CMake")
    p.add_argument("--bin", type=Path, default=None, help="its binaries' folder (default: TREE/build/bin)")
    p.add_argument("--out", type=Path, default=None, help="where GGUF files go (default: $SPECDEC_CACHE_DIR/llama_cpp)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both (default: every CPU)")
    sub = p.add_subparsers(dest="part", required=True)
    pp = sub.add_parser("passes", help="t(k) of blocks and batches, both runtimes, alternating")
    pp.add_argument("--shapes", nargs="+", default=["default", "qwen2.5-0.5b", "llama3.2-1b"])
    pp.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    pp.add_argument("--context", type=int, default=64)
    pp.add_argument("--rounds", type=int, default=2)
    pp.add_argument("--json", default=None, metavar="FILE")
    pr = sub.add_parser("pairs", help="one-token passes of both in close pairs, classed by the memory's state")
    pr.add_argument("--shapes", nargs="+", default=["llama3.2-1b"])
    pr.add_argument("--seconds", type=float, default=120.0, help="per shape (default 120; a pair takes a few)")
    pr.add_argument("--context", type=int, default=64)
    pr.add_argument("--json", default=None, metavar="FILE")
    ps = sub.add_parser("serve", help="llama-server beside specdec serve through load_test.py (args after --)")
    ps.add_argument("--spec", action="store_true", help="also llama-server speculating with the shipped draft")
    ps.add_argument("--draft-max", type=int, default=4, help="llama-server --spec-draft-n-max (default 4)")
    ps.add_argument("--target", default=None, metavar="DIR", help="a target checkpoint for both (default: shipped)")
    ps.add_argument("--draft", default=None, metavar="DIR", help="a draft checkpoint for both (default: shipped)")
    ps.add_argument("load_test_args", nargs=argparse.REMAINDER, help="-- then benchmarks/load_test.py arguments")
    args = p.parse_args(argv)
    if args.out is None:
        from specdec.runtime.native_kernel import cache_dir

        args.out = cache_dir("llama_cpp")
    if args.threads < 1:
        p.error("--threads must be positive")
    if args.part == "serve":
        for flag, where in (("--target", args.target), ("--draft", args.draft)):
            if where is not None and not (Path(where) / "config.json").is_file():
                p.error(f"{flag} {where}: not a checkpoint directory (no config.json)")
        if (args.target or args.draft) and "--serve-args" in args.load_test_args:
            p.error("--target/--draft set both servers' models: leave --serve-args out")
    if args.part in ("passes", "pairs"):
        from specdec import real_shapes as rs

        for shape in args.shapes:
            if shape != "default" and shape not in rs.SHAPES and not (Path(shape) / "config.json").is_file():
                p.error(f"unknown shape {shape!r}: default, {', '.join(rs.SHAPES)} or a checkpoint directory")
    if args.part == "passes" and (min(args.ks) < 1 or args.context < 1 or args.rounds < 1):
        p.error("--ks, --context and --rounds must be positive")
    if args.part == "pairs" and (args.seconds <= 0 or args.context < 1):
        p.error("--seconds and --context must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tools = find_tools(args.llama_cpp, args.bin)
        args.out.mkdir(parents=True, exist_ok=True)
        run = {"passes": cmd_passes, "pairs": cmd_pairs, "serve": cmd_serve}[args.part]
        return run(args, tools)
    except (Failure, OSError, subprocess.TimeoutExpired) as e:
        print(f"vs_llama_cpp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
