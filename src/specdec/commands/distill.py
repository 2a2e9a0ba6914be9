"""``specdec distill --target DIR --out DIR``: train a draft model for any target checkpoint."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from specdec.training.distill import DRAFT_PRESETS, DistillConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "distill",
        help="train a draft model for a target by distillation",
        description="Train a small Llama draft for TARGET: loss = w·KL(target ‖ draft) + (1−w)·CE on text files, or "
        "KL on text sampled from the target. Writes a Hugging Face checkpoint with the target's tokenizer "
        "and prints the greedy acceptance rate α against the target on held-out prompts. Rerunning the "
        "same command resumes an interrupted run.",
    )
    p.add_argument("--target", type=Path, required=True, help="target checkpoint directory (any causal LM)")
    p.add_argument("--out", type=Path, required=True, help="output directory for the draft checkpoint")
    p.add_argument("--work", type=Path, default=None, help="where resumable state goes (default: --out)")
    p.add_argument(
        "--draft-config",
        default="small",
        help=f"{' | '.join(DRAFT_PRESETS)} | a JSON object or file of Llama shape keys (default: small)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--data",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="text files or directories (or .npy token streams); ~5%% of files are held out",
    )
    src.add_argument("--from-target", action="store_true", help="train on sequences sampled from the target")
    p.add_argument(
        "--on-policy",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="with --data: the target greedily continues this share of each batch's windows (after their first "
        "quarter), so the draft learns on the contexts greedy speculation tests it on (default 0; the shipped draft "
        "used 0.6; costs one batched target pass per generated token)",
    )
    p.add_argument(
        "--val-data",
        type=Path,
        nargs="+",
        default=[],
        metavar="FILE",
        help="held-out files for evaluation and α prompts (default: split from --data)",
    )
    p.add_argument("--glob", default="*", help="file pattern when --data names a directory (default: *)")
    defaults = DistillConfig()
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=defaults.steps, help=f"optimizer steps (default: {defaults.steps})")
    t.add_argument("--minutes", type=float, default=None, help="stop (resumably) after this many minutes")
    t.add_argument(
        "--kl-weight",
        type=float,
        default=defaults.kl_weight,
        help="w in w·KL + (1−w)·CE (default: 1, pure distillation)",
    )
    t.add_argument("--seq-len", type=int, default=defaults.seq_len, help=f"tokens per window ({defaults.seq_len})")
    t.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help=f"windows per step ({defaults.batch_size})"
    )
    t.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate ({defaults.lr})")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads (default: all cores)")
    t.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    e = p.add_argument_group("closing measurement")
    e.add_argument("--prompts", type=int, default=16, help="held-out prompts for measuring α (0 skips it)")
    e.add_argument("--eval-tokens", type=int, default=64, help="new tokens per prompt when measuring α")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdec.errors import InvalidRequestError
    from specdec.runtime import resolve_device
    from specdec.training.distill_run import DistillJob
    from specdec.training.distill_run import run as run_job

    if args.minutes is not None and args.minutes <= 0:
        raise InvalidRequestError(f"--minutes must be positive, got {args.minutes}", "minutes")
    if args.prompts < 0 or args.eval_tokens < 1:
        raise InvalidRequestError("--prompts must be >= 0 and --eval-tokens >= 1", "prompts")
    resolve_device(args.device)  # a clear error for an unknown or unavailable device
    config = DistillConfig(
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        min_lr=args.lr / 10,
        kl_weight=args.kl_weight,
        seed=args.seed,
        threads=args.threads,
    )
    job = DistillJob(
        target=args.target,
        out=args.out,
        work=args.work,
        draft_config=args.draft_config,
        data=list(args.data or []),
        val_data=list(args.val_data),
        from_target=args.from_target,
        on_policy=args.on_policy,
        glob=args.glob,
        config=config,
        minutes=args.minutes,
        device=args.device,
        prompts=args.prompts,
        eval_tokens=args.eval_tokens,
    )
    run_job(job, report=lambda line: print(line, flush=True))
    return 0
