"""Distil a small Llama draft from any causal-LM target.

Loss per position: ``w · KL(p_target ‖ p_draft) + (1 − w) · CE(draft, next token)``. The target
runs in bf16 autocast without gradients; its full next-token distributions are the soft labels, so
the draft learns where the target puts its mass (what speculative acceptance rewards), not only
the corpus's next token. State is checkpointed atomically to the work directory; rerunning the
same settings continues where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.errors import InvalidRequestError
from specdec.training.distill_data import TokenSource

DRAFT_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    ),
    "small": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4
    ),
}
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
STATE_FILE, LOG_FILE, SETTINGS_FILE = "distill_state.pt", "distill_log.jsonl", "distill_settings.json"


@dataclass
class DistillConfig:
    steps: int = 1000
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    kl_weight: float = 1.0  # 1 = pure KL from the target, 0 = corpus cross-entropy only
    seed: int = 0
    threads: int = 2
    eval_every: int = 100
    eval_windows: int = 16
    ckpt_every: int = 50
    log_every: int = 10

    def check(self) -> None:
        if not 0.0 <= self.kl_weight <= 1.0:
            raise InvalidRequestError(f"--kl-weight must be in [0, 1], got {self.kl_weight}", "kl_weight")
        for name in ("steps", "seq_len", "batch_size", "threads"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(
                    f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}", name
                )
        if not self.lr > 0:
            raise InvalidRequestError(f"learning rate must be positive, got {self.lr}", "lr")

    def resume_key(self) -> dict[str, Any]:
        """Settings a resumed run must share with the run that wrote the state (not its length or threads)."""
        d = asdict(self)
        for k in ("steps", "threads", "eval_every", "ckpt_every", "log_every"):
            d.pop(k)
        return d


def draft_shape(spec: str) -> dict[str, int]:
    """A preset name, a JSON object, or a JSON file; JSON keys override the ``small`` preset."""
    if spec in DRAFT_PRESETS:
        return dict(DRAFT_PRESETS[spec])
    text = spec
    if not spec.lstrip().startswith("{"):
        if not Path(spec).is_file():
            raise InvalidRequestError(
                f"--draft-config must be {', '.join(DRAFT_PRESETS)}, a JSON object or a JSON file; got {spec!r}",
                "draft_config",
            )
        text = Path(spec).read_text()
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"--draft-config is not valid JSON: {e}", "draft_config") from None
    if not isinstance(given, dict):
        raise InvalidRequestError("--draft-config JSON must be an object", "draft_config")
    unknown = sorted(set(given) - set(SHAPE_KEYS))
    if unknown:
        raise InvalidRequestError(
            f"--draft-config has unknown keys {unknown}; allowed: {list(SHAPE_KEYS)}", "draft_config"
        )
    shape = {**DRAFT_PRESETS["small"], **given}
    for k, v in shape.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidRequestError(f"--draft-config {k} must be a positive integer, got {v!r}", "draft_config")
    if (
        shape["hidden_size"] % shape["num_attention_heads"]
        or shape["num_attention_heads"] % shape["num_key_value_heads"]
    ):
        raise InvalidRequestError(
            "--draft-config: hidden_size must divide by num_attention_heads, and "
            "num_attention_heads by num_key_value_heads",
            "draft_config",
        )
    return shape


def draft_config(target_config: Any, shape: dict[str, int], max_positions: int) -> Any:
    """A Llama config with the target's vocabulary size and special ids."""
    from transformers import LlamaConfig

    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    eos = getattr(tc, "eos_token_id", None)
    return LlamaConfig(
        vocab_size=int(tc.vocab_size),
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=eos,
        pad_token_id=getattr(tc, "pad_token_id", None),
        **shape,
    )


def lr_at(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def losses(
    draft_logits: torch.Tensor, target_logits: torch.Tensor | None, labels: torch.Tensor, kl_weight: float
) -> dict[str, torch.Tensor]:
    """``loss``, ``ce`` and (with a target) ``kl`` in nats per position; logits ``[B, T, V]``, labels ``[B, T]``."""
    logq = F.log_softmax(draft_logits.float(), dim=-1)  # [B, T, V]
    ce = F.nll_loss(logq.flatten(0, 1), labels.flatten())
    if target_logits is None:
        return {"loss": ce, "ce": ce}
    logp = F.log_softmax(target_logits.float()[..., : logq.shape[-1]], dim=-1)  # [B, T, V]
    kl = F.kl_div(logq.flatten(0, 1), logp.flatten(0, 1), log_target=True, reduction="batchmean")
    return {"loss": kl_weight * kl + (1 - kl_weight) * ce, "ce": ce, "kl": kl}


def target_logits(target: torch.nn.Module | None, ids: torch.Tensor) -> torch.Tensor | None:
    if target is None:
        return None
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16):
        return target(input_ids=ids).logits


@torch.no_grad()
def evaluate(
    draft: torch.nn.Module, target: torch.nn.Module | None, windows: torch.Tensor, batch: int = 4
) -> dict[str, float]:
    """Mean ``ce``, and with a target ``kl`` and ``agree`` (draft argmax == target argmax) on fixed windows."""
    draft.eval()
    sums: dict[str, float] = {}
    n = 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch].to(next(draft.parameters()).device)
        with torch.autocast(w.device.type, dtype=torch.bfloat16):
            dl = draft(input_ids=w[:, :-1]).logits
        tl = target_logits(target, w[:, :-1])
        parts = {k: v.item() for k, v in losses(dl, tl, w[:, 1:], 1.0).items() if k != "loss"}
        if tl is not None:
            parts["agree"] = (dl.argmax(-1) == tl[..., : dl.shape[-1]].argmax(-1)).float().mean().item()
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + v * len(w)
        n += len(w)
    draft.train()
    return {k: round(v / n, 4) for k, v in sums.items()}


@dataclass
class DistillState:
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    last_eval: dict[str, float] = field(default_factory=dict)
    finished: bool = False


def _atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def check_resumable(work: Path, settings: dict[str, Any]) -> None:
    """Refuse to continue a run in ``work`` that was started with different settings."""
    path = work / SETTINGS_FILE
    if (work / STATE_FILE).exists() and path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise InvalidRequestError(
                f"work directory {work} holds a run with different settings ({', '.join(diff)}); "
                "rerun with the same settings to resume, or choose another --work/--out",
                "work",
            )
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))


def train(
    draft: torch.nn.Module,
    target: torch.nn.Module | None,
    source: TokenSource,
    val_windows: torch.Tensor,
    work: Path,
    cfg: DistillConfig,
    deadline: float | None = None,
    report: Callable[[str], None] = print,
) -> DistillState:
    """Train ``draft`` in place until ``cfg.steps`` or ``deadline`` (epoch seconds); resumes from ``work``."""
    torch.set_num_threads(cfg.threads)
    device = next(draft.parameters()).device
    decay = [p for p in draft.parameters() if p.dim() >= 2]
    no_decay = [p for p in draft.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    st, gen = DistillState(), torch.Generator().manual_seed(cfg.seed)
    state_path = work / STATE_FILE
    if state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        draft.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        gen.set_state(saved["rng"])
        st = DistillState(**saved["state"])
        report(f"resumed at step {st.step} ({st.tokens:,} tokens, {st.elapsed / 60:.1f} min)")
    log = (work / LOG_FILE).open("a")

    def save() -> None:
        _atomic_save(
            {"model": draft.state_dict(), "opt": opt.state_dict(), "rng": gen.get_state(), "state": asdict(st)},
            state_path,
        )

    if st.step == 0:
        st.last_eval = evaluate(draft, target, val_windows)
        log.write(json.dumps({"event": "start", "config": asdict(cfg), "step": 0, **st.last_eval}) + "\n")
    draft.train()
    t_last = time.time()
    while st.step < cfg.steps:
        if deadline is not None and time.time() > deadline:
            report(f"time limit reached at step {st.step}/{cfg.steps}; rerun the same command to continue")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(st.step, cfg)
        batch = source.batch(cfg.batch_size, cfg.seq_len, gen).to(device)  # [B, T+1]
        tl = target_logits(target, batch[:, :-1]) if cfg.kl_weight > 0 else None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            dl = draft(input_ids=batch[:, :-1]).logits
        parts = losses(dl, tl, batch[:, 1:], cfg.kl_weight)
        opt.zero_grad(set_to_none=True)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        st.step += 1
        st.tokens += cfg.batch_size * cfg.seq_len
        now = time.time()
        st.elapsed += now - t_last
        t_last = now
        record: dict[str, Any] = {
            "event": "step",
            "step": st.step,
            "tokens": st.tokens,
            "elapsed_s": round(st.elapsed, 1),
            "lr": lr_at(st.step - 1, cfg),
            **{k: round(v.item(), 4) for k, v in parts.items()},
        }
        if st.step % cfg.eval_every == 0 or st.step == cfg.steps:
            st.last_eval = evaluate(draft, target, val_windows)
            record.update({f"val_{k}": v for k, v in st.last_eval.items()})
            t_last = time.time()  # evaluation time is not training time
        if st.step % cfg.log_every == 0 or "val_ce" in record or st.step == cfg.steps:
            log.write(json.dumps(record) + "\n")
            log.flush()
            report(progress_line(record, st, cfg))
        if st.step % cfg.ckpt_every == 0:
            save()
    st.finished = st.step >= cfg.steps
    save()
    log.close()
    return st


def progress_line(record: dict[str, Any], st: DistillState, cfg: DistillConfig) -> str:
    rate = st.tokens / max(st.elapsed, 1e-9)
    eta_min = (cfg.steps - st.step) * st.elapsed / max(st.step, 1) / 60
    bar_w = 20
    filled = round(bar_w * st.step / cfg.steps)
    parts = [f"[{'#' * filled}{'.' * (bar_w - filled)}] step {st.step}/{cfg.steps}", f"loss {record['loss']:.3f}"]
    if "kl" in record:
        parts.append(f"kl {record['kl']:.3f}")
    parts.append(f"ce {record['ce']:.3f}")
    parts += [f"val {k[4:]} {v:.3f}" for k, v in record.items() if k.startswith("val_")]
    parts += [f"{rate:,.0f} tok/s", f"eta {eta_min:.1f} min"]
    return " | ".join(parts)


def export(
    draft: torch.nn.Module,
    tokenizer: Any,
    target_dir: Path | None,
    out: Path,
    meta: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``draft`` as a Hugging Face checkpoint with ``tokenizer`` and a generation config."""
    import copy

    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model: Any = copy.deepcopy(draft).to(dtype)
    gen_src = target_dir / "generation_config.json" if target_dir is not None else None
    if gen_src is not None and gen_src.exists():
        model.generation_config = GenerationConfig.from_pretrained(str(target_dir))
    else:
        c = model.config
        model.generation_config = GenerationConfig(
            bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id
        )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    export_meta(out, meta)
    return out


def export_meta(out: Path, meta: dict[str, Any]) -> None:
    """(Re)write ``specdec_training.json``: how the checkpoint in ``out`` was made."""
    (out / "specdec_training.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
