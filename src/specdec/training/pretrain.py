"""Next-token pretraining of a small Llama on a token stream, resumable from disk.

Checkpoints (model, optimizer, step, RNG) are written atomically every
``ckpt_every`` steps; rerunning the same command continues where it stopped.
Progress goes to ``log.jsonl`` in the run directory, one object per log event.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class TrainConfig:
    seq_len: int = 512
    batch_size: int = 8
    max_steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 48
    ckpt_every: int = 50
    threads: int = 2


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def eval_windows(stream: np.ndarray, seq_len: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced windows of ``seq_len + 1`` tokens: a fixed validation set."""
    starts = np.linspace(0, len(stream) - seq_len - 2, n).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def lm_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    # windows: [B, T+1]; predict tokens 1..T from 0..T-1 (we shift here, not via labels=).
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, batch: int = 8) -> float:
    model.eval()
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(0, len(val), batch):
            losses.append(lm_loss(model, val[i : i + batch]).item())
    model.train()
    return float(np.mean(losses))


def _atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(
    model: torch.nn.Module,
    train_stream: np.ndarray,
    val_stream: np.ndarray,
    run_dir: Path,
    cfg: TrainConfig,
    deadline: float | None = None,
) -> None:
    """Train ``model`` in place until ``max_steps`` or ``deadline`` (epoch seconds)."""
    torch.set_num_threads(cfg.threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "ckpt.pt"
    log = (run_dir / "log.jsonl").open("a")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    step, tokens, elapsed = 0, 0, 0.0
    gen = torch.Generator().manual_seed(cfg.seed)
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, tokens, elapsed = state["step"], state["tokens"], state["elapsed"]
        gen.set_state(state["rng"])
        print(f"resumed at step {step} ({tokens} tokens, {elapsed / 60:.1f} min)", flush=True)
    else:
        log.write(json.dumps({"event": "start", "config": asdict(cfg)}) + "\n")
    val = eval_windows(val_stream, cfg.seq_len, cfg.eval_windows)
    n_windows = len(train_stream) - cfg.seq_len - 1
    stream = torch.from_numpy(train_stream.astype(np.int64))

    def checkpoint() -> None:
        _atomic_save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "tokens": tokens,
                "elapsed": elapsed,
                "rng": gen.get_state(),
            },
            ckpt_path,
        )

    model.train()
    t_last = time.time()
    while step < cfg.max_steps:
        if deadline is not None and time.time() > deadline:
            print("deadline reached", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        starts = torch.randint(0, n_windows, (cfg.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens += batch.numel() - cfg.batch_size
        now = time.time()
        elapsed += now - t_last
        t_last = now
        record: dict[str, float | int | str] = {
            "event": "step",
            "step": step,
            "tokens": tokens,
            "elapsed_s": round(elapsed, 1),
            "loss": round(loss.item(), 4),
            "lr": lr_at(step - 1, cfg),
        }
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            record["val_loss"] = round(evaluate(model, val), 4)
            t_last = time.time()  # evaluation time is not training time
        if step % 10 == 0 or "val_loss" in record:
            log.write(json.dumps(record) + "\n")
            log.flush()
            rate = tokens / max(elapsed, 1e-9)
            eta = (cfg.max_steps - step) * (elapsed / step) / 60
            extra = f" val {record['val_loss']:.3f}" if "val_loss" in record else ""
            print(
                f"step {step}/{cfg.max_steps} loss {loss.item():.3f}{extra} {rate:.0f} tok/s eta {eta:.0f} min",
                flush=True,
            )
        if step % cfg.ckpt_every == 0:
            checkpoint()
    checkpoint()
    log.close()
