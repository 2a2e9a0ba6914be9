"""A small draft model sharing the target's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.drafters.base import Draft, Drafter, ReachRule
from specdec.runtime.base import KVCache, ModelRunner
from specdec.sampling import SamplingParams, logits_to_probs, sample


@dataclass
class DraftModelState:
    cache: KVCache
    held: list[int] = field(default_factory=list)  # token ids whose keys/values are in the cache


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, by list-slice comparisons (C loops) and bisection: the
    sequences share all but their last few tokens, so this is a few comparisons, not a Python loop."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: draft distributions are padded/cut to it

    def new_state(self) -> DraftModelState:
        return DraftModelState(cache=self.runner.new_cache())

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # Checkpoints often pad their embedding matrix; rows beyond the shared tokenizer are never valid tokens.
        v = self.vocab_size
        if logits.shape[-1] > v:
            return logits[..., :v]
        if logits.shape[-1] < v:
            pad = logits.new_full((*logits.shape[:-1], v - logits.shape[-1]), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    @torch.inference_mode()
    def propose(
        self,
        state: DraftModelState,
        context: list[int],
        tau: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float | None = None,
        reach_rule: ReachRule | None = None,
    ) -> Draft:
        # Roll back to the longest prefix shared with the verified context, then catch up on
        # what was verified since (e.g. held = c + [a, b, x], context = c + [a, b, y]: keep c+[a, b], feed y).
        keep = _common_prefix(state.held, context)
        keep = min(keep, len(context) - 1)  # at least one token must be fed to get the next distribution
        state.cache.crop(keep)
        device = self.runner.device
        feed = torch.tensor(context[keep:], dtype=torch.long, device=device)
        state.held = list(context)
        logits = self.runner.forward(feed, state.cache, last_only=True)[-1]
        if params.greedy:
            return self._propose_greedy(state, logits, tau, min_confidence, reach_rule)
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        confidence: list[float] = []
        reach = 1.0
        for t in range(tau):  # sampled (greedy requests took the fast path above)
            q = logits_to_probs(self._fit_vocab(logits)[None], params)[0]
            top = float(q.max().item()) if min_confidence is not None or reach_rule is not None else 0.0
            if min_confidence is not None and top < min_confidence:
                break
            y = sample(q[None], generator)
            tokens.append(y)
            probs.append(q)
            confidence.append(top)
            if reach_rule is not None:  # judged by q(ŷ), the probability of the token drawn, as records carry it
                reach = reach_rule.reach(reach, float(q[y]))
                if not reach_rule.go_on(reach, len(tokens)):
                    break
            if t + 1 < tau:
                logits = self.runner.forward(y, state.cache, last_only=True)[-1]
                state.held.append(int(y.item()))
        if not tokens:
            empty = torch.empty(0, dtype=torch.long, device=device)
            return Draft(empty, torch.empty(0, self.vocab_size, device=device), [])
        return Draft(torch.cat(tokens), torch.stack(probs), confidence)

    def _propose_greedy(
        self,
        state: DraftModelState,
        logits: torch.Tensor,
        tau: int,
        min_confidence: float | None,
        reach_rule: ReachRule | None,
    ) -> Draft:
        """Greedy drafting with the least work per token: one softmax and one max (the top probability, for
        confidence stops and the policies, and its token); no [τ, V] distributions, which greedy verification
        never reads."""
        tokens: list[int] = []
        confidence: list[float] = []
        reach = 1.0
        for t in range(tau):
            top_t, y_t = torch.softmax(self._fit_vocab(logits).float(), -1).max(0)  # two small ops per token
            top, y = float(top_t), int(y_t)
            if min_confidence is not None and top < min_confidence:
                break
            tokens.append(y)
            confidence.append(top)
            if reach_rule is not None:
                reach = reach_rule.reach(reach, top)
                if not reach_rule.go_on(reach, len(tokens)):
                    break
            if t + 1 < tau:
                ids = torch.tensor([y], dtype=torch.long, device=self.runner.device)
                logits = self.runner.forward(ids, state.cache, last_only=True)[-1]
                state.held.append(y)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.runner.device), None, confidence)
