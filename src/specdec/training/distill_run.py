"""One distillation job end to end: load the target, build the draft, train, export, measure α."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.errors import InvalidRequestError, ModelLoadError
from specdec.training import distill as D
from specdec.training.distill_data import (
    OnPolicySource,
    StreamSource,
    TargetSampleSource,
    TokenSource,
    encode_texts,
    expand_files,
    fixed_windows,
    load_stream,
    prompts_from_stream,
    split_streams,
)


@dataclass
class DistillJob:
    target: Path
    out: Path
    work: Path | None = None  # resumable state; default: the output directory
    draft_config: str = "small"
    data: list[Path] = field(default_factory=list)
    val_data: list[Path] = field(default_factory=list)
    from_target: bool = False
    on_policy: float = 0.0  # share of each batch continued greedily by the target (with --data)
    glob: str = "*"
    config: D.DistillConfig = field(default_factory=D.DistillConfig)
    minutes: float | None = None
    device: str = "cpu"
    prompts: int = 16  # held-out prompts for the closing α measurement (0 = skip it)
    prompt_len: int = 64
    eval_tokens: int = 64
    meta: dict[str, Any] = field(default_factory=dict)  # extra facts recorded in specdec_training.json


@dataclass
class Prepared:
    source: TokenSource
    val_windows: torch.Tensor  # [N, T+1]
    prompts: list[list[int]]
    description: dict[str, Any]


def load_target(path: Path, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """Any ``AutoModelForCausalLM`` checkpoint with its tokenizer, frozen, bf16 weights."""
    from transformers import AutoModelForCausalLM

    from specdec.api import load_tokenizer
    from specdec.runtime.hf import check_checkpoint_dir

    path = check_checkpoint_dir(path)
    tok = load_tokenizer(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load target {path}: {str(e).strip().splitlines()[0]}") from e
    model.to(device).eval().requires_grad_(False)
    if len(tok) > model.get_output_embeddings().weight.shape[0]:
        raise ModelLoadError(
            f"target {path}: tokenizer has {len(tok)} tokens but the model only "
            f"{model.get_output_embeddings().weight.shape[0]} output rows"
        )
    return model, tok


def special_id(tok: Any, config: Any, name: str) -> int | None:
    value = getattr(tok, f"{name}_token_id", None)
    if value is None:
        value = getattr(config, f"{name}_token_id", None)
    return value[0] if isinstance(value, list) else value


def prepare_data(job: DistillJob, target: Any, tok: Any, seq_len: int) -> Prepared:
    val: Any
    cfg, vocab = job.config, int(target.get_output_embeddings().weight.shape[0])
    eos = special_id(tok, target.config, "eos")
    if job.from_target:
        if job.on_policy:
            raise InvalidRequestError(
                "--on-policy needs --data: with --from-target every sequence is already the target's own", "on_policy"
            )
        bos = special_id(tok, target.config, "bos")
        bos = bos if bos is not None else eos
        if bos is None:
            raise InvalidRequestError("--from-target needs a BOS or EOS token to start samples from", "from_target")
        sampler = TargetSampleSource(target, bos, next(target.parameters()).device)
        held_out = torch.Generator().manual_seed(cfg.seed + 1_000_003)  # never the training sampler's stream
        val = sampler.batch(max(cfg.eval_windows, job.prompts), seq_len, held_out)
        sampler.sampled_tokens = 0  # count training samples only
        prompts = [row[: job.prompt_len].tolist() for row in val[: job.prompts]]
        return Prepared(sampler, val[: cfg.eval_windows], prompts, {"kind": "target-samples", "bos_id": bos})
    if not job.data:
        raise InvalidRequestError("give training text with --data FILES... or use --from-target", "data")
    if not 0.0 <= job.on_policy < 1.0:
        raise InvalidRequestError(f"--on-policy must be in [0, 1), got {job.on_policy}", "on_policy")
    train, val = split_streams(tok, expand_files(job.data, job.glob), vocab, eos, hold_out=not job.val_data)
    if job.val_data:
        files = expand_files(job.val_data, job.glob)
        val = np.concatenate(
            [load_stream(f, vocab) if f.suffix == ".npy" else encode_texts(tok, [f], eos) for f in files]
        )
    need = seq_len + 2
    if len(train) < need or len(val) < 8:
        raise InvalidRequestError(
            f"--data gives {len(train)} training and {len(val)} validation tokens; "
            f"need at least {need} and 8 (add text or lower --seq-len)",
            "data",
        )
    prompts = prompts_from_stream(val, job.prompts, job.prompt_len, eos if eos is not None else -1)
    desc = {
        "kind": "files",
        "files": [str(p) for p in job.data],
        "train_tokens": int(len(train)),
        "validation_tokens": int(len(val)),
    }
    source: TokenSource = StreamSource(train, "data")
    if job.on_policy > 0:
        source = OnPolicySource(source, target, job.on_policy, next(target.parameters()).device)
        desc["on_policy"] = job.on_policy
    return Prepared(source, fixed_windows(val, seq_len, cfg.eval_windows), prompts, desc)


def measure_acceptance(
    target: Path,
    draft: Path,
    prompts: list[list[int]],
    *,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    tau: int = 4,
    seed: int = 0,
    runtime: str = "auto",
    dtype: str = "auto",
) -> dict[str, Any]:
    """α = accepted / drafted over all prompts (fixed τ), mean accepted length, per-prompt α."""
    import specdec
    from specdec.analysis import StepAggregate

    engine = specdec.load(target, draft, tau=tau, runtime=runtime, dtype=dtype)
    steps = StepAggregate()
    per_prompt = []
    for i, p in enumerate(prompts):
        r = engine.generate(p, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i, tau=tau)
        for record in r.records:
            steps.add(record)
        per_prompt.append(round(r.stats.acceptance_rate, 3))
    return {
        "alpha": steps.output_alpha or 0.0,
        "mean_accepted_length": steps.tokens_per_pass or 0.0,
        "drafted": steps.drafted,
        "accepted": steps.accepted_out,
        "prompts": len(prompts),
        "tau": tau,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "per_prompt_alpha": per_prompt,
    }


def run(job: DistillJob, report: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) the draft, export it to ``job.out`` and measure greedy α on held-out prompts."""
    from transformers import LlamaForCausalLM

    from specdec.runtime.hf import context_window

    cfg = job.config
    cfg.check()
    shape = D.draft_shape(job.draft_config)
    if job.data and job.from_target:
        raise InvalidRequestError("choose either --data or --from-target, not both", "data")
    device = torch.device(job.device)
    torch.set_num_threads(cfg.threads)
    target, tok = load_target(job.target, device)
    max_positions = context_window(target.config)
    cfg.seq_len = min(cfg.seq_len, max_positions)
    data = prepare_data(job, target, tok, cfg.seq_len)
    work = job.work or job.out
    settings = {
        "target": str(Path(job.target).resolve()),
        "shape": shape,
        "config": cfg.resume_key(),
        "data": data.description if not job.from_target else "target-samples",
    }
    D.check_resumable(work, settings)
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(D.draft_config(target.config, shape, max_positions)).to(device)
    report(
        f"target {job.target}: {D.count_params(target) / 1e6:.1f}M parameters; draft {shape}: "
        f"{D.count_params(draft) / 1e6:.2f}M parameters; {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} tokens"
    )
    deadline = time.time() + 60 * job.minutes if job.minutes else None
    t0 = time.time()
    st = D.train(
        draft, target if cfg.kl_weight > 0 else None, data.source, data.val_windows, work, cfg, deadline, report
    )
    final = D.evaluate(draft, target, data.val_windows)
    meta = {
        **job.meta,
        "seed": cfg.seed,
        "settings": asdict(cfg),
        "draft_shape": shape,
        "parameters": D.count_params(draft),
        "target": str(job.target),
        "data": data.description,
        "source": data.source.describe(),
        "steps": st.step,
        "finished": st.finished,
        "tokens": st.tokens,
        "train_seconds": round(st.elapsed, 1),
        "validation": final,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "wall_seconds_this_run": round(time.time() - t0, 1),
    }
    D.export(draft, tok, Path(job.target), job.out, meta)
    report(
        f"wrote {job.out} (step {st.step}/{cfg.steps}, val kl {final.get('kl', float('nan')):.3f}, "
        f"top-1 agreement {final.get('agree', float('nan')):.3f})"
    )
    if job.prompts > 0 and data.prompts:
        acc = measure_acceptance(job.target, job.out, data.prompts, max_new_tokens=job.eval_tokens)
        meta["acceptance_greedy"] = acc
        D.export_meta(job.out, meta)
        report(
            f"greedy acceptance on {acc['prompts']} held-out prompts (τ=4, {job.eval_tokens} new tokens): "
            f"α = {acc['alpha']:.3f}, mean accepted length {acc['mean_accepted_length']:.2f}"
        )
    return meta
