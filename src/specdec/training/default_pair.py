"""Reproduce the shipped default pair: ``python -m specdec.training.default_pair --work runs/default``.

Stages, each resumable and skipped when its output exists:
  data    split the stdlib sources, train the tokenizer, encode train/validation streams
  target  pretrain the Llama target (bf16 autocast) on the training stream
  draft   distill the one-layer draft from the target (KL(target || draft) + corpus loss)
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

import numpy as np

from specdec.training import corpus

VOCAB_SIZE = 8192
TARGET_SHAPE = dict(
    hidden_size=640, intermediate_size=1728, num_hidden_layers=4, num_attention_heads=10,
    num_key_value_heads=5,
)
DRAFT_SHAPE = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=4,
)
MAX_POSITIONS = 1024
PACKAGE_MODELS = Path(__file__).resolve().parent.parent / "models"


def llama_config(shape: dict[str, int]):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        rms_norm_eps=1e-5, **shape,
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
    meta = {"python": platform.python_version(), "stdlib": str(split.root),
            "train_files": len(split.train), "validation_files": len(split.validation),
            "train_tokens": int(len(train)), "validation_tokens": int(len(val)),
            "seconds": round(time.time() - t0, 1)}
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/default"))
    ap.add_argument("--stages", default="data,target,draft,export")
    ap.add_argument("--target-steps", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=None, help="stop the current stage after this long")
    args = ap.parse_args(argv)
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    stages = args.stages.split(",")
    if "data" in stages:
        stage_data(args.work)
    if "target" in stages:
        stage_target(args.work, args.target_steps, deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
