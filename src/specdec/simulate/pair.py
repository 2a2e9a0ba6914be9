"""The simulated model pair the engine's step runs on (``specdec.engine.Engine``, no torch, no models).

``World``: what is true about a run's requests. A request's prompt names it (every prompt token is
``1 + index``), and it has a hidden *true* continuation: the token at output position ``p`` is a fixed
function of (seed, request, p), EOS exactly at the request's ``length`` (where it would stop by itself) and
nowhere else. The true continuation plays the target's greedy output.

``SimTarget``: the engine's ``TargetSide``. It verifies greedily: a draft token is accepted iff it is the true
token at its position, and the step's last token is the true token after the accepted ones; so the output is
the true continuation whatever the policy drafts (lossless by construction, as greedy speculation is).

``SimDrafter``: a ``Drafter`` running the engine's ``lockstep`` loop. At draft depth k of a step that starts at
output position ``start`` it draws from the request's own acceptance stream, with the workload's
``AcceptanceProcess.rate(req, start, k)``, whether its token is the true one (else a wrong one), and the
token's confidence from ``draft_confidence``.

``SimClock``: the engine's clock, virtual: time passes only when the pair charges it from the cost model
(prefill by prompt tokens, the target pass by its rows, each lockstep draft forward by the sequences in it;
the driver charges the rest of each step), each charge with the model's jitter from a seeded stream.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

from specdec.drafters.base import Draft, DraftAsk, Drafter, Pick, lockstep
from specdec.errors import InvalidRequestError
from specdec.logits_rules import LogitsRules, RulesState
from specdec.output_format import FormatMatcher
from specdec.records import Verdict, correction_kind
from specdec.sampling_params import SamplingParams, TokenLogprob
from specdec.simulate.costs import CostModel
from specdec.simulate.processes import AcceptanceProcess, SimRequest, draft_confidence
from specdec.target_side import Cache, TargetSide, Verifying

EOS = 0
VOCAB = 1 << 30  # true tokens are even ids in [2, VOCAB); a wrong draft token is the true one + 1


class SimClock:
    """Virtual seconds for the engine (``Engine(clock=...)``), charged from a cost model.

    ``batched``: a step's passes are priced by the batched cost model (a target pass by its total rows,
    ``verify_rows``; a draft forward by its sequences, ``draft_forward``; the rest by sequences,
    ``step_other``), else by the one-request figures (``verify`` of a block, ``draft_per_token_s`` per
    forward, ``other_s`` per step). ``rng`` draws the jitter; a driver may swap it (one stream per request).
    """

    def __init__(self, cost: CostModel, rng: random.Random, batched: bool = False) -> None:
        self.cost, self.rng, self.batched = cost, rng, batched
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def _charge(self, seconds: float) -> None:
        self.now += self.cost.noisy(seconds, self.rng)

    def wait_until(self, t: float) -> None:
        """Idle (no work, no jitter) until ``t``."""
        self.now = max(self.now, t)

    def prefill(self, tokens: int) -> None:
        self._charge(self.cost.prefill_per_token_s * tokens)

    def target_pass(self, rows: int) -> None:
        self._charge(self.cost.verify_rows(rows) if self.batched else self.cost.verify(rows))

    def draft_forwards(self, sequences: Sequence[int]) -> None:
        """One charge for a step's lockstep draft forwards (``sequences``: how many ran in each)."""
        if self.batched:
            self._charge(sum(self.cost.draft_forward(n) for n in sequences))
        else:
            self._charge(len(sequences) * self.cost.draft_per_token_s)

    def rest(self, sequences: int) -> None:
        """The rest of a step shared by ``sequences`` sequences: policy, bookkeeping, commits."""
        self._charge(self.cost.step_other(sequences) if self.batched else self.cost.other_s)


class World:
    """A run's requests, their acceptance process and their true continuations (see the module)."""

    def __init__(self, process: AcceptanceProcess, requests: Sequence[SimRequest], seed: int) -> None:
        self.process, self.seed = process, seed
        self.requests = {req.index: req for req in requests}

    def prompt(self, req: SimRequest) -> list[int]:
        return [1 + req.index] * req.prompt_len

    def request_of(self, prompt_ids: Sequence[int]) -> SimRequest:
        return self.requests[prompt_ids[0] - 1]

    def token(self, req: SimRequest, pos: int) -> int:
        """The true token at output position ``pos`` (0-based) of ``req``."""
        if pos == req.length:
            return EOS
        return 2 + 2 * (hash((self.seed, req.index, pos)) % (VOCAB // 2 - 1))

    def accept_stream(self, req: SimRequest) -> random.Random:
        """The request's acceptance draws: seeded per (seed, request), so every policy meets the same stream
        where its choices coincide with another's."""
        return random.Random(f"{self.seed}/{req.index}/accept")


class NoText:
    """The simulator's tokenizer: tokens have no text (no stop strings; the engine's decoder yields "")."""

    eos_token_id = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


@dataclass
class SimCache:
    """A sequence's target cache: how many tokens it holds (the engine crops it as a ``KVCache``)."""

    req: SimRequest
    length: int

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")
        self.length = length


class SimTarget(TargetSide):
    """The engine's target side in the simulator: greedy verification against the true continuation."""

    vocab_size = VOCAB
    max_context = VOCAB
    eos_token_ids = frozenset({EOS})

    def __init__(self, world: World, clock: SimClock) -> None:
        self.world, self.clock = world, clock

    def mode(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def generator(self, params: SamplingParams) -> None:
        if not params.greedy:
            raise InvalidRequestError("the simulator verifies greedy requests only", "temperature")
        return None  # the drafts' draws come from each request's acceptance stream (``World.accept_stream``)

    def rules_state(
        self, rules: LogitsRules, prompt_ids: list[int], eos_ids: frozenset[int], matcher: FormatMatcher | None = None
    ) -> RulesState:
        raise InvalidRequestError("the simulator has no logits for logit rules to act on", "logit_bias")

    def prefill(self, prompt_ids: list[int], defer: bool = False, reuse: bool = True) -> tuple[SimCache, int]:
        self.clock.prefill(len(prompt_ids))  # prefills now (no prefix cache): the clock charges it
        return SimCache(self.world.request_of(prompt_ids), len(prompt_ids) - 1), 0

    def fork(self, cache: Cache, prompt_ids: list[int]) -> SimCache:
        held = cast(SimCache, cache)
        return SimCache(held.req, held.length)

    def release(self, cache: Cache, tokens: list[int]) -> None:
        pass

    def verify(
        self,
        live: Sequence[Verifying],
        drafts: Sequence[Draft],
        fills: Sequence[tuple[Verifying, int]] = (),
        chains: Sequence[int] | None = None,  # not chained here (``chains_plain`` is False): one pass a step
    ) -> tuple[list[Verdict], list[list[TokenLogprob] | None]]:
        if fills:
            raise ValueError("the simulated target prefills at once: it has no prompt pieces to take in")
        verdicts, rows = [], 0
        for g, d in zip(live, drafts):
            if g.logprobs is not None:
                raise InvalidRequestError("the simulator has no log probabilities", "logprobs")
            cache = cast(SimCache, g.cache)
            start = len(g.context) - len(g.prompt_ids)
            true = [self.world.token(cache.req, start + j) for j in range(len(d.tokens) + 1)]
            flags = [t == y for t, y in zip(d.tokens, true)]
            n = flags.index(False) if False in flags else len(flags)
            verdicts.append(Verdict(flags, n, [*d.tokens[:n], true[n]], correction_kind(len(flags), n), [], []))
            cache.length += len(d.tokens) + 1
            rows += len(d.tokens) + 1
        self.clock.target_pass(rows)  # ONE pass over every sequence's block
        return verdicts, [None] * len(live)


@dataclass
class _DraftState:
    """A sequence's drafting state: its request and acceptance stream, known once its prompt is prefilled."""

    req: SimRequest | None = None
    rng: random.Random | None = None


class SimDrafter(Drafter):
    """Drafts through the engine's ``lockstep`` loop; each token is the true one with the process's rate."""

    name = "simulated"
    vocab_size = VOCAB

    def __init__(self, world: World, clock: SimClock) -> None:
        self.world, self.clock = world, clock

    def new_state(self) -> _DraftState:
        return _DraftState()

    def prefill(self, state: _DraftState, prompt: list[int]) -> None:
        state.req = self.world.request_of(prompt)
        state.rng = self.world.accept_stream(state.req)

    def propose(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        states = [cast(_DraftState, ask.state) for ask in asks]
        depth = [0] * len(asks)
        forwards: list[int] = []  # sequences in each lockstep draft forward

        def forward(rows: list[int], *_: Any) -> list[Pick]:
            forwards.append(len(rows))
            picks = []
            for i in rows:
                req, rng = states[i].req, states[i].rng
                assert req is not None and rng is not None, "a sequence drafted before its prefill"
                start = len(asks[i].context) - req.prompt_len
                depth[i] += 1
                ok = rng.random() < self.world.process.rate(req, start, depth[i])
                true = self.world.token(req, start + depth[i] - 1)
                conf = draft_confidence(ok, rng)
                picks.append(Pick(true if ok else true + 1, conf, conf))
            return picks

        drafts = lockstep(asks, forward, forward)
        if forwards:
            self.clock.draft_forwards(forwards)
        return drafts
