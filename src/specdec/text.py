"""Incremental detokenisation and stop strings, shared by generate, stream and the server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextDecoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text_for(self, ids: Sequence[int], final: bool) -> str:
        """Text of ``ids``; unless ``final``, a trailing incomplete UTF-8 sequence (U+FFFD) is held back."""
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
        return text


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
