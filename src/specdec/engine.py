"""The speculative decoding step, for one request or many: draft, verify once, commit, observe.

``Engine.start`` validates and prefills a request and returns its ``Generation`` (its caches, its
generator, its stops). ``Engine.step(generations)`` advances any number of them by one step that they
share: the drafter drafts for all of them in lockstep, the target runs **one** pass over every
sequence's block, and each is verified with its own settings and generator. One request alone is the
same step with one sequence (``Generation.step``); ``generate`` and ``stream`` are loops over it.

Everything the step does with the target model (prefill, the verify pass, the acceptance rule, log
probabilities) goes through a ``TargetSide``: ``specdec.verifier.ModelTarget`` over a ``ModelRunner``, or the
simulator's (``specdec.simulate.pair``), which verifies against a hidden continuation on a virtual clock. So
this module imports no torch, and the simulator runs this very step: planning, the τ clamp, the verification
cap and allowances, commits, finish rules and records are written once, here.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, cast

from specdec.drafters.base import Draft, DraftAsk, Drafter
from specdec.drafters.prediction import Prediction, predicted_draft
from specdec.errors import ContextLengthError, InvalidRequestError
from specdec.logits_rules import LogitsRules
from specdec.output_format import Formats, OutputFormat
from specdec.policy import Decision, Policy, StepContext, make_policy, request_policy
from specdec.policy.base import MeasuredCosts
from specdec.records import (
    JOINED_REASON,
    PREDICTION_REASON,
    FinishReason,
    GenerationStats,
    RequestSummary,
    StepRecord,
    Verdict,
)
from specdec.sampling_params import SamplingParams, TokenLogprob
from specdec.target_side import Cache, TargetSide
from specdec.text import OutputText, fast_encoder

log = logging.getLogger("specdec.engine")

if TYPE_CHECKING:
    import torch

    from specdec.runtime.base import ModelRunner

# A batching server's prompt budget per step (``Engine.prefill_in_step``): 256 prompt rows add about what a
# 16-sequence batch's step costs (a ~25 ms pass on 2 cores).
DEFAULT_PREFILL_IN_STEP = 256
# A batching server's chain of target passes per plain step (``Engine.chain_plain``): at 16 sequences on a Zen 4, four
# passes a step made 1.15x the tokens of one in process and 1.1-1.4x through a server (docs/server.md, session 80).
DEFAULT_CHAIN_PLAIN = 4


class Observer(Protocol):
    """Receives every record the engine produces (traces, metrics)."""

    def on_step(self, record: StepRecord) -> None: ...

    def on_request(self, summary: RequestSummary) -> None: ...


@dataclass
class StepEvent:
    record: StepRecord
    text: str  # new text this step made final (held back: partial UTF-8 and possible stop-string prefixes)
    finished: bool
    # The tokens committed this step (``record.emitted``) with their log probabilities, when the request
    # asked for ``logprobs``; None otherwise.
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]  # generated tokens only (EOS and anything after a stop string excluded)
    prompt_ids: list[int]
    stats: GenerationStats
    records: list[StepRecord] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when the request asked for them
    # prompt_ids[1:] scored by the target (``start(prompt_logprobs=k)``): what an echo with logprobs reports
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finish_reason(self) -> FinishReason:
        return self.stats.finish_reason

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": len(self.prompt_ids),
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_json(),
            **({"logprobs": [lp.to_json() for lp in self.logprobs]} if self.logprobs is not None else {}),
        }


def check_request(
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    max_verify_passes: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> tuple[SamplingParams, list[str]]:
    """A request's settings that need no model, checked (``InvalidRequestError`` naming the field), as
    ``Engine.start`` names them: its sampling settings and its stop strings as a list. ``Engine.start`` checks a
    request with it; a command checks its flags with it before its models load (seconds for the default pair, ~20 s
    for a 1B checkpoint), so a bad one is the same error at once."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    scoring_only = max_new_tokens == 0 and prompt_logprobs is not None  # the prompt scored, nothing generated
    if (
        not isinstance(max_new_tokens, int)
        or isinstance(max_new_tokens, bool)
        or max_new_tokens < int(not scoring_only)
    ):
        raise InvalidRequestError(
            f"max_new_tokens must be a positive integer (0 only with prompt_logprobs), got {max_new_tokens}",
            "max_new_tokens",
        )
    if max_verify_passes is not None and (not isinstance(max_verify_passes, int) or max_verify_passes <= 0):
        raise InvalidRequestError(
            f"max_verify_passes must be a positive integer, got {max_verify_passes}", "max_verify_passes"
        )
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InvalidRequestError(f"{name} must be an integer >= 0 or None, got {value!r}", name)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidRequestError("stop strings must be non-empty strings", "stop")
    return params, stops


class Engine:
    """Runs requests on a target (a ``ModelRunner``, or a whole ``TargetSide``: the simulator's) with an optional
    drafter. ``clock`` gives every time the records and stats hold (the simulator's is virtual)."""

    def __init__(
        self,
        target: ModelRunner | TargetSide,
        tokenizer: Any,
        drafter: Drafter | None = None,
        policy: Policy | None = None,
        observers: Sequence[Observer] = (),
        max_context: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.side: TargetSide
        if isinstance(target, TargetSide):
            self.side = target
        else:
            from specdec.verifier import ModelTarget  # torch: only where a model runs

            self.side = ModelTarget(target, tokenizer)
        # The model, which the server, tune and audit read; an engine made on a bare target side (the simulator's)
        # has no model, and there this is that side.
        self.target = cast("ModelRunner", target)
        self.tokenizer = tokenizer
        self._encode = fast_encoder(tokenizer)  # the tokenizers library's encode, where it gives the wrapper's ids
        self.drafter = drafter
        self.policy = policy or make_policy("fixed")
        self.observers: list[Observer] = list(observers)
        self.max_context = max_context or self.side.max_context
        self.clock = clock
        self._named_policies: dict[str, Policy] = {self.policy.name: self.policy}
        self.eos_ids = self.side.eos_token_ids
        # Output formats (``start(response_format=...)``): the vocabulary prepared for them on the first one.
        self.formats = Formats(tokenizer, self.side.vocab_size, self.eos_ids)
        self._measured = MeasuredCosts()
        # Seconds of every request's prefill so far: a request's step record leaves out the prefills that ran
        # between its steps (requests admitted meanwhile: their passes, not this step's overhead).
        self.prefill_seconds = 0.0
        # Seconds of the policies' own work so far (their plans and their learning): a record's ``policy_time``, the
        # part of its rest that was the policy's, is what this ran up between the request's steps.
        self.policy_seconds = 0.0
        # Prompt tokens the steps take in, at most, each: with a budget, prompts skip a prefill pass of their own and
        # the batch's steps take them in, in the passes they share with the other sequences (one stream of the
        # weights for all, and a long prompt in pieces rather than one long stall). The server sets it when it
        # batches; 0: every prompt is prefilled at ``start``.
        self.prefill_in_step = 0
        # Target passes a plain sequence's step may chain (1: one pass a step, every sequence): with k > 1 a sequence
        # that drafts nothing and has no logit rules or log probabilities steps k passes, each pass's token (its
        # argmax, or its draw with the request's generator) the next one's row, before the step's commit and records
        # (one record of k tokens and k target passes), up to its remaining tokens, context and verification budget. The engine's Python between
        # two passes is then paid once per k. Only a step where no sequence drafts chains (``_chains``); the adaptive
        # policy prices a plain batch plan as that step (``StepContext.chain``).
        self.chain_plain = 1
        self.costs_note = "batch costs learnt from steps"  # where the policies' batch cost curves start from

    @property
    def measured_costs(self) -> MeasuredCosts:
        """The measured batch costs the engine's policies were primed with (``prime``; empty: none)."""
        return self._measured

    def prime(self, costs: MeasuredCosts) -> None:
        """Measured batch costs for every policy the engine has or will make (``Policy.prime``)."""
        self._measured = costs
        for policy in self._named_policies.values():
            policy.prime(costs)

    # -- public API -------------------------------------------------------------------------

    def start(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        tau: int | None = None,
        policy: str | Policy | None = None,
        stop: str | Sequence[str] | None = None,
        max_verify_passes: int | None = None,
        request_id: str | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        response_format: OutputFormat | Mapping[str, Any] | None = None,
        logprobs: int | None = None,
        fork_of: Generation | None = None,
        defer_prefill: bool | None = None,
        prediction: str | Sequence[int] | None = None,
        prompt_logprobs: int | None = None,
    ) -> Generation:
        """Validate a request and prefill it; advance it with ``Generation.step()`` or ``Engine.step``.

        ``tau=N`` is the fixed policy ``fixed:tau=N`` (an error with any other ``policy``). ``fork_of`` (used by
        ``start_many``): a Generation of the same prompt that has not stepped yet, whose caches are copied
        instead of prefilling the prompt again. ``defer_prefill``: the prompt is taken in by the steps (the passes
        shared with the other sequences; up to ``Engine.prefill_in_step`` prompt tokens per step, a longer prompt in
        pieces before the request's first step) rather than by a pass of its own now; None: when the engine has a
        prompt budget (``prefill_in_step`` > 0).
        Penalties, ``logit_bias``, ``min_tokens`` and ``ignore_eos``: see ``specdec.logits_rules`` (each
        position of a verify block is processed with its own context, so the output is target-only decoding
        with the same rules). ``response_format``: the format the output follows (``specdec.output_format``: an
        ``OutputFormat``, or OpenAI's ``{"type": "json_object"}`` / ``{"type": "json_schema", "json_schema": {...}}``,
        or ``{"type": "regex" | "choice" | "grammar", ...}``), enforced on target and draft at every position, so the
        output is target-only decoding under the same format. ``logprobs=k``: each emitted token's log probability
        under the target's processed distribution and its ``k`` most likely alternatives (``GenerationResult.logprobs``,
        ``StepEvent.logprobs``).
        ``prediction``: text (or token ids) the output is expected to repeat much of (OpenAI's predicted outputs);
        steps draft from it where the output is found in it (``specdec.drafters.prediction``), with or without a
        drafter (not with ``tau=0``); the output is the same either way. ``prompt_logprobs=k``: each prompt token
        after the first scored by the target given the ones before it, with its ``k`` likeliest alternatives
        (``GenerationResult.prompt_logprobs``; from the prompt's prefill, run with its logits kept).
        """
        params, stops = check_request(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            stop=stop,
            max_verify_passes=max_verify_passes,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        rules = LogitsRules.checked(
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=logit_bias,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            response_format=response_format,
            vocab_size=self.side.vocab_size,
            max_new_tokens=max_new_tokens,
        )
        prompt_ids = self.encode(prompt)
        if len(prompt_ids) + max_new_tokens > self.max_context:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
                f"window of {self.max_context} tokens",
                "max_new_tokens" if len(prompt_ids) < self.max_context else "prompt",
            )
        predicted = self._prediction(prediction) if tau != 0 else None  # tau=0: plain target decoding, no drafts
        if tau is not None and tau and self.drafter is None:
            raise InvalidRequestError(f"tau={tau} needs a drafter: load a draft model or enable prompt lookup", "tau")
        if isinstance(policy, Policy):
            if tau is not None:
                raise InvalidRequestError(f"tau={tau} cannot be combined with a policy object", "tau")
            chosen = policy
        else:
            spec = request_policy(policy, tau)
            chosen = self.policy if spec is None else self.get_policy(spec)
        return Generation(
            self,
            prompt_ids,
            params,
            chosen,
            stops,
            max_new_tokens,
            max_verify_passes,
            request_id or uuid.uuid4().hex[:16],
            rules,
            logprobs,
            fork_of=fork_of,
            defer_prefill=fork_of is None and (self.prefill_in_step > 0 if defer_prefill is None else defer_prefill),
            prediction=predicted,
            prompt_logprobs=prompt_logprobs,
        )

    def _prediction(self, prediction: str | Sequence[int] | None) -> Prediction | None:
        if prediction is None:
            return None
        if isinstance(prediction, str):
            ids = list(self.tokenizer(prediction, add_special_tokens=False)["input_ids"]) if prediction else []
        else:
            ids = self._in_vocab([int(t) for t in prediction], "prediction")
        return Prediction(ids) if ids else None

    def start_many(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        n: int,
        *,
        seed: int | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> list[Generation]:
        """``n`` independent samples of one prompt, prefilled **once**: the others start from copies of the first
        one's caches (``ModelRunner.fork_cache``, ``Drafter.fork``). Advance them together with ``Engine.step``.

        Sample j has request id ``<request_id>-<j>`` (just ``request_id`` when n is 1) and its own generator:
        with ``seed`` s, sample 0 is seeded with s (what ``start`` gives) and sample j with ``sample_seed(s, j)``,
        so the whole set is reproducible; without one, each draws fresh entropy. Greedy samples are all the
        same sequence. Other keyword arguments as for ``start``.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be a positive integer, got {n!r}", "n")
        rid = request_id or uuid.uuid4().hex[:16]
        if n == 1:
            return [self.start(prompt, seed=seed, request_id=rid, **kwargs)]
        if kwargs.get("max_new_tokens") == 0:  # the prompt scored only: finished at once, nothing to fork
            return [self.start(prompt, seed=sample_seed(seed, j), request_id=f"{rid}-{j}", **kwargs) for j in range(n)]
        first = self.start(prompt, seed=seed, request_id=f"{rid}-0", defer_prefill=False, **kwargs)  # forked below
        gens = [first]
        try:
            for j in range(1, n):
                sample = self.start(
                    first.prompt_ids, seed=sample_seed(seed, j), request_id=f"{rid}-{j}", fork_of=first, **kwargs
                )
                gens.append(sample)
        except BaseException:
            for g in gens:
                g.cancel()
            raise
        return gens

    def generate(self, prompt: str | Sequence[int] | torch.Tensor, **kwargs: Any) -> GenerationResult:
        """Run a request to completion. Keyword arguments as for ``start``."""
        gen = self.start(prompt, **kwargs)
        for _ in gen:
            pass
        return gen.result()

    def stream(self, prompt: str | Sequence[int] | torch.Tensor, **kwargs: Any) -> Iterator[str]:
        """Yield text pieces as tokens are verified (never a draft token that might be rejected)."""
        for event in self.start(prompt, **kwargs):
            if event.text:
                yield event.text

    def encode(self, prompt: str | Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            ids = self._encode(prompt) if self._encode is not None else list(self.tokenizer(prompt)["input_ids"])
        elif _is_tensor(prompt):
            if prompt.dim() == 2 and prompt.shape[0] != 1:
                raise InvalidRequestError(
                    f"batch size {prompt.shape[0]} in one request: pass one sequence per request "
                    "(Engine.step runs many requests together)",
                    "prompt",
                )
            ids = prompt.reshape(-1).tolist()
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        return self._in_vocab(ids, "prompt")

    def _in_vocab(self, ids: list[int], field: str) -> list[int]:
        """``ids``, each a token of the vocabulary, else an error naming the first that is not and the field."""
        bad = [t for t in ids if not 0 <= t < self.side.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{field} token id {bad[0]} is outside the vocabulary (size {self.side.vocab_size})", field
            )
        return ids

    def get_policy(self, spec: str) -> Policy:
        """The engine's long-lived instance of a policy spec (stateful policies learn across requests)."""
        if spec not in self._named_policies:
            self._named_policies[spec] = policy = make_policy(spec)
            if self._measured:
                policy.prime(self._measured)
        return self._named_policies[spec]

    # -- the step ---------------------------------------------------------------------------

    def notify(self, event: str, payload: StepRecord | RequestSummary) -> None:
        """Hand a step record (``on_step``) or a finished request's summary (``on_request``) to every observer. An
        observer that fails is logged and the others still hear of it: a trace or a metric must not undo a step
        whose tokens are committed (its requests' messages were lost when the failure ended the step half closed)."""
        for obs in self.observers:
            try:
                getattr(obs, event)(payload)
            except Exception:  # noqa: BLE001 - an observer's fault is its own, never the request's
                log.exception("observer %s failed on %s", type(obs).__name__, event)

    def step(
        self, generations: Sequence[Generation], join: Callable[[], Sequence[Generation]] | None = None
    ) -> list[StepEvent | None]:
        """One draft → verify → commit step shared by every unfinished generation given.

        ``join`` (a batching server's): called once the step's drafts are made, right before its target pass, for
        generations that arrived meanwhile; each whose prompt rest fits what is left of the step's prompt budget
        (``prefill_in_step``) takes it in through this pass, without a draft, and gets its first token from it (the
        draft model takes its prompt in with its next step's draft); one that does not fit, or a seeded sampled one
        (whose draws must not depend on when it arrived), steps from the next step.
        A request arriving while a step drafts is then answered at the end of that step, where it waited for the
        next step to start and end (a step of 16 sequences is 8-10 ms on two cores).

        Returns one event per generation given, then one per generation ``join`` returned (None for one that was
        finished, that this step found out of verification budget and finished, or a joining one it did not take).
        """
        with self.side.mode():
            return self._step(generations, join)

    def _step(
        self, generations: Sequence[Generation], join: Callable[[], Sequence[Generation]] | None = None
    ) -> list[StepEvent | None]:
        live = [g for g in generations if not g.done and not g.out_of_budget()]
        if not live:
            # nothing to step: the joining ones step next time, from the start
            return [None] * (len(generations) + (len(join()) if join is not None else 0))
        # Deferred prompts longer than what is left of the step's prompt budget take in a piece of it and wait.
        fills, held = self._prompt_pieces(live)
        if held:
            live = [g for g in live if id(g) not in held]
        ctxs = [g.context_for_policy(len(live)) for g in live]
        # Prompt rows in this step's pass whatever is decided: joining sequences' prompt rests and the pieces.
        prompt_rows = sum(len(g.context) - 1 - g.cache.length for g in live) + sum(n for _, n in fills)
        # the sequences whose prompt rows are in it (kept for others after the pass)
        taking = [g for g in live if len(g.context) - 1 > g.cache.length] + [g for g, _ in fills] if prompt_rows else []
        t0 = self.clock()
        decisions = self._plan(live, ctxs, prompt_rows)
        self.policy_seconds += self.clock() - t0
        taus = [max(0, min(d.tau, ctx.max_tau)) if self.drafter is not None else 0 for d, ctx in zip(decisions, ctxs)]

        t1 = self.clock()
        prefill_at_plan = self.prefill_seconds  # requests joining after the drafts are started (timed) after it
        predicted = self._predicted(live, ctxs, taus)
        for i, tokens in predicted.items():  # read from the request's prediction: the drafter skips the sequence
            taus[i], decisions[i] = 0, Decision(len(tokens), PREDICTION_REASON)
        drafts = self._draft(live, taus, decisions, fills)
        for i, tokens in predicted.items():
            drafts[i] = predicted_draft(tokens, live[i].params, self.side.vocab_size)
        joined: Sequence[Generation] = ()
        if join is not None:
            joined = join()
            late = self._late_joins(joined, prompt_rows)
            for g, lag in late:
                live.append(g)
                decisions.append(Decision(0, JOINED_REASON))
                drafts.append(Draft())
                prompt_rows += lag
            if late and self.side.prefix_block:
                taking = [*taking, *(g for g, lag in late if lag)]

        chains = self._chains(live, drafts) if self.chain_plain > 1 and self.side.chains_plain else None
        t2 = self.clock()
        try:
            # ONE pass over every sequence's [last, ŷ1..ŷτ] (and the prompt pieces); chained plain ones pass on
            verdicts, logprobs = self.side.verify(live, drafts, fills, chains)
        except BaseException:
            self._undo(live, fills)
            raise
        t3 = self.clock()
        if taking and self.side.prefix_block:
            self._keep_prompts(taking)
        if not live:  # only prompt pieces this time
            return [None] * (len(generations) + len(joined))

        shape = _StepShape(
            sequences=len(live),
            # each sequence's last token, the prompt rows (deferred prefills, pieces) and the drafts
            rows=len(live) + prompt_rows + sum(len(d.tokens) for d in drafts),
            prompt_rows=prompt_rows,
            # the drafter's: predicted drafts run no draft forward
            drafting=sum(1 for i, d in enumerate(drafts) if d.tokens and i not in predicted),
            draft_passes=max((len(d.tokens) for i, d in enumerate(drafts) if i not in predicted), default=0),
            draft_fed=sum(d.fed for d in drafts),
        )
        # A sequence that joined after the drafts was started after the plan: its rest starts where it was started.
        pending = [
            g.commit_step(
                d,
                v,
                decision,
                t_plan=max(t1, g._t_mark),
                prefill_at_plan=prefill_at_plan,
                t_draft=t2 - t1,
                t_verify=t3 - t2,
                shape=shape,
                logprobs=lp,
            )
            for g, d, v, decision, lp in zip(live, drafts, verdicts, decisions, logprobs)
        ]
        texts = [g.take_step(step) for g, step in zip(live, pending)]
        # A record's rest: from the point its request's step before reached (all its sequences detokenised, ``t4``
        # there) to this plan, whatever ran between (that step's learning and observers, the caller's loop, this plan),
        # less other requests' prefills; and from this pass to here (every sequence's commit and detokenising). The
        # records of a sequence that stepped in the step before then all carry the same: the whole of the step's time
        # that is neither its draft nor its pass, each step counted once.
        t4 = self.clock()
        for step in pending:
            step.record.other_time += t4 - t3
        # Each policy learns from its records of the step in one call (a step's facts once, not once per record),
        # before any of its requests ends. That learning is in the next step's rest: the policy's, from ``policy_mark``.
        policy_mark = self.policy_seconds
        for policy, idx in _by_policy(live):
            # A predicted draft's acceptance is the prediction's, not the drafter's: the policy learns from the rest.
            policy.observe_step([pending[i].record for i in idx if i not in predicted])
        self.policy_seconds += self.clock() - t4
        by_gen = {id(g): g.close_step(step, text, t4, policy_mark) for g, step, text in zip(live, pending, texts)}
        return [by_gen.get(id(g)) for g in (*generations, *joined)]

    def _chains(self, live: Sequence[Generation], drafts: Sequence[Draft]) -> list[int] | None:
        """Target passes each sequence of a step where nothing drafts may chain (``Generation.plain_chain``); None
        where a sequence drafts. A step that drafts runs one pass: a chain of a few plain sequences beside it would hold
        the whole batch for passes of a few rows, each nearly as dear as a full one."""
        if any(d.tokens for d in drafts):
            return None
        return [g.plain_chain() for g in live]

    def _late_joins(self, joined: Sequence[Generation], prompt_rows: int) -> list[tuple[Generation, int]]:
        """Of the generations joining a step after its drafts (``step``'s ``join``), the ones whose prompt rest fits
        what is left of the step's prompt budget, each with its rest (prompt rows in the pass), first come first
        served; the others step from the next step. With a prefix cache a prompt first takes what it finds there.
        A seeded sampled request always steps from the next step: its first step without a draft would draw its
        random numbers in another order than alone, and its output would then depend on when it arrived (a greedy
        output does not depend on the steps' τ, an unseeded sample's distribution neither)."""
        room = self.prefill_in_step - prompt_rows
        out: list[tuple[Generation, int]] = []
        for g in joined:
            if g.done or g.out_of_budget() or g.stats.steps or (not g.params.greedy and g.params.seed is not None):
                continue
            lag = self._prompt_rest(g)
            if lag > max(room, 0):
                continue
            room -= lag
            out.append((g, lag))
        return out

    def _plan(self, live: list[Generation], ctxs: list[StepContext], prompt_rows: int = 0) -> list[Decision]:
        """Each sequence's decision from its policy. Policies that plan a batch (``batch_aware``) go last and
        see the target rows the others already put in the pass, and the prompt rows joining it."""
        decisions: list[Decision | None] = [None] * len(live)
        if self.drafter is None:
            return [Decision(0, "no drafter") for _ in live]
        for policy, idx in sorted(_by_policy(live), key=lambda group: group[0].batch_aware):
            decided = [(d, ctx) for d, ctx in zip(decisions, ctxs) if d is not None]
            other_rows = sum(min(d.tau, ctx.max_tau) + 1 for d, ctx in decided)
            other_rows += len(live) - len(decided) - len(idx)  # undecided others: one row at least
            for i, d in zip(idx, policy.plan([ctxs[i] for i in idx], other_rows, prompt_rows)):
                decisions[i] = d
        return [d for d in decisions if d is not None]

    @staticmethod
    def _predicted(live: list[Generation], ctxs: list[StepContext], taus: list[int]) -> dict[int, list[int]]:
        """The sequences whose step drafts from their request's prediction, and the tokens it reads (``Prediction``):
        where it offers at least as many as the drafter would draft (``taus``), which costs a draft forward each."""
        out: dict[int, list[int]] = {}
        for i, (g, ctx) in enumerate(zip(live, ctxs)):
            if g.prediction is not None:
                tokens = g.prediction.propose(g.new_tokens, ctx.max_tau)
                if tokens and len(tokens) >= taus[i]:
                    out[i] = tokens
        return out

    def _prompt_pieces(self, live: list[Generation]) -> tuple[list[tuple[Generation, int]], set[int]]:
        """The step's prompt budget (``prefill_in_step`` tokens), first come first served, over the sequences whose
        deferred prompt is not all in their cache: one whose rest fits steps with it (its block is the rest, then
        its draft); one whose rest does not takes in what is left of the budget (a piece: no draft, no verdict, no
        record) or, with nothing left, waits. Returns the pieces and the ids of the sequences that do not step.
        Without a budget (0) a deferred prompt always comes whole with its first step.

        With a prefix cache (``TargetSide.prefix_block``) a waiting prompt first takes what other requests' prompts
        have put there since it looked (``resume``), and one whose rest is at least half whole blocks that an earlier
        sequence's prompt takes in this step waits a step for them instead of computing them again: requests that
        arrive together behind a new shared preamble compute it once, and a prompt sharing only a little (a chat
        template's first lines) is not delayed for it."""
        pieces: list[tuple[Generation, int]] = []
        held: set[int] = set()
        budget = self.prefill_in_step
        if budget <= 0:
            return pieces, held
        block = self.side.prefix_block  # 0: no prefix cache
        taking: list[list[int]] = []  # the prompts taking rows in this step's pass (with a prefix cache)
        for g in live:
            lag = self._prompt_rest(g)
            if lag <= 0:
                continue
            if block:
                found = max((_shared_blocks(g.prompt_ids, p, block) for p in taking), default=0) - g.cache.length
                if found > 0 and 2 * found >= lag:
                    held.add(id(g))  # most of what it lacks is in an earlier sequence's rows: copied next step
                    continue
            if lag <= budget:
                budget -= lag
            else:
                held.add(id(g))
                if budget <= 0:
                    continue
                pieces.append((g, budget))
                budget = 0
            if block:
                taking.append(g.prompt_ids)
        return pieces, held

    def _prompt_rest(self, g: Generation) -> int:
        """Rows of a deferred prompt not yet in the sequence's cache (0 or less: none), after taking, with a prefix
        cache, what other requests' prompts have put there since it looked (``_resume_prompt``)."""
        lag = len(g.context) - 1 - g.cache.length
        if lag > 0 and self.side.prefix_block:
            lag = len(g.context) - 1 - self._resume_prompt(g)
        return lag

    def _resume_prompt(self, g: Generation) -> int:
        """A deferred prompt's cache extended from the prefix cache (``TargetSide.resume``), counted as cached."""
        have = g.cache.length
        now = self.side.resume(g.cache, g.prompt_ids)
        g.stats.cached_tokens += now - have
        return now

    def _keep_prompts(self, taking: Sequence[Generation]) -> None:
        """The prompt rows a pass just computed, kept for requests that share them (``TargetSide.keep``)."""
        for g in taking:
            self.side.keep(g.cache, g.prompt_ids[:-1])
            if self.drafter is not None and g.draft_state is not None:
                self.drafter.keep(g.draft_state, g.prompt_ids[:-1])

    def _draft(
        self,
        live: list[Generation],
        taus: list[int],
        decisions: list[Decision],
        fills: Sequence[tuple[Generation, int]] = (),
    ) -> list[Draft]:
        drafter = self.drafter
        # The draft model takes the same prompt pieces in, so no sequence's first draft has a long catch-up (none for a
        # request whose policy never drafts: a 206-token prompt's pieces cost a plain step of 16 sequences 2% more).
        taken = [(g, n) for g, n in fills if g.policy.drafts] if drafter is not None and drafter.catches_up else []
        if drafter is not None and taken:
            try:
                drafter.take_in([(g.draft_state, g.context, g.cache.length, n) for g, n in taken])
            except BaseException:
                self._undo(live, fills)
                raise
        if drafter is None or not any(taus):
            return [Draft() for _ in live]
        asks = [
            DraftAsk(g.draft_state, g.context, tau, g.params, g.generator, d.rule, g.rules_state)
            for g, tau, d in zip(live, taus, decisions)
        ]
        try:
            return drafter.propose(asks)
        except BaseException:
            self._undo(live, fills)
            raise

    def _undo(self, live: list[Generation], fills: Sequence[tuple[Generation, int]] = ()) -> None:
        """A step failed half way: put every sequence back as it was before it, so each can be stepped again
        (alone, to find the one at fault). The target's cache held at most context[:-1]; the drafter may
        have fed unverified tokens, so it starts over from the context."""
        for g, _ in fills:  # a prompt piece's pass may not have finished: the piece is taken in again
            if self.drafter is not None:
                self.drafter.rollback(g.draft_state, 0)
        for g in live:
            g.cache.crop(min(g.cache.length, len(g.context) - 1))
            if self.drafter is not None:
                self.drafter.rollback(g.draft_state, 0)


@dataclass(frozen=True)
class _StepShape:
    sequences: int
    rows: int  # of the target pass
    prompt_rows: int  # of those, prompt tokens (deferred prefills joining the pass, and pieces)
    drafting: int  # sequences that drafted
    draft_passes: int  # lockstep draft forwards
    draft_fed: int  # context tokens the drafter took in before drafting, over all sequences (its catch-up)


def _shared_blocks(a: list[int], b: list[int], block: int) -> int:
    """Positions of the whole blocks of ``block`` tokens two prompts share from their start (of what their caches
    hold: all but the last token)."""
    n = min(len(a), len(b)) - 1
    i = 0
    while i + block <= n and a[i : i + block] == b[i : i + block]:
        i += block
    return i


def _by_policy(live: Sequence[Generation]) -> list[tuple[Policy, list[int]]]:
    """The step's sequences grouped by the policy instance that plans them (indices into ``live``), in first-seen order."""
    groups: dict[int, tuple[Policy, list[int]]] = {}
    for i, g in enumerate(live):
        groups.setdefault(id(g.policy), (g.policy, []))[1].append(i)
    return list(groups.values())


@dataclass
class _Committed:
    record: StepRecord
    finish: FinishReason | None
    logprobs: list[TokenLogprob] | None = None


class Generation:
    """One request in flight. Iterate it (or call ``step``) until ``done``; then ``result()``."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        params: SamplingParams,
        policy: Policy,
        stops: list[str],
        max_new_tokens: int,
        max_verify_passes: int | None,
        request_id: str,
        rules: LogitsRules | None = None,
        logprobs: int | None = None,
        *,
        fork_of: Generation | None = None,
        defer_prefill: bool = False,
        prediction: Prediction | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.max_verify_passes = max_verify_passes
        self.context = list(prompt_ids)
        self.rules = rules or LogitsRules()
        side = engine.side
        # Counts for the logit rules, only when one is active (most requests: no state, no cost); an output format's
        # matcher made first (a grammar that does not compile is the request's error).
        fmt = self.rules.output_format
        matcher = engine.formats.matcher(fmt) if fmt is not None else None
        self.rules_state = (
            side.rules_state(self.rules, prompt_ids, engine.eos_ids, matcher) if self.rules.active else None
        )
        self.logprobs = logprobs  # top alternatives per token; None = no log probabilities
        self.token_logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.records: list[StepRecord] = []
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        # the request's predicted output (``start(prediction=...)``), each sample of it tracking its own place in it
        self.prediction = prediction
        if prediction is not None:
            self.stats.prediction_tokens = len(prediction.tokens)
        self.done = False
        self._t_start = engine.clock()
        self._text = OutputText(engine.tokenizer, stops)
        self.generator = side.generator(params)
        self.uniforms: list[float] = []  # drawn ahead from the generator by the target side (``Verifying.uniforms``)
        drafter = engine.drafter
        self.cache: Cache
        self.draft_state: Any
        if fork_of is not None:
            if fork_of.done or fork_of.records or fork_of.prompt_ids != prompt_ids:
                raise ValueError("fork_of must be an unstepped Generation of the same prompt")
            # Copies of a fresh sibling's caches: the prompt is prefilled once for all samples of it.
            with side.mode():
                self.cache = side.fork(fork_of.cache, prompt_ids)
                self.draft_state = drafter.fork(fork_of.draft_state, prompt_ids) if drafter else None
        else:
            self.draft_state = drafter.new_state() if drafter else None
            # Prefill, in a pass of its own: the target's cache holds context[:-1]; each step feeds
            # [context[-1], ŷ_1..ŷ_τ]. The drafter takes the prompt in the same way. Deferred: both caches start
            # empty, and the first step's passes take the prompt in with the other sequences' rows. With a predicted
            # output a drafter that catches up is left to take the prompt in when it first drafts: while the steps
            # draft from the prediction, it never may.
            # Prompt scores come from the target's prefill (``prompt_logprobs``): its cache is filled as they are made
            # (every prompt row computed: none copied from the prefix cache).
            scored = prompt_logprobs is not None
            with side.mode():
                self.cache, self.stats.cached_tokens = side.prefill(
                    prompt_ids, defer=defer_prefill or scored, reuse=not scored
                )
                lazy = (defer_prefill or prediction is not None) and drafter is not None and drafter.catches_up
                if drafter is not None and not lazy and self.policy.drafts:
                    drafter.prefill(self.draft_state, prompt_ids)
        self.prompt_logprobs: list[TokenLogprob] | None = None
        if prompt_logprobs is not None:  # the samples of one prompt share its scores (and its prefilled cache)
            if fork_of is not None and fork_of.prompt_logprobs is not None:
                self.prompt_logprobs = fork_of.prompt_logprobs
            else:
                with side.mode():
                    self.prompt_logprobs = side.prompt_logprobs(prompt_ids, params, prompt_logprobs, self.cache)
        self.stats.prefill_time = engine.clock() - self._t_start
        engine.prefill_seconds += self.stats.prefill_time
        self._t_mark, self._prefill_mark = engine.clock(), engine.prefill_seconds
        self._policy_mark = engine.policy_seconds
        self.policy.begin(self.context_for_policy(1))
        allowance = self.policy.allowance(request_id)
        if allowance is not None:
            self.max_verify_passes = allowance if max_verify_passes is None else min(allowance, max_verify_passes)
        if max_new_tokens == 0:  # only its prompt scored (``prompt_logprobs``): done before any step
            self._finish("length")

    def __iter__(self) -> Iterator[StepEvent]:
        while not self.done:
            event = self.step()
            if event is not None:
                yield event

    def step(self) -> StepEvent | None:
        """One draft → verify → commit step of this request alone. Returns None once it is finished (or when the
        step only took in a piece of its deferred prompt)."""
        return self.engine.step([self])[0]

    @property
    def new_tokens(self) -> list[int]:
        return self.context[len(self.prompt_ids) :]

    def set_aside(self, seconds: float) -> None:
        """The caller held this request out of its steps for ``seconds``, stepping other work meanwhile (a server's
        scheduler rotating its rounds over more requests than ``max_batch``, a benchmark stepping several policies'
        batches in turn): that time is no part of its next record's rest (``other_time``), which the policies learn a
        step's cost from, and neither are the other requests' prefills in it (which the rest would otherwise take out
        again: a server's rotated rounds gave records a negative rest). Never past now: a request the caller started
        while the other work ran (a server admitting one during a round it did not join) was not held out for all of
        it."""
        self._t_mark = min(self._t_mark + seconds, self.engine.clock())
        self._prefill_mark = self.engine.prefill_seconds

    def out_of_budget(self) -> bool:
        """True (and the request finished) once its verification passes are spent: the one place the cap is
        enforced."""
        if self.max_verify_passes is not None and self.stats.target_passes >= self.max_verify_passes:
            if not self.done:
                self._finish("verify_budget")
            return True
        return False

    def plain_chain(self) -> int:
        """Target passes a plain step of this request may chain (``Engine.chain_plain``): greedy or sampled, without
        logit rules or log probabilities, up to its remaining tokens, context and verification budget; 1 otherwise."""
        engine = self.engine
        if engine.chain_plain <= 1 or self.rules_state is not None or self.logprobs is not None:
            return 1
        k = min(
            engine.chain_plain,
            self.max_new_tokens - (len(self.context) - len(self.prompt_ids)),
            engine.max_context - len(self.context),
        )
        if self.max_verify_passes is not None:
            k = min(k, self.max_verify_passes - self.stats.target_passes)
        return max(1, k)

    def context_for_policy(self, batch_size: int) -> StepContext:
        n_new = len(self.context) - len(self.prompt_ids)
        remaining = self.max_new_tokens - n_new
        room = self.engine.max_context - len(self.context)
        return StepContext(
            request_id=self.request_id,
            step=len(self.records),
            prompt_len=len(self.prompt_ids),
            context_len=len(self.context),
            new_tokens=n_new,
            max_new_tokens=self.max_new_tokens,
            verify_passes=self.stats.target_passes,
            max_verify_passes=self.max_verify_passes,
            max_tau=max(0, min(remaining - 1, room)),
            elapsed=self.engine.clock() - self._t_start,
            batch_size=batch_size,
            chain=self.plain_chain() if self.engine.side.chains_plain else 1,
        )

    def commit_step(
        self,
        draft: Draft,
        verdict: Verdict,
        decision: Decision,
        *,
        t_plan: float,
        prefill_at_plan: float,
        t_draft: float,
        t_verify: float,
        shape: _StepShape,
        logprobs: list[TokenLogprob] | None = None,
    ) -> _Committed:
        """Keep [ŷ1..ŷn̂, ȳ], roll both caches back past the rejected slots, and make the step's record."""
        base = len(self.context)
        # Worked example, context c (len L), τ = 3, n̂ = 1: the cache held c[:-1] (L-1), the block appended
        # [c[-1], ŷ1, ŷ2, ŷ3] (L+3); keep c + [ŷ1] (L+1). The drafter keeps the same prefix of what it fed.
        # A chained plain step (``verdict.passes`` > 1) put its first passes - 1 tokens in the cache as well.
        kept = base + verdict.n_accepted + verdict.passes - 1
        self.cache.crop(kept)
        if self.engine.drafter is not None:
            self.engine.drafter.rollback(self.draft_state, kept)
        emitted, finish = self._commit(verdict.tokens)
        if decision.reason == PREDICTION_REASON and self.prediction is not None:
            self.prediction.observe(len(draft.tokens), verdict.n_accepted, len(verdict.tokens))
        if self.rules_state is not None:
            self.rules_state.commit(emitted)
        tau = len(draft.tokens)
        record = StepRecord(
            request_id=self.request_id,
            step=len(self.records),
            prompt_len=len(self.prompt_ids),
            context_len=base,
            policy=self.policy.name,
            reason=decision.reason,
            tau=tau,
            draft_tokens=list(draft.tokens),
            accept_flags=verdict.accept_flags,
            n_accepted=verdict.n_accepted,
            correction=verdict.correction,
            emitted=emitted,
            draft_time=t_draft,
            verify_time=t_verify,
            # From this request's last step to the plan, less other requests' prefills in between (their own
            # passes, which its latency counts but the step's cost does not: the engine's ``prefill_seconds`` at the
            # plan, not the requests started after it, joining the step after its drafts); the rest is added once the
            # whole step is committed. A request that joined after the drafts has none before the plan. Never below 0: a
            # request started on another thread (a server's) while this one's step ran counts its whole prefill here,
            # part of which came before this request's mark (a server's metrics refused the negative seconds).
            other_time=max(0.0, t_plan - self._t_mark - max(0.0, prefill_at_plan - self._prefill_mark)),
            # Of that rest, the policies' own work: the learning after this request's last step and this step's plan.
            policy_time=self.engine.policy_seconds - self._policy_mark,
            draft_token_probs=list(draft.token_probs),
            target_token_probs=verdict.target_token_probs,
            draft_confidence=list(draft.tops),
            tau_planned=decision.tau,
            batch_size=shape.sequences,
            rows=shape.rows,
            prompt_rows=shape.prompt_rows,
            drafting=shape.drafting,
            draft_passes=shape.draft_passes,
            draft_fed=shape.draft_fed,
            verify_passes=self.stats.target_passes + verdict.passes,
            max_verify_passes=self.max_verify_passes,
            target_passes=verdict.passes,
        )
        return _Committed(record, finish, logprobs[: len(emitted)] if logprobs is not None else None)

    def take_step(self, step: _Committed) -> str:
        """Detokenise a committed step; returns the text it made final. The engine then completes the record's times,
        the policy learns from it (``Policy.observe_step``, with the step's other records), then ``close_step``."""
        self.records.append(step.record)
        return self._text.extend(step.record.emitted, final=step.finish is not None)

    def close_step(self, step: _Committed, text_piece: str, t_taken: float, policy_mark: float) -> StepEvent:
        """Count a step the policy has learnt from, tell the observers, and finish the request if it ended. Its next
        step's rest runs from ``t_taken`` (when the engine had detokenised every sequence of this one), and the
        policies' own work in it from ``policy_mark`` (``Engine.policy_seconds`` then, before their learning)."""
        record, finish = step.record, step.finish
        self.stats.add(record)
        self.engine.notify("on_step", record)
        if finish is not None:
            self._finish(finish)
        self._t_mark, self._prefill_mark, self._policy_mark = t_taken, self.engine.prefill_seconds, policy_mark
        if step.logprobs is not None and self.token_logprobs is not None:
            self.token_logprobs.extend(step.logprobs)
        return StepEvent(record=record, text=text_piece, finished=self.done, logprobs=step.logprobs)

    def _commit(self, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append verified tokens, cutting at EOS, a stop string or max_new_tokens."""
        finish: FinishReason | None = None
        remaining = self.max_new_tokens - (len(self.context) - len(self.prompt_ids))
        if len(tokens) >= remaining:
            tokens, finish = tokens[:remaining], "length"
        for i, t in enumerate(tokens):
            if t in self.engine.eos_ids and not self.rules.ignore_eos:
                tokens, finish = tokens[:i], "stop"
                break
        # The fewest tokens whose text completes a stop string: nothing after it is kept.
        cut = self._text.stop_in(tokens)
        if cut is not None:
            tokens, finish = tokens[:cut], "stop"
        self.context.extend(tokens)
        return tokens, finish

    def _finish(self, reason: FinishReason) -> None:
        self.done = True
        self.stats.finish_reason = reason
        self.stats.latency = self.engine.clock() - self._t_start
        self._release()
        self.policy.end(self.request_id, self.stats)
        summary = RequestSummary(
            request_id=self.request_id,
            policy=self.policy.name,
            prompt_len=len(self.prompt_ids),
            stats=self.stats,
            settings={
                "temperature": self.params.temperature,
                "top_k": self.params.top_k,
                "top_p": self.params.top_p,
                "min_p": self.params.min_p,
                "seed": self.params.seed,
                "max_new_tokens": self.max_new_tokens,
                "max_verify_passes": self.max_verify_passes,
                **self.rules.settings(),
            },
            prompt_ids=self.prompt_ids,
        )
        self.engine.notify("on_request", summary)

    def _release(self) -> None:
        """Hand the caches back at once (the slot serves the next request)."""
        if self.cache is not None:
            self.engine.side.release(self.cache, self.context)
            self.cache = None  # type: ignore[assignment]
        if self.draft_state is not None and self.engine.drafter is not None:
            self.engine.drafter.release(self.draft_state, self.context)
            self.draft_state = None

    def cancel(self) -> None:
        """Stop a request early (e.g. its client went away); its caches are released."""
        if not self.done:
            self._finish("cancelled")

    def result(self) -> GenerationResult:
        if not self.done:
            raise RuntimeError("generation is not finished")
        text = self._text.text()
        return GenerationResult(
            request_id=self.request_id,
            text=text,
            token_ids=self.new_tokens,
            prompt_ids=self.prompt_ids,
            stats=self.stats,
            records=self.records,
            logprobs=list(self.token_logprobs) if self.token_logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs,
        )


def _is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    """A torch tensor, checked without importing torch (a tensor exists only once torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def sample_seed(seed: int | None, j: int) -> int | None:
    """The seed of sample ``j`` of a request seeded with ``seed`` (``Engine.start_many``): ``seed`` itself for
    sample 0 (so choice 0 is what n=1 gives), else 64 bits of a hash of (seed, j): distinct streams that no
    other request's plain seed lines up with (``seed + j`` would be request ``seed + j``'s sample 0)."""
    if seed is None or j == 0:
        return seed
    digest = hashlib.blake2b(f"specdec-sample:{seed}:{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
