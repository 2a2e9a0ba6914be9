"""Reproduce the shipped default pair: ``python -m specdec.training.default_pair --work runs/default``.

Stages, each resumable and skipped when its output exists:
  data    split the stdlib sources, train the tokenizer, encode train/validation streams
  target  pretrain the Llama target (bf16 autocast) on the training stream
  draft   distil the two-layer draft from the target on its own continuations plus corpus windows
          (KL(target || draft) + some CE; training/onpolicy.py), beside a same-shape CE-only baseline
  export  write both as Hugging Face checkpoints (bf16 safetensors) into the package
Seed, corpus and settings are recorded in each exported model directory (``specdec_training.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from specdec.training import corpus

VOCAB_SIZE = 8192
TARGET_SHAPE = dict(
    hidden_size=640,
    intermediate_size=1728,
    num_hidden_layers=4,
    num_attention_heads=10,
    num_key_value_heads=5,
)
MAX_POSITIONS = 1024
# The shipped draft's recipe (training/onpolicy.py): names of the drafts trained side by side, the step
# count and the number of target continuations in the pool. It needs a GPU to finish in minutes (~4 min
# on one H100, continuations and training); on 2 CPU cores the same schedule would take days.
ONPOLICY_DRAFTS = "d256x2,d256x2_ce,d256x3,d256x1"
ONPOLICY_STEPS = 1919
ONPOLICY_POOL_ROWS = 6144
SHIPPED_DRAFT, BASELINE_DRAFT = "d256x2", "d256x2_ce"
TARGET_EVAL_WINDOWS = 128
REPRODUCE = "python -m specdec.training.default_pair --work runs/default --target-steps 1400"
PACKAGE_MODELS = Path(__file__).resolve().parent.parent / "models"


def llama_config(shape: dict[str, int]):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        rms_norm_eps=1e-5,
        **shape,
    )


def stage_data(work: Path) -> None:
    if (work / "val.npy").exists():
        return
    split = corpus.split_sources()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    corpus.train_tokenizer(split, VOCAB_SIZE, work / "tokenizer")
    train = corpus.encode_files(work / "tokenizer", split, split.train)
    val = corpus.encode_files(work / "tokenizer", split, split.validation)
    np.save(work / "train.npy", train)
    np.save(work / "val.npy", val)
    (work / "validation_files.txt").write_text("\n".join(split.validation) + "\n")
    meta = {
        "python": platform.python_version(),
        "stdlib": str(split.root),
        "train_files": len(split.train),
        "validation_files": len(split.validation),
        "train_tokens": int(len(train)),
        "validation_tokens": int(len(val)),
        "seconds": round(time.time() - t0, 1),
    }
    (work / "data.json").write_text(json.dumps(meta, indent=2))
    print(f"data: {meta}", flush=True)


def stage_target(work: Path, max_steps: int, deadline: float | None) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from specdec.training.pretrain import TrainConfig, train

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(TARGET_SHAPE))
    n = sum(p.numel() for p in model.parameters())
    print(f"target: {n / 1e6:.1f}M parameters", flush=True)
    cfg = TrainConfig(max_steps=max_steps)
    train(model, np.load(work / "train.npy"), np.load(work / "val.npy"), work / "target", cfg, deadline)


def export_target(work: Path, target_steps: int) -> Path:
    """The trained target as a bf16 Hugging Face checkpoint in ``work/target_hf`` (skipped when present)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    from specdec.training.pretrain import eval_windows, evaluate

    out = work / "target_hf"
    if (out / "model.safetensors").exists():
        return out
    state = torch.load(work / "target" / "ckpt.pt", weights_only=False)
    model = LlamaForCausalLM(llama_config(TARGET_SHAPE))
    model.load_state_dict(state["model"])
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    events = [json.loads(line) for line in (work / "target" / "log.jsonl").read_text().splitlines()]
    settings = next(e["config"] for e in events if e["event"] == "start")
    val_log = [e["val_loss"] for e in events if "val_loss" in e]
    windows = eval_windows(np.load(work / "val.npy"), settings["seq_len"], TARGET_EVAL_WINDOWS)
    val_loss = evaluate(model, windows)
    meta = {
        "role": "default target",
        "seed": settings["seed"],
        "corpus": corpus_meta(work),
        "settings": settings,
        "shape": TARGET_SHAPE,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": state["step"],
        "finished": state["step"] >= target_steps,
        "tokens": state["tokens"],
        "train_seconds": round(state["elapsed"], 1),
        "val_loss_during_training": val_log[-1] if val_log else None,
        "validation": {
            "loss": round(val_loss, 4),
            "perplexity": round(float(np.exp(val_loss)), 2),
            "windows": TARGET_EVAL_WINDOWS,
            "window_tokens": settings["seq_len"],
        },
        "python": platform.python_version(),
        "command": REPRODUCE,
    }
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(work / "tokenizer")).save_pretrained(str(out))
    (out / "specdec_training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"target: exported step {state['step']} to {out}; val loss {val_loss:.3f} (bf16)", flush=True)
    return out


def stage_draft(work: Path, target_steps: int, device: str | None) -> None:
    """Distil the draft (and its CE-only baseline) from the exported target: training/onpolicy.py's recipe."""
    import shutil

    from specdec.training import onpolicy
    from specdec.training.distill import export_meta

    target = export_target(work, target_steps)
    out = work / "onpolicy"
    if not (out / "onpolicy.json").exists():
        argv = ["--work", str(out), "--target", str(target), "--train", str(work / "train.npy")]
        argv += ["--val", str(work / "val.npy"), "--drafts", ONPOLICY_DRAFTS, "--steps", str(ONPOLICY_STEPS)]
        argv += ["--pool-rows", str(ONPOLICY_POOL_ROWS), "--pool-seconds", "1e9", "--minutes", "1e9"]
        onpolicy.main(argv + (["--device", device] if device else []))
    for name, dst in ((SHIPPED_DRAFT, "draft_hf"), (BASELINE_DRAFT, "baseline_hf")):
        if (work / dst).exists():
            shutil.rmtree(work / dst)
        shutil.copytree(out / name, work / dst)
        meta = json.loads((work / dst / "specdec_training.json").read_text())
        export_meta(work / dst, {**meta, "seed": 0, "corpus": corpus_meta(work), "reproduce": REPRODUCE})
    print(f"draft: wrote {work / 'draft_hf'} ({SHIPPED_DRAFT}) and {work / 'baseline_hf'} ({BASELINE_DRAFT})")


SHIPPED_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "specdec_training.json",
)


def stage_export(work: Path) -> None:
    """Copy both checkpoints (and the validation file list) into the package."""
    import shutil

    for name, src in (("target", work / "target_hf"), ("draft", work / "draft_hf")):
        if not (src / "model.safetensors").exists():
            raise SystemExit(f"export: {src} is missing; run the target and draft stages first")
        dst = PACKAGE_MODELS / name
        dst.mkdir(parents=True, exist_ok=True)
        for f in SHIPPED_FILES:
            if (src / f).exists():
                shutil.copyfile(src / f, dst / f)
    shutil.copyfile(work / "validation_files.txt", PACKAGE_MODELS / "validation_files.txt")
    print(f"export: wrote {PACKAGE_MODELS}/target and /draft", flush=True)


def corpus_meta(work: Path) -> dict[str, Any]:
    return json.loads((work / "data.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/default"))
    ap.add_argument("--stages", default="data,target,draft,export")
    ap.add_argument("--target-steps", type=int, default=1400)
    ap.add_argument("--device", default=None, help="device for the draft stage (default: cuda when available)")
    ap.add_argument("--minutes", type=float, default=None, help="stop the current stage after this long")
    args = ap.parse_args(argv)
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    stages = args.stages.split(",")
    if "data" in stages:
        stage_data(args.work)
    if "target" in stages:
        stage_target(args.work, args.target_steps, deadline)
    if "draft" in stages:
        stage_draft(args.work, args.target_steps, args.device)
    if "export" in stages:
        stage_export(args.work)
    if "report" in stages:
        from specdec.training import pair_report

        pair_report.build(args.work)
        pair_report.plot_curves(args.work, Path("docs/models_curves.png"))
        print(f"report: wrote {args.work / 'report.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
