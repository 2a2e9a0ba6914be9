"""Structured output: the generated text held to a format (any JSON object, a JSON schema, a regular expression,
one of a list of choices, a Lark grammar), exactly as under target-only decoding.

A format is a logit rule (``specdec.logits_rules``): at each position every token the format does not allow after
the output so far is masked to -inf, after the other rules and before temperature, top-k, top-p and min-p, on the
target's rows and on the draft's alike. Under speculation row ``i`` of a verify block ``[last, ŷ1..ŷτ]`` is masked
with the format's state after ``output + ŷ1..ŷi`` (``FormatMatcher.allowed``: the drafted tokens consumed, one mask
per row, then rolled back), so each row is what target-only decoding with the format computes at that position, and
the acceptance rule keeps the output exactly that (greedy: identical tokens; sampled: the same law). A drafted token
the format forbids has p = 0 there and is rejected; the rows after it are never used. The draft's own positions are
masked the same way, so a draft model proposes only tokens the format allows.

The format decides where the output ends: once it is complete only the end-of-sequence token is allowed (so it is
not combined with ``min_tokens`` or ``ignore_eos``). ``max_new_tokens`` still cuts the output where it is
(``finish_reason`` "length"); the text is then a prefix of a valid one.

The matching is llguidance's (a token-level Earley parser over the tokenizer's vocabulary, ~20 µs a mask on the
default pair's 8,192 tokens), imported when the first format is asked for.
``OutputFormat`` itself is plain data (what a request asked for, recorded in its trace settings).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.errors import InvalidRequestError, UnsupportedError

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON laid out as ``json.dumps`` writes it (", " and ": ", no other whitespace): a model free to put whitespace
# anywhere can fill its budget with it (small ones do). A schema's "x-guidance" object overrides it
# (``{"whitespace_flexible": true}``: any JSON whitespace between tokens).
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PARAM = "response_format"


@dataclass(frozen=True)
class OutputFormat:
    """What the output must follow. ``value``: the schema (JSON text, keys sorted) for ``json_schema``, the pattern
    for ``regex``, the choices for ``choice``, the Lark text for ``grammar``; None for ``json_object``."""

    kind: str
    value: str | tuple[str, ...] | None = None
    name: str | None = None  # a json_schema's name (OpenAI's ``json_schema.name``), kept for the records

    @classmethod
    def parse(cls, spec: OutputFormat | Mapping[str, Any] | None, param: str = PARAM) -> OutputFormat | None:
        """A format from what a request sent: an ``OutputFormat``, or a mapping in OpenAI's ``response_format`` shape
        (``{"type": "text"}`` → None, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name":
        ..., "schema": {...}}}``) or one of specdec's (``{"type": "regex", "regex": ...}``, ``{"type": "choice",
        "choice": [...]}``, ``{"type": "grammar", "grammar": LARK}``). Errors name ``param``."""
        if spec is None or isinstance(spec, OutputFormat):
            return spec
        if not isinstance(spec, Mapping):
            raise InvalidRequestError(f"{param} must be an object with a type, got {_shown(spec)}", param)
        kind = spec.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            inner = spec.get("json_schema")
            if not isinstance(inner, Mapping):
                raise InvalidRequestError(f'{param}: type "json_schema" needs a json_schema object', param)
            schema = inner.get("schema", {})  # OpenAI: an absent schema means any JSON
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"{param}: json_schema.schema is not JSON: {e}", param) from e
            if not isinstance(schema, (Mapping, bool)):
                raise InvalidRequestError(f"{param}: json_schema.schema must be a JSON schema object", param)
            name = inner.get("name")
            if name is not None and not isinstance(name, str):
                raise InvalidRequestError(f"{param}: json_schema.name must be a string", param)
            return cls("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False), name)
        if kind in ("regex", "grammar"):
            value = spec.get(kind)
            if not isinstance(value, str) or not value:
                raise InvalidRequestError(f'{param}: type "{kind}" needs a non-empty string {kind}', param)
            return cls(kind, value)
        if kind == "choice":
            value = spec.get("choice")
            if (
                not isinstance(value, Sequence)
                or isinstance(value, str)
                or not value
                or not all(isinstance(c, str) and c for c in value)
            ):
                raise InvalidRequestError(f'{param}: type "choice" needs a list of non-empty strings', param)
            return cls("choice", tuple(value))
        raise InvalidRequestError(
            f"{param}: unknown type {_shown(kind)}; one of text, {', '.join(KINDS)}",
            param,
        )

    def settings(self) -> dict[str, Any]:
        """The format as a request's records keep it (JSON); ``parse`` reads it back."""
        if self.kind == "json_object":
            return {"type": "json_object"}
        if self.kind == "json_schema":
            assert isinstance(self.value, str)
            inner: dict[str, Any] = {"schema": json.loads(self.value)}
            if self.name is not None:
                inner["name"] = self.name
            return {"type": "json_schema", "json_schema": inner}
        value = list(self.value) if isinstance(self.value, tuple) else self.value
        return {"type": self.kind, self.kind: value}

    def grammar(self) -> str:
        """The format as an llguidance grammar."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind == "json_schema":
            assert isinstance(self.value, str)
            try:
                return LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_LAYOUT)
            except ValueError as e:
                raise InvalidRequestError(f"{PARAM}: the JSON schema is not valid: {e}", PARAM) from e
        if self.kind == "regex":
            assert isinstance(self.value, str)
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            assert isinstance(self.value, tuple)
            # Lark string literals take JSON's escapes: each choice spelled exactly, quotes and newlines included.
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.value)
            )
        assert isinstance(self.value, str)
        return LLMatcher.grammar_from_lark(self.value)


def _shown(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


class Formats:
    """The formats of one model's requests: the tokenizer's vocabulary prepared once for the matcher (tens of ms for
    8k tokens, about a second for 128k), then a ``FormatMatcher`` per request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Collection[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: Any = None

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            try:
                import llguidance.hf
            except ImportError as e:
                raise UnsupportedError(
                    "structured output needs the llguidance package (a dependency of specdec): pip install llguidance",
                    PARAM,
                ) from e
            if not self.eos_ids:
                raise UnsupportedError(
                    "structured output needs a model with an end-of-sequence token (the format ends the output)",
                    PARAM,
                )
            n_vocab = max(self.vocab_size, len(self._hf))
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=n_vocab, eos_token=self.eos_ids)
            except ValueError as e:  # a slow (Python) tokenizer
                raise UnsupportedError(f"structured output needs a fast tokenizer: {e}", PARAM) from e
        return self._tokenizer

    def prepare(self) -> str | None:
        """Prepare the vocabulary now (a server, before it serves: not on the first formatted request, in the step
        every request shares). Returns why formats cannot be served on this model, or None."""
        try:
            self._llg_tokenizer()
        except UnsupportedError as e:
            return str(e)
        return None

    def matcher(self, fmt: OutputFormat) -> FormatMatcher:
        """A fresh matcher of ``fmt`` at the start of an output; a grammar that does not compile is the request's
        error (``InvalidRequestError`` naming ``response_format``)."""
        from llguidance import LLMatcher

        tokenizer = self._llg_tokenizer()
        grammar = fmt.grammar()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            error = " ".join(line.strip() for line in matcher.get_error().splitlines()[:4] if line.strip())
            raise InvalidRequestError(f"{PARAM}: the {fmt.kind.replace('_', ' ')} does not compile: {error}", PARAM)
        return FormatMatcher(matcher, tokenizer.vocab_size, self.eos_ids)


class FormatMatcher:
    """One output's place in its format: the tokens allowed next after the output so far (``commit``), and after
    tokens drafted beyond it (``allowed``)."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._m = matcher
        self._eos = list(eos_ids)
        self._words = (vocab_size + 31) // 32  # the mask's length in 32-bit words

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the output (each one allowed by the masks it was drawn under)."""
        tokens = self._before_eos(tokens)
        if tokens and not self._m.consume_tokens(tokens):
            raise RuntimeError(f"the output left its format: {self._m.get_error()}")

    def _before_eos(self, tokens: Sequence[int]) -> list[int]:
        # The output ends at an end-of-sequence token: the format never consumes it (nothing comes after it).
        out = []
        for t in tokens:
            if t in self._eos:
                break
            out.append(int(t))
        return out

    def allowed(self, tokens: Sequence[int], offset: int, rows: int, width: int, device: torch.device) -> torch.Tensor:
        """``[rows, width]`` bool: the tokens allowed at row ``i``, which continues ``output + tokens[:offset + i]``.
        A drafted token the format forbids, or an end-of-sequence token, makes the rows after it repeat its row's mask
        (they are never used: the token is rejected there, or the output ends with it)."""
        import numpy as np
        import torch

        m = self._m
        ahead = self._before_eos(tokens[: offset + rows - 1])
        valid = m.validate_tokens(ahead) if ahead else 0  # the drafted prefix the format allows
        bits = np.empty((rows, self._words), dtype="<u4")  # token 32w + j: bit j of word w
        consumed, last = 0, -1
        for i in range(rows):
            state = min(offset + i, valid)  # past a forbidden token: the state before it (its row's mask again)
            if state == last:
                bits[i] = bits[i - 1]
                continue
            if state > consumed and not m.consume_tokens(ahead[consumed:state]):
                raise RuntimeError(f"the format refused tokens it validated: {m.get_error()}")
            consumed = last = state
            m.unsafe_compute_mask_ptr(bits[i].ctypes.data, self._words * 4)
        if consumed:
            m.rollback(consumed)
        mask = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
        if mask.shape[1] < width:  # logits wider than the tokenizer's vocabulary: those ids are never text
            mask = np.pad(mask, ((0, 0), (0, width - mask.shape[1])))
        mask = mask[:, :width]
        dead = ~mask.any(axis=1)  # no token can continue the format here: the output ends
        if dead.any():
            mask = mask.copy()
            for t in self._eos:
                if t < width:
                    mask[dead, t] = True
        return torch.from_numpy(np.ascontiguousarray(mask)).to(device)
