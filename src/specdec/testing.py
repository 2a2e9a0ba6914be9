"""Tiny random-init checkpoints for tests and examples: real Hugging Face directories on disk.

Nothing here downloads anything. ``tiny_tokenizer`` trains a byte-level BPE on a few
kilobytes of built-in text in well under a second; ``tiny_checkpoint`` writes a random
model of the requested architecture with that tokenizer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

EOS = "<|endoftext|>"

# A few lines of code every tiny tokenizer here is trained on (tests add text of their own after it).
SAMPLE_CODE = """
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

"""
_TEXT = (
    SAMPLE_CODE
    + """import os, sys, json
print("hello, world!", sys.argv, os.getcwd(), json.dumps({"a": 1}))
The quick brown fox jumps over the lazy dog. 0123456789 !@#$%^&*()[]{}<>?/\\|~`'";:
"""
)


def tiny_tokenizer(out_dir: str | Path, vocab_size: int = 320, text: str | None = None) -> Any:
    """A byte-level BPE tokenizer trained on ``text`` (default: a small mix of code and prose), saved to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT if text is None else text] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, clean_up_tokenization_spaces=False
    )
    fast.save_pretrained(str(out_dir))
    return fast


def tiny_config(
    arch: str, vocab_size: int, layers: int = 2, hidden: int = 64, max_positions: int = 256, eos_id: int | None = None
) -> Any:
    """A small random config of a supported architecture: llama, qwen2, mistral, gpt2."""
    import transformers as tf

    heads = max(2, hidden // 16)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=eos_id if eos_id is not None else 0
    )
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, **common)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[arch]
    return cls(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        **common,
    )


def tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    tokenizer_from: str | Path | None = None,
    vocab_size: int = 320,
    sharpen: float = 1.0,
    **config_kwargs: Any,
) -> Path:
    """Write a random-init checkpoint (config, safetensors, tokenizer) to ``out_dir``.

    ``sharpen`` scales the output embedding so the random model's distributions are peakier.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_from)) if tokenizer_from else tiny_tokenizer(out, vocab_size)
    if tokenizer_from:
        tok.save_pretrained(str(out))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok), **config_kwargs))
    if sharpen != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def import_script(path: str | Path, name: str) -> ModuleType:
    """A Python file that is not in a package (a benchmark script) imported as module ``name``, registered in
    ``sys.modules`` first (its dataclasses look their module up while being made)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
