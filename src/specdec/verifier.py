"""The engine's target side over a model (``Engine`` makes one for a ``ModelRunner``): the prefill, and the one
verify pass of a step with the acceptance rule, the logit rules and log probabilities. The torch half of the
step: ``specdec.engine`` plans, drafts, commits and records without torch, so the simulator can run it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch

from specdec.drafters.base import Draft
from specdec.logits_rules import LogitsRules, RulesState
from specdec.output_format import FormatMatcher
from specdec.records import Verdict, correction_kind
from specdec.runtime.base import KVCache, ModelRunner, eos_ids_of, token_tensor
from specdec.runtime.prefix_cache import BLOCK
from specdec.sampling import SamplingParams, TokenLogprob, probs_by_settings, token_logprobs
from specdec.target_side import Cache, TargetSide, Verifying
from specdec.verify import SampledBlock, verdict_greedy, verify_blocks

# Uniforms a request's draws without a draft take from its generator at a time (``_uniforms``).
UNIFORMS_AHEAD = 64
PROMPT_SCORE_CHUNK = 256  # prompt rows a pass scores (``prompt_logprobs``): 256 vocabulary rows of logits at most


class ModelTarget(TargetSide):
    """A ``ModelRunner`` as the engine's target side; EOS ids: the model's and its tokenizer's."""

    chains_plain = True

    def __init__(self, runner: ModelRunner, tokenizer: Any) -> None:
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_context = runner.max_context
        self.eos_token_ids = runner.eos_token_ids | eos_ids_of(tokenizer)

    def mode(self) -> AbstractContextManager[Any]:
        return torch.inference_mode()

    def generator(self, params: SamplingParams) -> torch.Generator:
        return params.generator(self.runner.device)

    def rules_state(
        self, rules: LogitsRules, prompt_ids: list[int], eos_ids: frozenset[int], matcher: FormatMatcher | None = None
    ) -> RulesState:
        return RulesState(rules, prompt_ids, self.vocab_size, eos_ids, self.runner.device, matcher)

    def prefill(self, prompt_ids: list[int], defer: bool = False, reuse: bool = True) -> tuple[Cache, int]:
        cache = self.runner.new_cache()
        reused = self.runner.reuse_prefix(cache, prompt_ids[:-1]) if reuse else 0
        if len(prompt_ids) - 1 > reused and not defer:
            ids = token_tensor(prompt_ids[reused:-1], self.runner.device)
            self.runner.forward(ids, cache, last_only=True)
            self.runner.keep_prefix(cache, prompt_ids[:-1])  # for requests arriving while this one runs
        return cache, reused

    @property
    def prefix_block(self) -> int:  # type: ignore[override]
        return BLOCK if self.runner.prefix_cache is not None else 0

    def resume(self, cache: Cache, prompt_ids: list[int]) -> int:
        return self.runner.reuse_prefix(cast(KVCache, cache), prompt_ids[:-1])

    def keep(self, cache: Cache, tokens: list[int]) -> None:
        self.runner.keep_prefix(cast(KVCache, cache), tokens)

    def prompt_logprobs(
        self, prompt_ids: list[int], params: SamplingParams, k: int, cache: Cache | None = None
    ) -> list[TokenLogprob]:
        # The prefill of prompt_ids[:-1], in pieces of PROMPT_SCORE_CHUNK rows (each a vocabulary row of logits), into
        # the request's empty cache, or a scratch one.
        own = cache is not None and cast(KVCache, cache).length == 0
        kv = cast(KVCache, cache) if own else self.runner.new_cache()
        out: list[TokenLogprob] = []
        try:
            for start in range(0, len(prompt_ids) - 1, PROMPT_SCORE_CHUNK):
                piece = prompt_ids[start : min(start + PROMPT_SCORE_CHUNK, len(prompt_ids) - 1)]
                ids = token_tensor(piece, self.runner.device)
                logits = self.runner.forward(ids, kv, last_only=False)
                out.extend(token_logprobs(logits, prompt_ids[start + 1 : start + 1 + len(piece)], params, k))
        finally:
            if not own:
                self.runner.release(kv)
        return out

    def fork(self, cache: Cache, prompt_ids: list[int]) -> Cache:
        return self.runner.fork_cache(cast(KVCache, cache), prompt_ids[:-1])

    def release(self, cache: Cache, tokens: list[int]) -> None:
        self.runner.release(cast(KVCache, cache), tokens)

    def verify(
        self,
        live: Sequence[Verifying],
        drafts: Sequence[Draft],
        fills: Sequence[tuple[Verifying, int]] = (),
        chains: Sequence[int] | None = None,
    ) -> tuple[list[Verdict], list[list[TokenLogprob] | None]]:
        # Each block is what the sequence's cache lacks, then its draft: [context[-1], ŷ1..ŷτ] once it has stepped;
        # a request whose prefill was deferred brings its prompt into the same pass. Its last τ+1 rows are verified.
        blocks = [([*g.context[g.cache.length :], *d.tokens], cast(KVCache, g.cache)) for g, d in zip(live, drafts)]
        keep = [len(d.tokens) + 1 for d in drafts]
        # Prompt pieces of sequences not stepping yet: their rows fill their caches, no logits kept.
        pieces = [(g.context[g.cache.length : g.cache.length + n], cast(KVCache, g.cache)) for g, n in fills]
        plain = [g.params.greedy and g.rules_state is None for g in live]
        # ONE pass over all of them; where every sequence reads only its rows' argmax, the pass may skip the logits
        only_best = all(plain) and all(g.logprobs is None for g in live)
        flat = self.runner.forward_blocks(blocks + pieces, keep + [0] * len(pieces), argmax_only=only_best)
        starts = list(itertools.accumulate(keep, initial=0))
        # Greedy rows without logit rules: one argmax over the whole pass (a row's argmax is its own).
        best = self.runner.pass_argmax(flat) if any(plain) else []
        # Each sequence's rows of the pass, as its request reads them (after its logit rules); None for a plain greedy
        # one that wants no log probabilities, which reads only its argmax (a torch slice costs microseconds a
        # sequence on the caches the pass has just flushed).
        target_logits: list[torch.Tensor | None] = []
        for g, d, is_plain, lo, hi in zip(live, drafts, plain, starts, starts[1:]):
            if is_plain and g.logprobs is None:
                target_logits.append(None)
                continue
            logits = flat[lo:hi]
            if g.rules_state is not None:  # each row processed with its own context (context + the block before it)
                logits = g.rules_state.apply(logits, d.tokens)
            target_logits.append(logits)
        verdicts: list[Verdict | None] = []
        for g, d, is_plain, logits, lo, hi in zip(live, drafts, plain, target_logits, starts, starts[1:]):
            if is_plain:
                verdicts.append(verdict_greedy(d.tokens, best[lo:hi]))
            elif g.params.greedy:  # the argmax of each row (after its logit rules), then plain comparisons
                assert logits is not None
                verdicts.append(verdict_greedy(d.tokens, logits.argmax(dim=-1).tolist()))
            else:
                verdicts.append(None)
        # Sampled sequences without a draft or logit rules: one draw each from its row as the model gave it
        # (``sample_plain``, as ``verify_blocks`` draws a block without a draft).
        drawn = [
            s for s, v in enumerate(verdicts) if v is None and not drafts[s].tokens and live[s].rules_state is None
        ]
        if drawn:
            tokens = self.runner.sample_plain(
                flat, [starts[s] for s in drawn], [live[s].params for s in drawn], _uniforms([live[s] for s in drawn])
            )
            for s, token in zip(drawn, tokens):
                verdicts[s] = verdict_greedy([], [token])  # a block without a draft: its one token
        # Drafted sampled sequences without logit rules: by the runtime's own rule where it has one (the CPU kernel's
        # for a temperature-only request: one call a block, ``sampled_verdict``).
        for s, v in enumerate(verdicts):
            g, d = live[s], drafts[s]
            if v is None and d.tokens and g.rules_state is None and d.probs is not None:
                decided = self.runner.sampled_verdict(flat, starts[s], g.params, d.tokens, d.probs, g.generator)
                if decided is not None:
                    flags, n, token, ptok = decided
                    qtok = d.probs[range(len(d.tokens)), list(d.tokens)].tolist()
                    verdicts[s] = Verdict(
                        accept_flags=flags,
                        n_accepted=n,
                        tokens=[int(t) for t in d.tokens[:n]] + [token],
                        correction=correction_kind(len(d.tokens), n),
                        target_token_probs=ptok,
                        draft_token_probs=qtok,
                    )
        sampled = [s for s, v in enumerate(verdicts) if v is None]
        if sampled:  # every other sampled sequence's verdict in one go (``verify_blocks``)
            rows = [cast(torch.Tensor, target_logits[s]) for s in sampled]
            probs = probs_by_settings(rows, [live[s].params for s in sampled]).split([len(r) for r in rows])
            sampled_blocks = [_sampled_block(live[s], drafts[s], p) for s, p in zip(sampled, probs)]
            for s, v in zip(sampled, verify_blocks(sampled_blocks)):
                verdicts[s] = v
        # Emitted token j comes from row j (the correction/bonus token too: p's log probability there).
        done = cast(list[Verdict], verdicts)
        if chains is not None:
            # sequences without a draft, logit rules or log probabilities chain (greedy or sampled); the rest keep
            # their one pass
            self._chain(
                live,
                done,
                [
                    k if g.rules_state is None and g.logprobs is None and not d.tokens else 1
                    for k, g, d in zip(chains, live, drafts)
                ],
            )
        logprobs = [
            token_logprobs(logits, v.tokens, g.params, g.logprobs)
            if g.logprobs is not None and logits is not None
            else None
            for g, v, logits in zip(live, done, target_logits)
        ]
        return done, logprobs

    def _chain(self, live: Sequence[Verifying], verdicts: list[Verdict], chains: Sequence[int]) -> None:
        """The passes after a step's first for its chaining sequences (``verify``'s ``chains``: no draft, no logit
        rules, no log probabilities): one row a sequence, its last token, shared with every sequence still chaining.
        A greedy sequence's next token is the pass's argmax (the kernel takes it in the pass); a sampled one's is drawn
        from its row with the request's own generator by ``sample_plain``, as the step's first pass draws it, so its
        draws come in the same order from the same generator as in one step after another. A row's logits do not depend on
        the others in its pass, so the tokens are those of one plain step after another, without the engine's Python
        between."""
        going = [i for i, k in enumerate(chains) if k > 1]
        passes = 1
        while going:
            blocks = [([verdicts[i].tokens[-1]], cast(KVCache, live[i].cache)) for i in going]
            drawn = [j for j, i in enumerate(going) if not live[i].params.greedy]
            flat = self.runner.forward_blocks(blocks, [1] * len(going), argmax_only=not drawn)
            passes += 1
            tokens: list[int] = [0] * len(going)
            if len(drawn) < len(going):
                tokens = [int(t) for t in self.runner.pass_argmax(flat)]
            if drawn:  # as the first pass draws them (``sample_plain``)
                picked = self.runner.sample_plain(
                    flat, drawn, [live[going[j]].params for j in drawn], _uniforms([live[going[j]] for j in drawn])
                )
                for j, token in zip(drawn, picked):
                    tokens[j] = token
            for i, token in zip(going, tokens):
                verdicts[i].tokens.append(token)
                verdicts[i].passes = passes
            going = [i for i in going if chains[i] > passes]


def _uniforms(seqs: Sequence[Verifying]) -> list[float]:
    """One uniform in [0, 1) for each sequence's draw without a draft (``sample_plain``), from its request's
    generator, drawn UNIFORMS_AHEAD at a time into the request's ``uniforms`` (a torch call a draw cost ~10 µs on the
    caches a pass has just flushed: ~160 µs a 16-row pass). They are the generator's stream, each value used once, so
    a request's draws stay independent of each other and of its other draws (a draft's, a verdict's), and depend on
    nothing beside it in a step."""
    out = []
    for g in seqs:
        if not g.uniforms:
            gen = g.generator
            ahead = torch.rand(UNIFORMS_AHEAD, dtype=torch.float64, device=gen.device, generator=gen).tolist()
            ahead.reverse()  # popped from the end: the stream's order
            g.uniforms = ahead
        out.append(g.uniforms.pop())
    return out


def _sampled_block(gen: Verifying, draft: Draft, target_probs: torch.Tensor) -> SampledBlock:
    """A sampled sequence's verify block: its draft and q (``draft.probs``), p at its rows (processed)."""
    if draft.probs is None:
        if draft.tokens:  # only greedy requests may be drafted without q
            raise RuntimeError("the drafter gave no draft distributions for a sampled request")
        draft_probs = torch.empty(0, target_probs.shape[-1], device=target_probs.device)
    else:
        draft_probs = draft.probs
    return SampledBlock(list(draft.tokens), draft_probs, target_probs, gen.generator)
