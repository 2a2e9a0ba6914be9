"""Incremental detokenisation and stop strings, shared by generate, stream and the server."""

from __future__ import annotations

import functools
import json
import random
import weakref
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
        self._bytes = byte_level_pieces(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._bytes is not None:
            return self._bytes.text(ids)
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
            text = self.continued(self._text, ids[max(0, n - self.OVERLAP) : n], ids[n:])
        if text is None:
            text = self._decode(ids)
        if not text.endswith("\ufffd"):
            self._ids, self._text = ids, text
        if not final:
            text = text.rstrip("\ufffd")
        return text

    def continued(self, text: str, overlap: list[int], more: list[int]) -> str | None:
        """The text of a sequence ending in ``overlap`` (its last few ids) whose text is ``text``, continued by
        ``more``: decoded from the overlap only. None where the overlap's text does not end ``text`` or the
        continuation rewrites it (the caller then decodes the whole sequence). An overlap that starts inside a
        character (byte tokens of one character, common in CJK text) decodes its first bytes to U+FFFD where the
        whole text has the character: only its text after them has to end ``text`` (UTF-8 finds its way back at
        the next character), else every step of such a text would decode the whole sequence.

        A byte-level tokenizer's text is its tokens' bytes decoded (``BytePieces``), and a text that does not end in
        U+FFFD ends on a whole character, so the decoding of what follows starts afresh there: ``text`` + the text of
        ``more``, one decoding and no overlap (callers pass only such texts: a text ending in U+FFFD is never kept)."""
        if self._bytes is not None and not text.endswith("\ufffd"):
            return text + self._bytes.text(more)
        head, whole = self._decode(overlap), self._decode(overlap + more)
        if whole.startswith(head) and text.endswith(head.lstrip("\ufffd")):
            return text + whole[len(head) :]
        return None


class OutputText:
    """A request's output as text while its tokens come, cut at its first stop string, at a cost per step set by
    the step's own tokens rather than by the output's length so far.

    The ids are appended, never copied or compared whole (``TextDecoder.text_for`` does both to find where a
    sequence of its caller's extends the cached one: ~10 ns an id, 16 sequences × 1,000 tokens in a step is
    0.2 ms); the text is decoded from ``TextDecoder.OVERLAP`` ids before its settled end; stop strings are
    searched for only within the longest stop's reach of the text already streamed. What is left proportional to
    the length is a copy of the text's characters (memcpy speed) a step.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self._decoder = TextDecoder(tokenizer)
        self.stops = StopMatcher(stops)
        self.ids: list[int] = []
        self._settled = 0  # ids whose text (complete characters at its end) is ``_text``
        self._text = ""

    def _text_with(self, more: Sequence[int]) -> str:
        """Text of the ids and ``more`` after them (a trailing U+FFFD of an unfinished character kept)."""
        n, ids = self._settled, self.ids
        tail = ids[n:] + list(more) if more else ids[n:]
        text = self._decoder.continued(self._text, ids[max(0, n - TextDecoder.OVERLAP) : n], tail) if n else None
        return text if text is not None else self._decoder._decode(ids + list(more) if more else ids)

    def stop_in(self, tokens: Sequence[int]) -> int | None:
        """The fewest of ``tokens`` (after the ids so far) whose text completes a stop string, or None."""
        if not self.stops.active:
            return None
        for i in range(len(tokens)):
            if self.stops.find(self._text_with(tokens[: i + 1]).rstrip("\ufffd")) is not None:
                return i + 1
        return None

    def extend(self, tokens: Sequence[int], final: bool) -> str:
        """Append a step's tokens; the next piece of text to stream (until ``final``, an unfinished character and
        a possible start of a stop string are held back)."""
        self.ids.extend(tokens)
        text = self._text_with(())
        if not text.endswith("\ufffd"):
            self._settled, self._text = len(self.ids), text
        return self.stops.release(text if final else text.rstrip("\ufffd"), final)

    def text(self) -> str:
        """The whole text, cut at the first stop string."""
        return self.stops.cut(self._text_with(()))


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


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): the character each byte is written as in a token, inverted. Printable
    bytes stand for themselves; the others (controls, space, 127-160, 173) for the characters from U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in printable]
    chars.update((chr(256 + k), b) for k, b in enumerate(others))
    return chars


class BytePieces(dict[int, bytes]):
    """The text of ids under a tokenizer whose decoder is byte-level alone (GPT-2, Llama 3, Qwen2 and the shipped pair):
    each id's bytes (its token's characters mapped back through the byte-level alphabet; a token with a character
    outside it, an added one, as its own UTF-8; a special token, or an id the vocabulary lacks, as nothing; found on
    its first use and kept, id -> bytes), joined and decoded with each invalid or cut UTF-8 sequence as U+FFFD, as the
    ``tokenizers`` library's decoder does.

    A step's text is then one join and one decoding in Python (``TextDecoder.continued``), where the library's
    ``decode`` took two calls a sequence and step (each ~1.5 µs warm, several on the caches a pass has just flushed).
    ``byte_level_pieces`` makes one only where it gives the library's text on probes."""

    def __init__(self, backend: Any, special: set[int]) -> None:
        super().__init__()
        self._backend, self._special, self._chars = backend, special, _byte_level_chars()

    def text(self, ids: Sequence[int]) -> str:
        return b"".join(map(self.__getitem__, ids)).decode("utf-8", "replace")

    def __missing__(self, i: int) -> bytes:
        token = None if i in self._special or i < 0 else self._backend.id_to_token(i)
        chars = self._chars
        if token is None:
            piece = b""
        elif all(c in chars for c in token):
            piece = bytes(chars[c] for c in token)
        else:
            piece = token.encode("utf-8")
        self[i] = piece
        return piece


_BYTE_PIECES: weakref.WeakKeyDictionary[Any, BytePieces | None] = weakref.WeakKeyDictionary()


def byte_level_pieces(tokenizer: Any) -> BytePieces | None:
    """A ``BytePieces`` for ``tokenizer`` (one per tokenizer, kept), or None unless its fast tokenizer decodes byte-level
    alone and the pieces give its own ``decode``'s text (skipping special tokens) on probes: every added token, byte
    tokens that cut characters or are not UTF-8 at all, and random runs of its vocabulary."""
    try:
        return _BYTE_PIECES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: made afresh
        return _make_byte_pieces(tokenizer)
    pieces = _make_byte_pieces(tokenizer)
    _BYTE_PIECES[tokenizer] = pieces
    return pieces


def _make_byte_pieces(tokenizer: Any) -> BytePieces | None:
    backend = _backend(tokenizer)
    decode = fast_decoder(tokenizer)
    if backend is None or decode is None or not callable(getattr(backend, "id_to_token", None)):
        return None
    try:
        spec = json.loads(backend.to_str())
        decoder = spec.get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        added = spec.get("added_tokens") or []
        special = {int(a["id"]) for a in added if a.get("special")}
        pieces = BytePieces(backend, special)
        vocab = int(backend.get_vocab_size(with_added_tokens=True))
        rng = random.Random(0)
        sample = [int(a["id"]) for a in added] + [rng.randrange(vocab) for _ in range(256)]
        chars = _byte_level_chars()
        byte_ids = [backend.token_to_id(c) for c in sorted(chars, key=chars.__getitem__)]  # byte b's token, or None
        probes: list[list[int]] = [[i] for i in sample]
        probes += [[rng.choice(sample) for _ in range(rng.randrange(2, 12))] for _ in range(64)]
        if all(i is not None for i in byte_ids):
            # "é" cut after its first byte, a lone continuation byte, an invalid lead byte, "€" cut, then whole
            for run in ([0xC3], [0xA9, 0x41], [0xFF, 0x41], [0xE2, 0x82], [0xE2, 0x82, 0xAC], [0xF0, 0x9F, 0x99, 0x82]):
                probes.append([int(byte_ids[b]) for b in run])
            probes += [[int(byte_ids[rng.randrange(256)]) for _ in range(8)] for _ in range(32)]
        if any(pieces.text(p) != str(decode(p, skip_special_tokens=True)) for p in probes):
            return None
    except Exception:  # noqa: BLE001 - any doubt: the library's decode
        return None
    return pieces


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
    """Finds stop strings in generated text and decides how much text is safe to stream.

    Text already released holds no stop string, so in a text that starts with it a stop can only begin within the
    longest stop's length of its end: the search starts there (a text that does not start with it, which a
    tokenizer rewriting its last characters could give, is searched whole)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.released = ""
        self._reach = max((len(s) for s in self.stops), default=1) - 1

    @property
    def active(self) -> bool:
        return bool(self.stops)

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts, or None."""
        start = max(0, len(self.released) - self._reach) if text.startswith(self.released) else 0
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def cut(self, text: str) -> str:
        i = self.find(text)
        return text if i is None else text[:i]

    def release(self, text: str, final: bool) -> str:
        """The next piece of ``text`` to stream: never a stop string, nor (until final) a possible start of one."""
        i = self.find(text)
        end = len(text) if i is None else i
        if not final and i is None:
            hold = 0
            for s in self.stops:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            end -= hold
        r = len(self.released)
        if end <= r or not text.startswith(self.released):
            return ""
        piece = text[r:end]
        self.released += piece
        return piece
