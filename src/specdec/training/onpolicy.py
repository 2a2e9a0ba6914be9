"""Distil drafts from target-generated continuations (on-policy data), several shapes at once.

Greedy speculative decoding only ever asks the draft to predict the *target's own* continuation of a
prompt, so a draft that learned from corpus text alone is tested on text it never saw. This stage
(sequence-level plus token-level distillation) first lets the target continue random windows of the
training split, greedily and at temperature 1, then trains drafts on a mix of those continuations
and plain corpus windows with loss ``w · KL(p_target ‖ p_draft) + (1 − w) · CE`` at every position.
All drafts see the same batches and share one target pass per batch, and a corpus-only
cross-entropy draft of the shipped shape is trained beside them on the same number of tokens, as the
comparison the report needs.

Written for a GPU (``--device cuda``) but runs anywhere; on 2 CPU cores use tiny settings only.
Reproduce the shipped draft (``default_pair --stages draft`` runs exactly this)::

    python -m specdec.training.onpolicy --work runs/onpolicy --device cuda --steps 1919 --pool-rows 6144 \
        --pool-seconds 1e9 --minutes 1e9 --drafts d256x2,d256x2_ce,d256x3,d256x1

Outputs ``WORK/<name>/`` (a Hugging Face checkpoint per draft: bf16 safetensors, config,
generation config, tokenizer, ``specdec_training.json``) and ``WORK/onpolicy.json`` (settings,
timings, and per-draft validation and emulated acceptance figures).
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PACKAGE_MODELS = Path(__file__).resolve().parent.parent / "models"

# name -> (shape, mode): mode "kl" trains on the mixed batch against the target; "ce" on corpus only.
DRAFTS: dict[str, tuple[dict[str, int], str]] = {
    "d256x1": (dict(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4), "kl"),
    "d256x1_ce": (dict(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4), "ce"),
    "d256x2_ce": (dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4), "ce"),
    "d256x3": (dict(hidden_size=256, intermediate_size=768, num_hidden_layers=3, num_attention_heads=4), "kl"),
    "d384x1": (dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=1, num_attention_heads=6), "kl"),
    "d256x2": (dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4), "kl"),
    "d512x1": (dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=8), "kl"),
}


@dataclass
class Settings:
    steps: int = 3000  # 0: fit the step count to --minutes after timing the first steps
    minutes: float = 5.0
    batch_size: int = 128
    seq_len: int = 256
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    kl_weight: float = 0.9
    onpolicy_share: float = 0.6  # of each batch's rows: target continuations; the rest corpus windows
    greedy_share: float = 0.67  # of the continuations: greedy; the rest sampled at temperature 1
    pool_rows: int = 24576
    prompt_lens: tuple[int, ...] = (16, 32, 64, 96, 128)
    gen_batch: int = 1024
    eval_prompts: int = 128
    eval_new_tokens: int = 64
    eval_prompt_len: int = 64
    tau: int = 4
    seed: int = 0


def load_stream(path: Path) -> np.ndarray:
    if path.suffix == ".xz":
        with lzma.open(path) as f:
            return np.load(f)
    return np.load(path)


def prepare_streams(out_dir: Path, tokenizer_dir: Path = PACKAGE_MODELS / "target") -> None:
    """Encode the stdlib train/validation split with the shipped tokenizer as xz-compressed ``.npy``.

    The streams are small enough to carry to a GPU machine whose Python has another standard library.
    """
    from specdec.training import corpus

    split = corpus.split_sources()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, files in (("train", split.train), ("val", split.validation)):
        stream = corpus.encode_files(tokenizer_dir, split, files)
        with lzma.open(out_dir / f"{name}.npy.xz", "wb", preset=6) as f:
            np.save(f, stream)
        print(f"{name}: {len(files)} files, {len(stream):,} tokens -> {out_dir / f'{name}.npy.xz'}", flush=True)


def lr_at(step: int, total: int, s: Settings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


def windows(stream: np.ndarray, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length - 1, (n,), generator=gen).tolist()
    return torch.from_numpy(np.stack([stream[s : s + length].astype(np.int64) for s in starts]))


@torch.no_grad()
def continue_rows(
    target: Any, prompts: torch.Tensor, total_len: int, temperature: float, gen: torch.Generator, device: str
) -> torch.Tensor:
    """Let the target continue each prompt row to ``total_len`` tokens (greedy when temperature is 0).

    Recomputes the whole prefix each step instead of growing a dynamic KV cache: on a GPU, for short
    rows and large batches, that is faster and its cost is predictable. ``gen`` lives on ``device``.
    """
    ids = prompts.to(device)
    dev_type = torch.device(device).type
    while ids.shape[1] < total_len:
        with torch.autocast(device_type=dev_type, dtype=torch.bfloat16):
            logits = target(input_ids=ids, logits_to_keep=1).logits[:, -1].float()  # [B, V]
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
    return ids.cpu()


def build_pool(
    target: Any,
    stream: np.ndarray,
    s: Settings,
    gen: torch.Generator,
    dgen: torch.Generator,
    device: str,
    seconds: float,
) -> torch.Tensor:
    """``[rows, seq_len + 1]`` target continuations of training-split windows, within ``seconds``."""
    chunks, made, t0 = [], 0, time.time()
    while made < s.pool_rows and time.time() - t0 < seconds:
        b = min(s.gen_batch, s.pool_rows - made)
        plen = min(s.prompt_lens[(made // s.gen_batch) % len(s.prompt_lens)], s.seq_len // 2)
        temp = 0.0 if (made // s.gen_batch) % 3 != 2 else 1.0  # two greedy chunks, then one sampled
        chunks.append(continue_rows(target, windows(stream, b, plen, gen), s.seq_len + 1, temp, dgen, device))
        made += b
        print(f"pool: {made} rows ({time.time() - t0:.1f}s)", flush=True)
    pool = torch.cat(chunks)
    return pool[torch.randperm(len(pool), generator=gen)]


def make_draft(shape: dict[str, int], target_config: Any, device: str) -> Any:
    """A Llama draft of ``shape`` (no GQA) with the target's vocabulary and special ids."""
    from transformers import LlamaForCausalLM

    from specdec.training.distill import draft_config

    full = {**shape, "num_key_value_heads": shape["num_attention_heads"]}
    return LlamaForCausalLM(draft_config(target_config, full, max_positions=1024)).to(device)


def greedy_alpha_from_matches(matches: torch.Tensor, tau: int) -> dict[str, float]:
    """Replay greedy speculation over per-position draft/target agreement (``[N, T]`` bools).

    In greedy mode the draft's j-th proposal in a step is its argmax after the verified prefix plus
    the j − 1 accepted proposals, which equal the target's own tokens; so teacher-forced agreement
    along the target's greedy continuation decides every step exactly.
    """
    accepted = drafted = steps = rejections = 0
    for row in matches.tolist():
        pos, n = 0, len(row)
        while pos < n:
            t = min(tau, n - pos)
            k = 0
            while k < t and row[pos + k]:
                k += 1
            accepted, drafted, steps = accepted + k, drafted + t, steps + 1
            rejections += k < t
            pos += k + 1
    return {
        "alpha": round(accepted / max(drafted, 1), 4),
        "per_token_acceptance": round(accepted / max(accepted + rejections, 1), 4),
        "mean_accepted_length": round(matches.numel() / max(steps, 1), 4),
    }


@torch.no_grad()
def emulate_acceptance(drafts: dict[str, Any], target: Any, prompts: torch.Tensor, s: Settings, device: str) -> dict:
    """Greedy α (τ = s.tau) by replay, and mean per-token acceptance Σ min(p, q) at temperature 1."""
    gen = torch.Generator(device=device).manual_seed(1234)
    total = s.eval_prompt_len + s.eval_new_tokens
    greedy = continue_rows(target, prompts, total, 0.0, gen, device).to(device)
    sampled = continue_rows(target, prompts, total, 1.0, gen, device).to(device)
    p0 = s.eval_prompt_len
    t_sampled = torch.softmax(target(input_ids=sampled[:, :-1]).logits[:, p0 - 1 :].float(), -1)
    out = {}
    for name, d in drafts.items():
        d.eval()
        dg = d(input_ids=greedy[:, :-1]).logits[:, p0 - 1 :]
        matches = (dg.argmax(-1) == greedy[:, p0:]).cpu()
        ds = torch.softmax(d(input_ids=sampled[:, :-1]).logits[:, p0 - 1 :].float(), -1)
        beta = torch.minimum(ds, t_sampled).sum(-1).mean().item()
        out[name] = {**greedy_alpha_from_matches(matches, s.tau), "t1_per_token_acceptance": round(beta, 4)}
        d.train()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.training.distill import evaluate, export, export_meta, losses

    s = Settings(
        steps=args.steps,
        minutes=args.minutes,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        pool_rows=args.pool_rows,
        gen_batch=args.gen_batch,
        eval_prompts=args.eval_prompts,
        seed=args.seed,
    )
    device, work = args.device, args.work
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    t_start = time.time()
    train_stream, val_stream = load_stream(args.train), load_stream(args.val)
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.bfloat16).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    for p in target.parameters():
        p.requires_grad_(False)
    names = args.drafts.split(",")
    drafts = {n: make_draft(DRAFTS[n][0], target.config, device) for n in names}
    opts = {
        n: torch.optim.AdamW(
            [
                {"params": [p for p in d.parameters() if p.dim() >= 2], "weight_decay": s.weight_decay},
                {"params": [p for p in d.parameters() if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=s.lr,
            betas=(0.9, 0.95),
            fused=device == "cuda",
        )
        for n, d in drafts.items()
    }
    t0 = time.time()
    dgen = torch.Generator(device=device).manual_seed(s.seed)
    pool = build_pool(target, train_stream, s, gen, dgen, device, args.pool_seconds)
    pool_s, pool_rows = time.time() - t0, len(pool)
    print(f"pool: {tuple(pool.shape)} continuations in {pool_s:.1f}s", flush=True)
    val = windows(val_stream, 128, s.seq_len + 1, torch.Generator().manual_seed(99))
    eval_prompts = windows(val_stream, s.eval_prompts, s.eval_prompt_len, torch.Generator().manual_seed(7))
    log = (work / "log.jsonl").open("w")
    n_on = int(s.batch_size * s.onpolicy_share)
    total = s.steps if s.steps > 0 else 10**9
    t_train, step, pool_pos = time.time(), 0, 0
    deadline = t_train + 60 * s.minutes
    dev_type = torch.device(device).type
    while step < total and time.time() < deadline:
        if pool_pos + n_on > len(pool):
            pool = pool[torch.randperm(len(pool), generator=gen)]
            pool_pos = 0
        mixed = torch.cat(
            [pool[pool_pos : pool_pos + n_on], windows(train_stream, s.batch_size - n_on, s.seq_len + 1, gen)]
        ).to(device)
        pool_pos += n_on
        corpus = windows(train_stream, s.batch_size, s.seq_len + 1, gen).to(device)
        with torch.no_grad(), torch.autocast(device_type=dev_type, dtype=torch.bfloat16):
            tl = target(input_ids=mixed[:, :-1]).logits
        rec: dict[str, Any] = {"step": step + 1}
        for n, d in drafts.items():
            batch, teacher = (mixed, tl) if DRAFTS[n][1] == "kl" else (corpus, None)
            for g in opts[n].param_groups:
                g["lr"] = lr_at(step, total, s)
            with torch.autocast(device_type=dev_type, dtype=torch.bfloat16):
                dl = d(input_ids=batch[:, :-1]).logits
            parts = losses(dl, teacher, batch[:, 1:], s.kl_weight)
            opts[n].zero_grad(set_to_none=True)
            parts["loss"].backward()
            torch.nn.utils.clip_grad_norm_(d.parameters(), s.grad_clip)
            opts[n].step()
            if (step + 1) % 100 == 0:
                rec[n] = {k: round(v.item(), 4) for k, v in parts.items()}
        step += 1
        if s.steps == 0 and step == 30:  # fit the schedule to the time budget
            per = (time.time() - t_train) / 30
            total = max(60, int(60 * s.minutes / per * 0.97))
            print(f"timing: {per * 1000:.0f} ms/step -> {total} steps", flush=True)
        if step % 100 == 0:
            rec["elapsed_s"] = round(time.time() - t_train, 1)
            if step % 500 == 0:
                rec["val"] = {n: evaluate(d, target, val, batch=32) for n, d in drafts.items()}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
    train_s = time.time() - t_train
    for n, d in drafts.items():  # exported now, so an interrupted evaluation loses nothing
        export(d, tokenizer, args.target, work / n, {"steps": step, "note": "figures follow in onpolicy.json"})
    final_val = {n: evaluate(d, target, val, batch=32) for n, d in drafts.items()}
    compare = {
        f"compare:{path.name}": AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
        for path in args.compare
    }
    acceptance = emulate_acceptance({**drafts, **compare}, target, eval_prompts, s, device)
    tokens = step * s.batch_size * s.seq_len
    summary = {
        "settings": asdict(s),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or device,
        "torch": torch.__version__,
        "steps": step,
        "planned_steps": total,
        "tokens_per_draft": tokens,
        "pool_rows": pool_rows,
        "pool_seconds": round(pool_s, 1),
        "train_seconds": round(train_s, 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "validation": final_val,
        "emulated_acceptance": acceptance,
    }
    for n, d in drafts.items():
        shape, mode = DRAFTS[n]
        meta = {
            "role": "draft (on-policy distillation)" if mode == "kl" else "draft (corpus cross-entropy only)",
            "command": f"python -m specdec.training.onpolicy --device {device} --steps {step} "
            f"--pool-rows {pool_rows} --pool-seconds 1e9 --minutes 1e9 --drafts {args.drafts}",
            "method": "KL(target || draft) + CE on target continuations and corpus windows"
            if mode == "kl"
            else "cross-entropy on corpus windows only",
            "shape": shape,
            "parameters": sum(p.numel() for p in d.parameters()),
            **{k: summary[k] for k in ("settings", "device", "torch", "steps", "tokens_per_draft", "train_seconds")},
            "validation": final_val[n],
            "emulated_acceptance": acceptance[n],
        }
        export_meta(work / n, meta)
    (work / "onpolicy.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"validation": final_val, "emulated_acceptance": acceptance}, indent=1), flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/onpolicy"))
    ap.add_argument("--target", type=Path, default=PACKAGE_MODELS / "target")
    ap.add_argument("--train", type=Path, default=Path("runs/default/train.npy"))
    ap.add_argument("--val", type=Path, default=Path("runs/default/val.npy"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--drafts", default=",".join(DRAFTS))
    ap.add_argument("--steps", type=int, default=3000, help="0: fit to --minutes")
    ap.add_argument("--minutes", type=float, default=5.0, help="stop training after this long regardless")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--pool-rows", type=int, default=24576)
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--pool-seconds", type=float, default=90.0, help="time cap for generating continuations")
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", type=Path, nargs="*", default=[], help="existing drafts to measure beside")
    ap.add_argument(
        "--prepare-data",
        type=Path,
        default=None,
        metavar="DIR",
        help="only encode the stdlib split into DIR/{train,val}.npy.xz and exit",
    )
    args = ap.parse_args(argv)
    if args.prepare_data is not None:
        prepare_streams(args.prepare_data)
        return 0
    unknown = [n for n in args.drafts.split(",") if n not in DRAFTS]
    if unknown:
        ap.error(f"unknown draft names {unknown}; known: {', '.join(DRAFTS)}")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
