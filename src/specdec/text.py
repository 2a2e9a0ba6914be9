"""Incremental detokenisation and stop strings, shared by generate, stream and the server."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class TextDecoder:
    """Text of a growing token sequence, without re-decoding all of it at every step.

    Decoding the whole sequence each step costs O(n) per step, O(n²) per request. Instead the text of
    the ids seen so far is cached once it is complete (no trailing U+FFFD of a cut UTF-8 sequence), and
    a later call decodes only from ``OVERLAP`` tokens before the cached end: the overlap gives tokenizers
    that treat a sequence's first token specially (a dropped leading space) or clean up across a
    boundary the same left context they had, and its text must reproduce the cached text's end, else
    (or for any sequence that does not extend the cached one) the whole sequence is decoded.
    """

    OVERLAP = 4

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []  # ids whose text is cached
        self._text = ""
        self._backend = fast_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend(ids, skip_special_tokens=True))
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def text_for(self, ids: Sequence[int], final: bool) -> str:
        """Text of ``ids``; unless ``final``, a trailing incomplete UTF-8 sequence (U+FFFD) is held back."""
        ids = list(ids)
        n = len(self._ids)
        text = None
        if n and len(ids) >= n and ids[:n] == self._ids:
            start = max(0, n - self.OVERLAP)
            head, whole = self._decode(ids[start:n]), self._decode(ids[start:])
            if whole.startswith(head) and self._text.endswith(head):
                text = self._text + whole[len(head) :]
        if text is None:
            text = self._decode(ids)
        if not text.endswith("\ufffd"):
            self._ids, self._text = ids, text
        if not final:
            text = text.rstrip("\ufffd")
        return text


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers`` library's tokenizer under a fast ``transformers`` one (None for any other)."""
    return getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)


def fast_decoder(tokenizer: Any) -> Any:
    """The ``tokenizers`` library's own ``decode`` under a fast ``transformers`` tokenizer, where the wrapper's
    ``decode`` would return exactly its result (no clean-up of tokenization spaces), else None. The wrapper
    converts its arguments and dispatches first: ~10 µs a call, twice per sequence and step."""
    backend = _backend(tokenizer)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode


# Texts on which a fast encoder must give the wrapper's ids before it is trusted (spaces, code, non-ASCII).
ENCODER_PROBES = ("Hello, world!", "  two leading spaces", "def f(x):\n    return x  # done\n", "ünïcödé 漢字 ✓ 🙂")


def fast_encoder(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """The ``tokenizers`` library's own ``encode`` under a fast ``transformers`` tokenizer, where it gives the
    wrapper's ids (checked on ``ENCODER_PROBES``), else None. The wrapper's ``__call__`` hands even one text to
    ``encode_batch``, which runs on the library's thread pool: in a server whose cores are busy with the model's
    passes, a wait for a core at every request's start (~10% of the scheduler thread's samples at 16 clients)."""
    backend = _backend(tokenizer)
    if backend is None or not callable(getattr(backend, "encode", None)):
        return None
    if getattr(backend, "truncation", None) or getattr(backend, "padding", None):
        return None  # the wrapper turns these off per call; the library would apply them

    def encode(text: str) -> list[int]:
        return list(backend.encode(text).ids)

    try:
        if any(encode(p) != list(tokenizer(p)["input_ids"]) for p in ENCODER_PROBES):
            return None
    except Exception:  # noqa: BLE001 - any doubt: the wrapper
        return None
    return encode


class StopMatcher:
    """Finds stop strings in generated text and decides how much text is safe to stream."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.released = ""

    @property
    def active(self) -> bool:
        return bool(self.stops)

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts, or None."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def cut(self, text: str) -> str:
        i = self.find(text)
        return text if i is None else text[:i]

    def release(self, text: str, final: bool) -> str:
        """The next piece of ``text`` to stream: never a stop string, nor (until final) a possible start of one."""
        safe = self.cut(text)
        if not final and self.stops and len(safe) == len(text):
            hold = 0
            for s in self.stops:
                for k in range(min(len(s) - 1, len(safe)), 0, -1):
                    if safe.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            safe = safe[: len(safe) - hold]
        if len(safe) <= len(self.released) or not safe.startswith(self.released):
            return ""
        piece = safe[len(self.released) :]
        self.released = safe
        return piece
