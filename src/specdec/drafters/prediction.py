"""Predicted outputs (OpenAI's ``prediction`` field): a request brings text it expects much of its output to repeat
(a file being edited, a document being revised), and the steps draft from it instead of from the draft model.

Such a draft costs no draft forward, only the target rows that verify it, and it is verified like every draft: the
acceptance rule with q one-hot on the predicted token (greedy: the target's argmax or nothing; sampling: r <= p(ŷ),
the correction drawn from p with ŷ removed), so the output is the target's whatever the prediction says. A wrong
prediction costs rows, never tokens.

Where the output is in the prediction is found again at every step: where the last predicted step ended if the
output still follows the prediction there, else the longest suffix of the generated tokens (up to ``MAX_NGRAM``, at
least ``FRESH_MATCH``) that occurs in the prediction, nearest that place; at the start, the prediction's beginning.
Where it is not found (the output has left the prediction: an edited region), or the prediction offers fewer tokens
than the request's drafter would draft this step, the step drafts as the request would without a prediction (its
drafter and policy). How far a step reads ahead (``span``) doubles after a step whose prediction was accepted whole,
falls back to what was accepted after a rejection, and starts again at ``FIRST_SPAN`` where the output is found
afresh, so a good prediction is verified in long blocks and a poor one costs few rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec.drafters.base import Draft, one_hot

MAX_NGRAM = 8  # the longest generated suffix matched against the prediction
FIRST_SPAN = 8  # tokens the first predicted draft reads ahead
MAX_SPAN = 32  # the most a step reads ahead (the engine's clamp to the tokens left applies too)
MIN_SPAN = 2
# Generated tokens that must match where the output is found afresh (not where the last predicted step ended): in
# repetitive text short suffixes occur all over a prediction, and a draft read from the wrong place costs rows.
FRESH_MATCH = 4


class Prediction:
    """One sequence's predicted output and where its generated tokens stand in it."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.span = FIRST_SPAN
        self.hint = 0  # where the next generated token is expected in the prediction
        # positions j (1 <= j <= len) by the token before them, tokens[j - 1], and by the two before them: where a
        # suffix of the output can end
        self._after: dict[int, list[int]] = {}
        self._after2: dict[tuple[int, int], list[int]] = {}
        for j, t in enumerate(self.tokens, 1):
            self._after.setdefault(t, []).append(j)
            if j >= 2:
                self._after2.setdefault((self.tokens[j - 2], t), []).append(j)
        self._start = 0

    def propose(self, generated: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(limit, span)`` predicted tokens continuing ``generated`` (the output so far); [] where the
        output is not found in the prediction."""
        if limit <= 0:
            return []
        found = self._align(generated)
        if found is None:
            return []
        start, matched = found
        if start != self.hint:  # found afresh (not where the last predicted step ended): on a long enough match only
            if matched < min(FRESH_MATCH, len(generated)):
                return []
            self.span = FIRST_SPAN
        if start >= len(self.tokens):
            return []
        self._start = start
        return self.tokens[start : start + min(limit, self.span)]

    def observe(self, drafted: int, accepted: int, emitted: int) -> None:
        """The step that verified ``drafted`` predicted tokens accepted ``accepted`` and appended ``emitted`` tokens."""
        self.hint = self._start + emitted
        self.span = min(MAX_SPAN, 2 * self.span) if accepted == drafted else max(MIN_SPAN, accepted + 1)

    def _align(self, generated: Sequence[int]) -> tuple[int, int] | None:
        """The prediction position right after the longest suffix of ``generated`` it holds (ties: nearest the
        hint, at or after it first), and that suffix's length."""
        if not generated:
            return 0, 0
        longest = min(MAX_NGRAM, len(generated))
        if self._matched(self.hint, generated, longest) == longest:  # still on track: the usual step
            return self.hint, longest
        best: tuple[int, int, int] | None = None  # (-length, behind the hint, distance): the least is best
        found = None
        ends = (
            self._after2.get((generated[-2], generated[-1]), ())
            if len(generated) >= 2
            else self._after.get(generated[-1], ())
        )
        for j in ends:  # (a match found afresh needs two tokens at least once there are two)
            n = self._matched(j, generated, longest)
            key = (-n, int(j < self.hint), abs(j - self.hint))
            if best is None or key < best:
                best, found = key, (j, n)
        return found

    def _matched(self, j: int, generated: Sequence[int], longest: int) -> int:
        """How many of the last tokens of ``generated`` (up to ``longest``) end at prediction position ``j``."""
        if j > len(self.tokens):  # past the prediction's end (the last step's hint may be)
            return 0
        n = 0
        while n < longest and n < j and self.tokens[j - 1 - n] == generated[-1 - n]:
            n += 1
        return n


def predicted_draft(tokens: list[int], params: Any, vocab_size: int) -> Draft:
    """A draft read from a prediction: q one-hot on each token (built for sampled requests only; greedy verification
    reads none), the draft's probability of its token and its confidence 1."""
    probs = None
    if not params.greedy:
        import torch  # here: the engine loads without torch (the simulator's), which has no predictions

        probs = one_hot(tokens, vocab_size, torch.device("cpu"))
    return Draft(list(tokens), probs, [1.0] * len(tokens), [1.0] * len(tokens))
