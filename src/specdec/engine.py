"""The speculative decoding loop: draft, verify once, commit, observe.

``Engine.start`` returns a ``Generation``: one request's state (its caches, its generator),
advanced one step at a time by ``Generation.step()``, so a server can interleave requests.
``generate`` and ``stream`` are thin loops over it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdec.drafters.base import Drafter
from specdec.errors import ContextLengthError, InvalidRequestError
from specdec.policy import FixedPolicy, Policy, StepContext, make_policy
from specdec.records import FinishReason, GenerationStats, RequestSummary, StepRecord
from specdec.runtime.base import ModelRunner
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.text import StopMatcher, TextDecoder
from specdec.verify import verify_greedy, verify_sampling


class Observer(Protocol):
    """Receives every record the engine produces (traces, metrics)."""

    def on_step(self, record: StepRecord) -> None: ...

    def on_request(self, summary: RequestSummary) -> None: ...


@dataclass
class StepEvent:
    record: StepRecord
    text: str  # new text this step made final (held back: partial UTF-8 and possible stop-string prefixes)
    finished: bool


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]  # generated tokens only (EOS and anything after a stop string excluded)
    prompt_ids: list[int]
    stats: GenerationStats
    records: list[StepRecord] = field(default_factory=list)

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
        }


class Engine:
    def __init__(
        self,
        target: ModelRunner,
        tokenizer: Any,
        drafter: Drafter | None = None,
        policy: Policy | None = None,
        observers: Sequence[Observer] = (),
        max_context: int | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.policy = policy or FixedPolicy(4 if drafter else 0)
        self.observers: list[Observer] = list(observers)
        self.max_context = max_context or target.max_context
        self._named_policies: dict[str, Policy] = {self.policy.name: self.policy}
        self.eos_ids = _eos_ids(tokenizer, target)

    # -- public API -------------------------------------------------------------------------

    def start(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        tau: int | None = None,
        policy: str | Policy | None = None,
        stop: str | Sequence[str] | None = None,
        max_verify_passes: int | None = None,
        request_id: str | None = None,
    ) -> Generation:
        """Validate a request and prefill it; advance it with ``Generation.step()``."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise InvalidRequestError(
                f"max_new_tokens must be a positive integer, got {max_new_tokens}", "max_new_tokens"
            )
        if max_verify_passes is not None and (not isinstance(max_verify_passes, int) or max_verify_passes <= 0):
            raise InvalidRequestError(
                f"max_verify_passes must be a positive integer, got {max_verify_passes}", "max_verify_passes"
            )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        prompt_ids = self.encode(prompt)
        if len(prompt_ids) + max_new_tokens > self.max_context:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
                f"window of {self.max_context} tokens",
                "max_new_tokens" if len(prompt_ids) < self.max_context else "prompt",
            )
        chosen = self._resolve_policy(tau, policy)
        return Generation(
            self,
            prompt_ids,
            params,
            chosen,
            stops,
            max_new_tokens,
            max_verify_passes,
            request_id or uuid.uuid4().hex[:16],
        )

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
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] != 1:
                raise InvalidRequestError(
                    f"batch size {prompt.shape[0]} is not supported: pass one sequence per request", "prompt"
                )
            ids = prompt.reshape(-1).tolist()
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary (size {self.target.vocab_size})", "prompt"
            )
        return ids

    def get_policy(self, name: str) -> Policy:
        """The engine's long-lived instance of a named policy (stateful policies learn across requests)."""
        if name not in self._named_policies:
            self._named_policies[name] = make_policy(name)
        return self._named_policies[name]

    # -- internals --------------------------------------------------------------------------

    def _resolve_policy(self, tau: int | None, policy: str | Policy | None) -> Policy:
        if isinstance(policy, Policy):
            return policy
        if tau is not None:
            if policy not in (None, "fixed"):
                raise InvalidRequestError(
                    f"tau={tau} sets a fixed policy; it cannot be combined with policy {policy!r}", "tau"
                )
            if not isinstance(tau, int) or tau < 0:
                raise InvalidRequestError(f"tau must be an integer >= 0, got {tau}", "tau")
            if tau > 0 and self.drafter is None:
                raise InvalidRequestError(
                    f"tau={tau} needs a drafter: load a draft model or enable prompt lookup", "tau"
                )
            return FixedPolicy(tau)
        if policy is None:
            return self.policy
        return self.get_policy(policy)


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
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.max_verify_passes = max_verify_passes
        self.context = list(prompt_ids)
        self.records: list[StepRecord] = []
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.done = False
        self._t_start = time.perf_counter()
        self._decoder = TextDecoder(engine.tokenizer)
        self._stops = StopMatcher(stops)
        self._generator = params.generator(engine.target.device)
        self._cache = engine.target.new_cache()
        drafter = engine.drafter
        self._draft_state = drafter.new_state() if drafter else None
        # Prefill: the target's cache holds context[:-1]; each step feeds [context[-1], ŷ_1..ŷ_τ].
        with torch.inference_mode():
            if len(prompt_ids) > 1:
                ids = torch.tensor(prompt_ids[:-1], dtype=torch.long, device=engine.target.device)
                engine.target.forward(ids, self._cache, last_only=True)
            if drafter is not None:
                drafter.propose(self._draft_state, self.context, 0, params, self._generator)
        self.stats.prefill_time = time.perf_counter() - self._t_start
        self._t_mark = time.perf_counter()
        self.policy.begin(self._step_context())

    def __iter__(self) -> Iterator[StepEvent]:
        while not self.done:
            event = self.step()
            if event is not None:
                yield event

    @property
    def new_tokens(self) -> list[int]:
        return self.context[len(self.prompt_ids) :]

    def _step_context(self) -> StepContext:
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
            elapsed=time.perf_counter() - self._t_start,
            can_draft=self.engine.drafter is not None,
        )

    @torch.inference_mode()
    def step(self) -> StepEvent | None:
        """One draft → verify → commit step. Returns None once the request is finished."""
        if self.done:
            return None
        if self.max_verify_passes is not None and self.stats.target_passes >= self.max_verify_passes:
            self._finish("verify_budget")
            return None
        engine, params = self.engine, self.params
        t0 = self._t_mark
        ctx = self._step_context()
        decision = self.policy.next_tau(ctx)
        if decision.stop:
            self._finish("verify_budget")
            return None
        tau = max(0, min(decision.tau, ctx.max_tau)) if engine.drafter is not None else 0

        t1 = time.perf_counter()
        draft_confidence: list[float] = []
        if tau > 0:
            assert engine.drafter is not None
            draft = engine.drafter.propose(
                self._draft_state,
                self.context,
                tau,
                params,
                self._generator,
                decision.min_confidence,
                decision.reach_rule,
            )
            draft_tokens, draft_probs, draft_confidence = draft.tokens, draft.probs, draft.confidence
        else:
            draft_tokens = torch.empty(0, dtype=torch.long, device=engine.target.device)
            draft_probs = torch.empty(0, engine.target.vocab_size, device=engine.target.device)
        tau = int(draft_tokens.shape[0])  # a drafter may propose fewer than asked

        t2 = time.perf_counter()
        base = len(self.context)
        block = torch.cat(
            [torch.tensor(self.context[-1:], device=engine.target.device), draft_tokens.to(engine.target.device)]
        )
        target_logits = engine.target.forward(block, self._cache)  # [τ+1, V], one pass
        if params.greedy:
            verdict = verify_greedy(draft_tokens, target_logits)
        else:
            target_probs = logits_to_probs(target_logits, params)
            if draft_probs is None:  # only greedy drafts may omit q
                assert engine.drafter is not None
                raise RuntimeError(f"drafter {engine.drafter.name!r} gave no draft distributions for a sampled request")
            verdict = verify_sampling(draft_tokens, draft_probs, target_probs, self._generator)
        t3 = time.perf_counter()

        # Roll back the rejected slots. Worked example, context c (len L), τ = 3, n̂ = 1:
        # the cache held c[:-1] (L-1), the block appended [c[-1], ŷ1, ŷ2, ŷ3] (L+3); keep c + [ŷ1] (L+1).
        self._cache.crop(base + verdict.n_accepted)
        emitted, finish = self._commit(verdict.tokens)
        record = StepRecord(
            request_id=self.request_id,
            step=len(self.records),
            prompt_len=len(self.prompt_ids),
            context_len=base,
            policy=self.policy.name,
            reason=decision.reason,
            tau=tau,
            draft_tokens=draft_tokens.tolist(),
            accept_flags=verdict.accept_flags,
            n_accepted=verdict.n_accepted,
            correction=verdict.correction,
            emitted=emitted,
            draft_time=t2 - t1,
            verify_time=t3 - t2,
            other_time=0.0,
            # Greedy verification reads no q; the draft's probability of its own (argmax) token is its confidence.
            draft_token_probs=verdict.draft_token_probs if not params.greedy else draft_confidence[:tau],
            target_token_probs=verdict.target_token_probs,
        )
        text = self._decoder.text_for(self.new_tokens, final=finish is not None)
        text_piece = self._stops.release(text, final=finish is not None)
        t4 = time.perf_counter()
        record.other_time = (t1 - t0) + (t4 - t3)
        self.records.append(record)
        self.stats.add(record)
        self.policy.observe(record)
        for obs in engine.observers:
            obs.on_step(record)
        if finish is not None:
            self._finish(finish)
        self._t_mark = time.perf_counter()
        return StepEvent(record=record, text=text_piece, finished=self.done)

    def _commit(self, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append verified tokens, cutting at EOS, a stop string or max_new_tokens."""
        finish: FinishReason | None = None
        remaining = self.max_new_tokens - (len(self.context) - len(self.prompt_ids))
        if len(tokens) >= remaining:
            tokens, finish = tokens[:remaining], "length"
        for i, t in enumerate(tokens):
            if t in self.engine.eos_ids:
                tokens, finish = tokens[:i], "stop"
                break
        if self._stops.active:
            before = len(self.context)
            for i in range(len(tokens)):
                # Decode the minimal prefix so nothing after the token completing the stop string is kept.
                text = self._decoder.text_for(self.context[len(self.prompt_ids) :] + tokens[: i + 1], final=False)
                if self._stops.find(text) is not None:
                    tokens, finish = tokens[: i + 1], "stop"
                    break
            assert len(self.context) == before
        self.context.extend(tokens)
        return tokens, finish

    def _finish(self, reason: FinishReason) -> None:
        self.done = True
        self.stats.finish_reason = reason
        self.stats.latency = time.perf_counter() - self._t_start
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
                "seed": self.params.seed,
                "max_new_tokens": self.max_new_tokens,
                "max_verify_passes": self.max_verify_passes,
            },
            prompt_ids=self.prompt_ids,
        )
        for obs in self.engine.observers:
            obs.on_request(summary)

    def cancel(self) -> None:
        """Stop a request early (e.g. its client went away); its caches are released."""
        if not self.done:
            self._finish("cancelled")
        self._cache = None  # type: ignore[assignment]
        self._draft_state = None

    def result(self) -> GenerationResult:
        if not self.done:
            raise RuntimeError("generation is not finished")
        text = self._stops.cut(self._decoder.text_for(self.new_tokens, final=True))
        return GenerationResult(
            request_id=self.request_id,
            text=text,
            token_ids=self.new_tokens,
            prompt_ids=self.prompt_ids,
            stats=self.stats,
            records=self.records,
        )


def _eos_ids(tokenizer: Any, target: ModelRunner) -> frozenset[int]:
    ids = set(target.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return frozenset(ids)
