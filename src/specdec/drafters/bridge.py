"""A draft model with a tokenizer of its own: drafting through text ("bridging").

Each step, for each sequence: the verified context (target ids) becomes text, the text becomes the
draft's ids, the draft model drafts a few of its own tokens greedily, their text is re-encoded with the
target's tokenizer after the context's last few tokens, and the target tokens that follow the context
are the proposal (at most τ). The proposal is a deterministic function of the context, so its q is
one-hot: speculative sampling with a one-hot q accepts ŷ with probability p(ŷ) and on a rejection draws
from norm(max(0, p - δ_ŷ)), which is exact; greedy verification is exact by construction.

State is kept by position, as the other drafters keep it: the draft model's cache stands for a list of
draft ids (``BridgeState.held``); each step it is cropped to the longest common prefix of those and the
context's new draft ids, and only the rest is fed. The context's text is kept incrementally
(``TextDecoder``) and its draft ids are re-encoded only from the last verified seam (``_DraftIds``), so
a step costs in proportion to the new tokens, not to the context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.drafters.base import Draft, DraftAsk, Drafter, one_hot
from specdec.drafters.model import DraftModelState, ModelDrafter
from specdec.runtime.base import ModelRunner
from specdec.sampling import SamplingParams
from specdec.text import TextDecoder

# Target tokens re-encoded before the draft's text to find where the proposal starts.
TAIL_TOKENS = 6
# Draft ids re-encoded from the last seam; past this many, a new seam is looked for.
WINDOW = 64
# Tokens of left context decoded with a token sequence so its first token's text is what it is in context.
OVERLAP = 4
# At most this many draft tokens per target token asked for.
MAX_DRAFT_PER_TOKEN = 4
GREEDY = SamplingParams()


def encode(tokenizer: Any, text: str) -> list[int]:
    """Ids of ``text`` without the tokenizer's special tokens."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    text: str = tokenizer.decode(list(ids), skip_special_tokens=True)
    return text


def continuation_text(tokenizer: Any, left: Sequence[int], new: Sequence[int]) -> str | None:
    """The text ``new`` adds after ``left`` (decoded with a little of ``left`` so a leading space a tokenizer
    drops at the start of a sequence is kept); None when that text is not an extension."""
    head = list(left[-OVERLAP:])
    head_text, whole = decode(tokenizer, head), decode(tokenizer, head + list(new))
    if not whole.startswith(head_text):
        return None
    return whole[len(head_text) :]


def leading_specials(tokenizer: Any) -> list[int]:
    """The special ids the tokenizer puts before a text (e.g. BOS), which the draft model expects."""
    build = getattr(tokenizer, "build_inputs_with_special_tokens", None)
    if build is None:
        return []
    marker = -12345
    try:
        ids = list(build([marker]))
    except (TypeError, ValueError):
        return []
    return [int(t) for t in ids[: ids.index(marker)]] if marker in ids else []


def align_proposal(
    target_tok: Any, tail: Sequence[int], tail_text: str, draft_text: str, complete: bool = False
) -> list[int]:
    """Target ids continuing the context whose last tokens are ``tail`` (text ``tail_text``) by ``draft_text``.

    ``tail_text + draft_text`` is re-encoded with the target's tokenizer. Where the re-encoding reproduces
    ``tail``, the tokens after it are the proposal. Otherwise the proposal starts at the first token
    boundary of the re-encoding at or after the end of ``tail_text``: where that boundary is past it (the
    draft's text merges with the context's last token), the text in between is encoded alone and put
    first, and dropped if that does not reproduce it. Unless ``complete`` (the draft ended its text, e.g.
    at its EOS), the last token is dropped: more text could merge into it.
    """
    ids = encode(target_tok, tail_text + draft_text)
    n = len(tail)
    if ids[:n] == list(tail):
        out = ids[n:]
    else:
        out = []
        for k in range(1, len(ids) + 1):
            text = decode(target_tok, ids[:k])
            if len(text) < len(tail_text):
                continue
            if not text.startswith(tail_text):
                return []
            gap = text[len(tail_text) :]
            fill = encode(target_tok, gap)
            if gap and decode(target_tok, fill) != gap:
                return []
            out = fill + ids[k:]
            break
    if not complete and out:
        out = out[:-1]
    return out


class _DraftIds:
    """The draft's ids of a growing text: frozen ids up to a verified seam, the rest re-encoded on demand.

    A seam is a draft token boundary where encoding the text before it and the text after it separately
    gives exactly the ids of encoding the two together, so freezing there changes nothing.
    """

    def __init__(self, tokenizer: Any, prefix: list[int]) -> None:
        self.tokenizer = tokenizer
        self.frozen = list(prefix)
        self.offset = 0  # characters of the text covered by ``frozen``
        self._look_at = WINDOW  # window length at which to look for a seam next

    def ids(self, text: str) -> list[int]:
        window = encode(self.tokenizer, text[self.offset :])
        if len(window) > self._look_at:
            if self._seam(text[self.offset :], window):
                window = encode(self.tokenizer, text[self.offset :])
                self._look_at = WINDOW
            else:  # no seam here (a tokenizer may never split cleanly): look again further on
                self._look_at = len(window) + WINDOW // 2
        return self.frozen + window

    def _seam(self, text: str, window: list[int]) -> bool:
        for j in range(len(window) // 2, len(window) - 8):
            head = decode(self.tokenizer, window[:j])
            if (
                head
                and text.startswith(head)
                and encode(self.tokenizer, head) == window[:j]
                and encode(self.tokenizer, text[len(head) :]) == window[j:]
            ):
                self.frozen += window[:j]
                self.offset += len(head)
                return True
        return False


@dataclass
class BridgeState:
    inner: DraftModelState  # the draft model's cache
    text: TextDecoder  # the context's text, kept incrementally (target tokenizer)
    draft_ids: _DraftIds  # the context's draft ids
    held: list[int] = field(default_factory=list)  # draft ids the cache's first ``cache.length`` positions stand for


class BridgedDrafter(Drafter):
    """A draft model whose tokenizer differs from the target's, bridged through text (see the module doc)."""

    def __init__(self, runner: ModelRunner, target_tokenizer: Any, draft_tokenizer: Any, vocab_size: int) -> None:
        self.runner = runner
        self.target_tokenizer = target_tokenizer
        self.draft_tokenizer = draft_tokenizer
        self.vocab_size = vocab_size  # the target's
        self.name = f"bridge({runner.name})"
        # The draft proposes only ids its tokenizer knows (checkpoints often pad the output rows).
        self.inner = ModelDrafter(runner, min(runner.vocab_size, len(draft_tokenizer)))
        self._prefix = leading_specials(draft_tokenizer)
        eos = getattr(draft_tokenizer, "eos_token_id", None)
        self._draft_eos = set(runner.eos_token_ids) | ({eos} if isinstance(eos, int) else set())

    def new_state(self) -> BridgeState:
        return BridgeState(
            self.inner.new_state(), TextDecoder(self.target_tokenizer), _DraftIds(self.draft_tokenizer, self._prefix)
        )

    def _context_ids(self, state: BridgeState, context: list[int]) -> list[int] | None:
        """The draft's ids of the context's text; None while the text ends in an incomplete character."""
        text = state.text.text_for(context, final=True)
        if text.endswith("\ufffd"):
            return None
        return state.draft_ids.ids(text)

    def prefill(self, state: BridgeState, prompt: list[int]) -> None:
        ids = self._context_ids(state, prompt)
        if ids is not None and 1 < len(ids) < self.runner.max_context:
            self.inner.prefill(state.inner, ids)
            state.held = ids[:-1]

    def rollback(self, state: BridgeState, length: int) -> None:
        # The cache is reconciled with the context's draft ids at the next step (by position); only a
        # failed step (length 0: start over) resets everything.
        if length == 0:
            state.inner.cache.crop(0)
            state.held = []
            state.text = TextDecoder(self.target_tokenizer)
            state.draft_ids = _DraftIds(self.draft_tokenizer, self._prefix)

    def release(self, state: BridgeState, tokens: Sequence[int] = ()) -> None:
        # The target's ids are not the draft's: the draft's cache is kept by the draft ids it holds (``held``; a
        # prompt's prefill kept it too, ``ModelDrafter.prefill``), exact as any draft model's.
        self.inner.release(state.inner, state.held[: state.inner.cache.length])

    @torch.inference_mode()
    def propose(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        inner_asks: list[DraftAsk] = []
        rows: list[tuple[int, list[int]]] = []  # (ask index, the context's draft ids)
        for i, ask in enumerate(asks):
            if ask.tau <= 0:
                continue
            state: BridgeState = ask.state
            ids = self._context_ids(state, ask.context)
            if not ids:
                continue
            # Draft tokens for τ target tokens, from the context's ratio, plus one for the dropped last token.
            n = min(math.ceil(ask.tau * len(ids) / len(ask.context)) + 1, MAX_DRAFT_PER_TOKEN * ask.tau + 1)
            if len(ids) + n > self.runner.max_context:
                continue
            cache = state.inner.cache
            common = _common_prefix(state.held, ids, cache.length)
            cache.crop(common)
            inner_asks.append(DraftAsk(state.inner, ids, n, GREEDY, None))
            rows.append((i, ids))
        drafts = [Draft() for _ in asks]
        if not inner_asks:
            return drafts
        for (i, ids), inner in zip(rows, self.inner.propose(inner_asks)):
            ask, state = asks[i], asks[i].state
            fed = ids + inner.tokens
            state.held = fed[: state.inner.cache.length]
            tokens = self._proposal(ask.context, ids, inner.tokens)[: ask.tau]
            if tokens:
                probs = None if ask.params.greedy else one_hot(tokens, self.vocab_size, self.runner.device)
                drafts[i] = Draft(tokens, probs, [1.0] * len(tokens), [1.0] * len(tokens))
        return drafts

    def _proposal(self, context: list[int], ids: list[int], drafted: list[int]) -> list[int]:
        """The draft's tokens ``drafted`` (after its context ``ids``) as target ids after ``context``."""
        complete = False
        for k, t in enumerate(drafted):
            if t in self._draft_eos:
                drafted, complete = drafted[:k], True
                break
        if not drafted:
            return []
        text = continuation_text(self.draft_tokenizer, ids, drafted)
        if not text:
            return []
        if text.endswith("\ufffd"):
            text, complete = text.rstrip("\ufffd"), False
        tail = context[-TAIL_TOKENS:]
        tail_text = decode(self.target_tokenizer, tail)
        tokens = align_proposal(self.target_tokenizer, tail, tail_text, text, complete)
        for k, t in enumerate(tokens):  # ids the target has no output row for are never proposed
            if not 0 <= t < self.vocab_size:
                return tokens[:k]
        return tokens


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n
