"""A small draft model sharing the target's vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from specdec.drafters.base import Draft, DraftAsk, Drafter, Pick, lockstep
from specdec.runtime.base import KVCache, ModelRunner, token_tensor
from specdec.runtime.prefix_cache import BLOCK
from specdec.sampling import SamplingParams


@dataclass
class DraftModelState:
    cache: KVCache  # holds the first ``cache.length`` tokens of the request's context (and drafts being made)


class ModelDrafter(Drafter):
    name = "model"
    catches_up = True

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: draft distributions are padded/cut to it

    def new_state(self) -> DraftModelState:
        return DraftModelState(cache=self.runner.new_cache())

    def prefill(self, state: DraftModelState, prompt: list[int]) -> None:
        # Like the target: the cache holds all but the last prompt token, which the first draft feeds; what the
        # runner's prefix cache holds of it is copied, not computed.
        reused = self._resume(state, prompt, len(prompt) - 1)
        if len(prompt) - 1 > reused:
            ids = token_tensor(prompt[reused:-1], self.runner.device)
            self.runner.forward(ids, state.cache, last_only=True)
            self.runner.keep_prefix(state.cache, prompt[:-1])  # for requests arriving while this one runs

    def _resume(self, state: DraftModelState, tokens: list[int], end: int) -> int:
        """A cache a block or more behind ``tokens[:end]`` (a prompt not yet taken in: not a step's catch-up of a token
        or two) is extended from the runner's longest kept prefix of them; the cache's length after. ``tokens`` is
        sliced only then: a step's catch-up calls this for every sequence, whose contexts only grow."""
        if end - state.cache.length >= BLOCK:
            return self.runner.reuse_prefix(state.cache, tokens[:end])
        return state.cache.length

    def keep(self, state: DraftModelState, tokens: Sequence[int]) -> None:
        self.runner.keep_prefix(state.cache, tokens)

    def take_in(self, items: Sequence[tuple[DraftModelState, list[int], int, int]]) -> None:
        for state, context, start, n in items:
            self._resume(state, context, start + n)
        blocks = [
            (context[state.cache.length : start + n], state.cache)
            for state, context, start, n in items
            if state.cache.length < start + n
        ]
        if blocks:
            self.runner.forward_blocks(blocks, keep=[0] * len(blocks))  # caches filled, no logits wanted

    def fork(self, state: DraftModelState, prompt: list[int]) -> DraftModelState:
        return DraftModelState(cache=self.runner.fork_cache(state.cache, prompt[: state.cache.length]))

    def rollback(self, state: DraftModelState, length: int) -> None:
        state.cache.crop(min(state.cache.length, length))

    def release(self, state: DraftModelState, tokens: Sequence[int] = ()) -> None:
        self.runner.release(state.cache, tokens)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # Checkpoints often pad their embedding matrix; rows beyond the shared tokenizer are never valid tokens.
        v = self.vocab_size
        if logits.shape[-1] > v:
            return logits[..., :v]
        if logits.shape[-1] < v:
            pad = logits.new_full((*logits.shape[:-1], v - logits.shape[-1]), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def propose(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        if self.runner.drafts_natively and all(a.params.greedy and a.logit_rules is None for a in asks):
            return self._propose(asks)  # every draft in the kernel: no tensor work here, no inference_mode (~10 µs)
        with torch.inference_mode():
            return self._propose(asks)

    def _propose(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        device = self.runner.device
        drafted: dict[int, list[int]] = {}  # each sequence's tokens drafted so far this step (for logit rules)
        # Greedy sequences without logit rules, on a runner whose kernel drafts (``draft_greedy``): their whole
        # draft is made by one kernel call in ``first`` (the loop's stop rules evaluated there too), and ``feed``
        # hands the loop the tokens already drafted, so the loop's decisions are the same, without a Python round
        # trip per token.
        native = self.runner.drafts_natively
        ahead: dict[int, list[Pick]] = {}
        fed: dict[int, int] = {}

        def catch_up(i: int) -> tuple[list[int], KVCache]:
            drafted[i] = []
            ask = asks[i]
            context, cache = ask.context, ask.state.cache
            n = len(context)
            self._resume(ask.state, context, n - 1)
            if cache.length >= n:  # at least one token must be fed to get the next distribution
                cache.crop(n - 1)
            start = cache.length
            fed[i] = n - start
            return context[start:], cache

        def first(rows: list[int]) -> list[Pick]:
            # In the kernel: greedy and temperature-only requests without logit rules (a sampled one's tokens drawn
            # there from its own generator's uniforms, its distributions written there: ``draft_rows``).
            fast = [
                i
                for i in rows
                if native
                and asks[i].logit_rules is None
                and (asks[i].params.greedy or (_temperature_only(asks[i].params) and asks[i].generator is not None))
            ]
            in_kernel = set(fast)
            slow = [i for i in rows if i not in in_kernel]
            picks: dict[int, Pick] = {}
            if fast:
                pending = [catch_up(i) for i in fast]
                rules = [r.as_numbers() if (r := asks[i].rule) is not None else None for i in fast]
                vocab_used = min(self.vocab_size, int(self.runner.vocab_size))
                temps = None  # every one greedy
                if not all(asks[i].params.greedy for i in fast):
                    temps = [
                        0.0 if asks[i].params.greedy else cast(SamplingParams, asks[i].params).temperature for i in fast
                    ]
                gens = [asks[i].generator for i in fast]
                taus = [asks[i].tau for i in fast]
                tokens, tops, probs, dists = self.runner.draft_rows(pending, taus, rules, vocab_used, temps, gens)
                for i, toks, ts, ps, q in zip(fast, tokens, tops, probs, dists):
                    if q is not None and q.shape[-1] < self.vocab_size:  # (a draft of fewer tokens than ours)
                        q = torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[-1]))
                    ahead[i] = [
                        Pick(t, p, top, None if q is None else q[k]) for k, (t, p, top) in enumerate(zip(toks, ps, ts))
                    ]
                    picks[i] = ahead[i][0]
            if slow:
                blocks = [(token_tensor(ids, device), cache) for ids, cache in map(catch_up, slow)]
                logits = self.runner.forward_batch(blocks, last_only=True)
                picks.update(zip(slow, self._pick(asks, slow, logits, drafted)))
            return [picks[i] for i in rows]

        def feed(rows: list[int], tokens: list[int]) -> list[Pick]:
            for i, t in zip(rows, tokens):
                drafted[i].append(t)
            slow = [i for i in rows if i not in ahead]
            picks = {i: ahead[i][len(drafted[i])] for i in rows if i in ahead}
            if slow:
                blocks = [(token_tensor([drafted[i][-1]], device), asks[i].state.cache) for i in slow]
                picks.update(
                    zip(slow, self._pick(asks, slow, self.runner.forward_batch(blocks, last_only=True), drafted))
                )
            return [picks[i] for i in rows]

        drafts = lockstep(asks, first, feed)
        for i, n in fed.items():
            drafts[i].fed = n
        return drafts

    def _pick(
        self,
        asks: Sequence[DraftAsk],
        rows: list[int],
        logits: list[torch.Tensor],
        drafted: dict[int, list[int]] | None = None,
    ) -> list[Pick]:
        """Each row's next draft token. Greedy rows: one softmax and one max over all of them (the token and
        its probability); sampled rows: q under the request's settings, drawn with its own generator. A request
        with logit rules has them applied first, with this position's own context (context + drafted)."""
        logits = list(logits)
        for j, i in enumerate(rows):
            state = asks[i].logit_rules
            if state is not None:
                done = drafted.get(i, []) if drafted is not None else []
                logits[j] = state.apply(self._fit_vocab(logits[j][-1:]), done, offset=len(done))
        picks: list[Pick | None] = [None] * len(rows)
        greedy = [j for j, i in enumerate(rows) if asks[i].params.greedy]
        if greedy:
            block = self._fit_vocab(torch.cat([logits[j][-1:] for j in greedy])).float()
            top, token = torch.softmax(block, -1).max(-1)
            for j, p, t in zip(greedy, top.tolist(), token.tolist()):
                picks[j] = Pick(t, p, p)
        # Sampled rows: processed together where their requests' settings are alike (``probs_by_settings``), each
        # drawn with its request's generator.
        sampled = [j for j in range(len(rows)) if picks[j] is None]
        if sampled:
            settings = [asks[rows[j]].params for j in sampled]
            assert all(isinstance(p, SamplingParams) for p in settings)
            ys, ps, tops, q = self.runner.draw_rows(
                [self._fit_vocab(logits[j][-1:]) for j in sampled],
                cast(list[SamplingParams], settings),
                [asks[rows[j]].generator for j in sampled],
            )
            for n, (j, y) in enumerate(zip(sampled, ys)):
                picks[j] = Pick(y, ps[n], tops[n], q[n])
        return [p for p in picks if p is not None]


def _temperature_only(params: object) -> bool:
    """Whether a request samples with a temperature alone (its draft can be drawn in the kernel: ``draft_rows``)."""
    return isinstance(params, SamplingParams) and params.temperature_only
