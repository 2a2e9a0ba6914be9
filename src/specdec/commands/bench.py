"""``specdec bench``: speculative vs target-only vs ``transformers`` on the same prompts, in one process."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from specdec.bench.prompts import FILE_HELP as PROMPT_FILE_HELP
from specdec.commands.common import ModelSettings, add_model_args
from specdec.draft_vocab import head_size
from specdec.draft_window import window_of
from specdec.runtime.native import kv_dtype_of

# --quick: a few prompts and τ values, one timed repeat; finishes in about two minutes on 2 cores.
QUICK: dict[str, Any] = {"n_prompts": 8, "taus": "2,3,4,6", "repeats": 1, "max_new_tokens": 128, "trace_prompts": 3}
FULL: dict[str, Any] = {"n_prompts": None, "taus": "1-8", "repeats": 3, "max_new_tokens": 128, "trace_prompts": 8}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark speculative decoding against target-only and transformers generate()",
        description="Time target-only, fixed-τ and policy decoding with specdec, and transformers generate() "
        "(plain, assisted by the draft, prompt lookup) on the same prompts, interleaved, greedy. "
        "With no model options the shipped default pair and held-out prompt set are used.",
    )
    add_model_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help=f"{PROMPT_FILE_HELP} (default: the shipped held-out code prompts)",
    )
    g.add_argument("--n-prompts", type=int, default=None, help="use only the first N prompts")
    g.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (default: 128)")
    g.add_argument("--taus", default=None, help="fixed τ values to time, e.g. 1-8 or 2,4,6 (default: 1-8)")
    g.add_argument(
        "--policies",
        default=None,
        help="policies to time, comma-separated, each a name or name:key=value,... "
        "(e.g. adaptive,adaptive:early_stop=false,heuristic; default: adaptive,heuristic; unknown names skipped)",
    )
    g.add_argument("--repeats", type=int, default=None, help="timed runs per contender and prompt (default: 3)")
    g.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK['n_prompts']} prompts, τ in {QUICK['taus']}, 1 repeat: about 2 minutes on 2 cores",
    )
    g.add_argument("--no-hf", action="store_true", help="skip the transformers generate() contenders")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="fixed-length outputs: EOS does not end a request, every contender generates exactly --max-new-tokens",
    )
    g.add_argument(
        "--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for transformers (default 10)"
    )
    g.add_argument(
        "--trace-prompts",
        type=int,
        default=None,
        help="prompts for the JsonlTrace overhead check at the best τ (0 skips it)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the full report as JSON")
    o.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="plot tokens/s and speedup vs τ")
    o.add_argument(
        "--markdown", type=Path, default=None, metavar="FILE.md", help="write the table and goals as Markdown"
    )
    p.set_defaults(func=run)


def _config(args: argparse.Namespace) -> Any:
    from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts, parse_taus
    from specdec.bench.run import DEFAULT_POLICIES, BenchConfig
    from specdec.errors import InvalidRequestError
    from specdec.policy import split_policy_specs

    mode = QUICK if args.quick else FULL
    prompts = load_prompts(args.prompts or DEFAULT_PROMPTS)
    n = args.n_prompts if args.n_prompts is not None else mode["n_prompts"]
    if n is not None:
        if n <= 0:
            raise InvalidRequestError(f"--n-prompts must be >= 1, got {n}", "n_prompts")
        prompts = prompts[:n]
    max_new = args.max_new_tokens if args.max_new_tokens is not None else mode["max_new_tokens"]
    repeats = args.repeats if args.repeats is not None else mode["repeats"]
    for name, value in (("--max-new-tokens", max_new), ("--repeats", repeats), ("--lookup-tokens", args.lookup_tokens)):
        if value <= 0:
            raise InvalidRequestError(f"{name} must be >= 1, got {value}", name)
    policies = split_policy_specs(args.policies) if args.policies is not None else list(DEFAULT_POLICIES)
    trace_prompts = args.trace_prompts if args.trace_prompts is not None else mode["trace_prompts"]
    return BenchConfig(
        prompts=prompts,
        max_new_tokens=max_new,
        taus=parse_taus(args.taus or mode["taus"]),
        policies=policies,
        repeats=repeats,
        hf=not args.no_hf,
        lookup_tokens=args.lookup_tokens,
        trace_prompts=max(0, trace_prompts),
        quick=args.quick,
        ignore_eos=args.ignore_eos,
    )


def load_models(settings: ModelSettings, with_hf: bool) -> Any:
    """Our engine (plus a target-only engine sharing its target) and transformers copies of the same checkpoints."""
    from specdec.api import default_draft, default_target, vocab_difference
    from specdec.bench.contenders import HFModels
    from specdec.bench.run import BenchModels
    from specdec.drafters.bridge import BridgedDrafter
    from specdec.drafters.model import ModelDrafter
    from specdec.engine import Engine
    from specdec.policy import FixedPolicy
    from specdec.runtime import resolve_dtype
    from specdec.runtime.native_kernel import kernel_status

    spec = settings.load()
    target_only = Engine(spec.target, spec.tokenizer, None, FixedPolicy(0), max_context=spec.max_context)
    target_dir = settings.target or default_target()
    draft_dir = settings.draft
    if draft_dir is None and settings.target is None and not (settings.prompt_lookup or settings.no_draft):
        draft_dir = default_draft()
    if settings.no_draft:
        draft_dir = None
    drafter = spec.drafter
    draft_runner = drafter.runner if isinstance(drafter, (ModelDrafter, BridgedDrafter)) else None
    # A bridged pair: transformers' assisted generation takes both tokenizers (universal assisted decoding).
    # (Not for a pair bridged on request that shares one tokenizer: that is plain assisted generation.)
    tokenizers = (
        (spec.tokenizer, drafter.draft_tokenizer)
        if isinstance(drafter, BridgedDrafter) and vocab_difference(spec.tokenizer, drafter.draft_tokenizer)
        else None
    )
    hf = None
    # transformers runs in the dtype a user of it would pick here: the forced one, else its own "auto"
    # (fp32 on CPUs without native bf16, where its bf16 products are several times slower).
    hf_dtype = resolve_dtype(settings.dtype, spec.target.device, "hf")
    # (An int8 draft runs only on the CPU kernel: the transformers contender keeps its own dtype for the draft.)
    int8_draft = settings.draft_dtype == "int8"
    hf_draft_dtype = (
        resolve_dtype(settings.draft_dtype, spec.target.device, "hf")
        if settings.draft_dtype and not int8_draft
        else hf_dtype
    )
    if with_hf:
        hf = HFModels.load(
            str(target_dir),
            str(draft_dir) if draft_runner is not None and draft_dir else None,
            hf_dtype,
            hf_draft_dtype,
            spec.target.device,
            tokenizers=tokenizers,
        )
    info = {
        "target": str(target_dir),
        "draft": str(draft_dir) if draft_runner is not None else None,
        "drafter": drafter.name if drafter is not None else None,
        "target_runtime": type(spec.target).__name__,
        "draft_runtime": type(draft_runner).__name__ if draft_runner else None,
        "dtype": str(spec.target.dtype).removeprefix("torch."),
        "draft_dtype": str(draft_runner.dtype).removeprefix("torch.") if draft_runner else None,
        "hf_dtype": str(hf_dtype).removeprefix("torch.") if with_hf else None,
        "hf_draft_dtype": str(hf_draft_dtype).removeprefix("torch.") if with_hf and draft_runner else None,
        "device": str(spec.target.device),
        # native runtime: "cpu-kernel" (the one-call C++ kernel) or "torch-<products>"; why the kernel is off.
        "target_backend": getattr(spec.target, "backend", None),
        "draft_backend": getattr(draft_runner, "backend", None),
        # the tokens the draft's output head computes (draft_vocab): a number, or "full"
        "draft_head": head_size(draft_runner),
        # the latest tokens the draft attends to (draft_window): a number, or "full"
        "draft_window": window_of(draft_runner),
        # the KV caches' element type on the CPU kernel (kv_dtype), target and draft; None elsewhere
        "kv_dtype": kv_dtype_of(spec.target),
        "draft_kv_dtype": kv_dtype_of(draft_runner),
        "cpu_kernel": kernel_status(),
    }
    return BenchModels(spec=spec if drafter is not None else None, target_only=target_only, hf=hf, info=info)


def machine() -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def run(args: argparse.Namespace) -> int:
    from specdec.bench.report import markdown, plot, summary, table
    from specdec.bench.run import run_bench
    from specdec.errors import SpecdecError
    from specdec.runtime.heap import frozen_heap

    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SpecdecError(
                "--plot needs matplotlib: pip install matplotlib (or pip install 'specdec[bench]')"
            ) from None
    cfg = _config(args)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import time

    t0 = time.perf_counter()
    log("loading models ...")
    models = load_models(ModelSettings.from_args(args), with_hf=cfg.hf)
    with frozen_heap():  # no collector pause of ~100 ms inside a timed run (``specdec.runtime.heap``)
        report = run_bench(models, cfg, log)
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)  # loading included
    report["machine"] = machine()
    report["command"] = "specdec " + " ".join(sys.argv[1:])
    report["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(table(report))
    print()
    print(summary(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {args.json}")
    if args.markdown is not None:
        args.markdown.write_text(markdown(report) + "\n")
        log(f"wrote {args.markdown}")
    if args.plot is not None:
        plot(report, args.plot)
        log(f"wrote {args.plot}")
    return 0
