"""The default pair's corpus: the running CPython's standard-library sources.

Every machine with Python has these bytes, so the pair can be retrained anywhere
with no download. Files are split into train/validation by a hash of their path
relative to ``Lib/``, so the split does not depend on listing order.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EOS_TOKEN = "<|endoftext|>"
# The default pair is a code-completion model, not a chat model. Its chat template lays a conversation out as Python
# source the model continues: every message but the assistant's as comment lines, the assistant's as code. So chat
# clients work against it out of the box (``specdec serve``'s /v1/chat/completions); the replies are code.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{{ message['content'] }}\n"
    "{% else -%}\n"
    "# {{ message['content'] | replace('\\n', '\\n# ') }}\n"
    "{% endif -%}\n"
    "{%- endfor -%}"
)
# Validation share of files, in per-mille of the path hash space.
VAL_PER_MILLE = 50


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[str]:
    """Relative paths of every ``.py`` file under Lib/, site-packages excluded, sorted."""
    root = root or stdlib_dir()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        out.append(rel)
    return sorted(out)


def is_validation(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < VAL_PER_MILLE


@dataclass(frozen=True)
class Split:
    root: Path
    train: list[str]
    validation: list[str]

    def read(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8", errors="replace")


def split_sources(root: Path | None = None) -> Split:
    root = root or stdlib_dir()
    files = list_sources(root)
    val = [f for f in files if is_validation(f)]
    train = [f for f in files if not is_validation(f)]
    return Split(root=root, train=train, validation=val)


def train_tokenizer(split: Split, vocab_size: int, out_dir: Path) -> None:
    """Byte-level BPE on the training files, saved loadable by ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((split.read(f) for f in split.train), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=None,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    fast.model_max_length = 1024
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def encode_files(tokenizer_dir: Path, split: Split, files: list[str]) -> np.ndarray:
    """All files as one uint16 stream, each file followed by EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    chunks = []
    texts = [split.read(f) for f in files]
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        chunks.append(np.asarray(ids + [eos], dtype=np.uint16))
    return np.concatenate(chunks)
