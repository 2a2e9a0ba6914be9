"""Where distillation tokens come from: text files, token streams, or samples drawn from the target.

Every source yields windows of ``seq_len + 1`` token ids (``[B, T+1]``); the trainer asks the
target for its next-token distributions on them. Held-out windows and prompts (for measuring α)
come from files the training split never sees.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from specdec.errors import InvalidRequestError

# Share of text files held out for validation, in per-mille of the path-hash space.
VAL_PER_MILLE = 50
# When no file lands in validation (few files), this share of the token stream's tail is held out.
VAL_TAIL_SHARE = 0.05


class TokenSource(Protocol):
    def batch(self, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """``[B, T+1]`` int64 token ids."""
        ...

    def describe(self) -> dict[str, Any]: ...


@dataclass
class StreamSource:
    """Random windows of one token stream (documents joined by EOS)."""

    stream: np.ndarray
    name: str = "stream"

    def batch(self, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        n_windows = len(self.stream) - seq_len - 1
        starts = torch.randint(0, max(1, n_windows), (batch_size,), generator=gen).tolist()
        rows = [self.stream[s : s + seq_len + 1].astype(np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))  # [B, T+1]

    def describe(self) -> dict[str, Any]:
        return {"kind": "stream", "name": self.name, "tokens": int(len(self.stream))}


class TargetSampleSource:
    """Sequences sampled from the target itself at temperature 1, starting from its BOS token.

    Sampling is sequential (one target pass per token, batched over rows), so it costs far more per
    token than reading text; it needs no data at all.
    """

    def __init__(self, target: torch.nn.Module, bos_id: int, device: torch.device) -> None:
        self.target, self.bos_id, self.device = target, bos_id, device
        self.sampled_tokens = 0

    @torch.no_grad()
    def batch(self, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        ids = torch.full((batch_size, 1), self.bos_id, dtype=torch.long, device=self.device)
        out = self.target(input_ids=ids, use_cache=True)
        rows = [ids]
        for _ in range(seq_len):
            probs = torch.softmax(out.logits[:, -1].float(), dim=-1)  # [B, V]
            nxt = torch.multinomial(probs.cpu(), 1, generator=gen).to(self.device)  # [B, 1]
            rows.append(nxt)
            out = self.target(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        self.sampled_tokens += batch_size * seq_len
        return torch.cat(rows, dim=1).cpu()  # [B, T+1]

    def describe(self) -> dict[str, Any]:
        return {"kind": "target-samples", "bos_id": self.bos_id, "sampled_tokens": self.sampled_tokens}


class OnPolicySource:
    """Windows of another source, a share of whose rows the target continues greedily (on-policy data).

    Greedy speculative decoding asks the draft to predict the target's own continuation of a prompt; a
    draft trained only on text is judged on contexts it never saw. For ``share`` of each batch's rows this
    keeps the first quarter of the window as a prompt and replaces the rest by the target's greedy
    continuation (one batched target pass per token, with a KV cache).
    """

    def __init__(self, base: TokenSource, target: torch.nn.Module, share: float, device: torch.device) -> None:
        self.base, self.target, self.share, self.device = base, target, share, device
        self.generated_tokens = 0

    def batch(self, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        rows = self.base.batch(batch_size, seq_len, gen)  # [B, T+1]
        n_on = round(batch_size * self.share)
        if n_on == 0:
            return rows
        keep = max(1, (seq_len + 1) // 4)
        rows[:n_on] = greedy_continue(self.target, rows[:n_on, :keep].to(self.device), seq_len + 1).cpu()
        self.generated_tokens += n_on * (seq_len + 1 - keep)
        return rows

    def describe(self) -> dict[str, Any]:
        return {"kind": "on-policy", "share": self.share, "base": self.base.describe()}


@torch.no_grad()
def greedy_continue(target: torch.nn.Module, prompts: torch.Tensor, total: int) -> torch.Tensor:
    """``prompts`` ``[N, P]`` continued by the target's argmax to ``[N, total]`` tokens."""
    out = target(input_ids=prompts, use_cache=True)
    rows = [prompts]
    for i in range(total - prompts.shape[1]):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [N, 1]
        rows.append(nxt)
        if i + 1 < total - prompts.shape[1]:
            out = target(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(rows, dim=1)


def expand_files(paths: list[Path], pattern: str = "*") -> list[Path]:
    """Files as given; directories expand to their files matching ``pattern`` (recursively), sorted."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.rglob(pattern) if f.is_file())
            if not found:
                raise InvalidRequestError(f"data directory {p} has no files matching {pattern!r}", "data")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise InvalidRequestError(f"data file {p} does not exist", "data")
    return out


def is_validation(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < VAL_PER_MILLE


def load_stream(path: Path, vocab_size: int) -> np.ndarray:
    """A ``.npy`` token stream, checked against the vocabulary."""
    try:
        arr = np.load(path)
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"cannot read token stream {path}: {e}", "data") from e
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequestError(
            f"token stream {path} must be a 1-D integer array, got {arr.dtype} {arr.shape}", "data"
        )
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise InvalidRequestError(
            f"token stream {path} has ids outside the target's vocabulary (0..{vocab_size - 1})", "data"
        )
    return arr


def encode_texts(tokenizer: Any, files: list[Path], eos_id: int | None) -> np.ndarray:
    """Files as one stream, each followed by EOS. Files that are not UTF-8 text are skipped."""
    chunks = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            chunks.append(np.asarray([*ids, eos_id] if eos_id is not None else ids, dtype=np.int64))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)


def split_streams(
    tokenizer: Any, files: list[Path], vocab_size: int, eos_id: int | None, hold_out: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation streams: text files split by path hash, else the stream's tail held out.

    ``hold_out=False``: everything is training data (validation comes from elsewhere).
    """
    npy = [f for f in files if f.suffix == ".npy"]
    text = [f for f in files if f.suffix != ".npy"]
    streams = [load_stream(f, vocab_size) for f in npy]
    val_files = [f for f in text if is_validation(f.as_posix())]
    train_files = [f for f in text if not is_validation(f.as_posix())]
    if not hold_out or not val_files or not train_files:
        train_files, val_files = text, []
    train = np.concatenate([*streams, encode_texts(tokenizer, train_files, eos_id)])
    val = encode_texts(tokenizer, val_files, eos_id)
    if hold_out and len(val) == 0:  # hold out the tail of the stream instead
        cut = int(len(train) * (1 - VAL_TAIL_SHARE))
        train, val = train[:cut], train[cut:]
    return train, val


def fixed_windows(stream: np.ndarray, seq_len: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced windows of ``seq_len + 1`` tokens: a fixed evaluation set, ``[n, T+1]``."""
    seq_len = min(seq_len, len(stream) - 1)
    starts = np.linspace(0, len(stream) - seq_len - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1].astype(np.int64) for s in starts]))


def prompts_from_stream(stream: np.ndarray, n: int, length: int, eos_id: int) -> list[list[int]]:
    """``n`` prompts of up to ``length`` tokens ending at evenly spaced points, never crossing a document end."""
    prompts = []
    for end in np.linspace(length, len(stream) - 1, n).astype(np.int64):
        window = [int(t) for t in stream[max(0, end - length) : end]]
        if eos_id in window:
            window = window[len(window) - window[::-1].index(eos_id) :]
        if len(window) >= 4:
            prompts.append(window)
    return prompts
