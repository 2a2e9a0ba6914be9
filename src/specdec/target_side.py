"""What the engine's step needs from the target model, without torch: a request's cache and the one verify pass.

``specdec.verifier.ModelTarget`` implements it over a ``ModelRunner``; the simulator's ``SimTarget``
(``specdec.simulate.pair``) verifies against a hidden continuation on a virtual clock. Both import this module
rather than the engine, and the engine imports neither at load time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from specdec.drafters.loop import Draft
from specdec.errors import UnsupportedError
from specdec.logits_rules import LogitsRules
from specdec.records import Verdict
from specdec.sampling_params import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from specdec.logits_rules import RulesState
    from specdec.output_format import FormatMatcher


class Cache(Protocol):
    """What the engine does with a sequence's target cache (a model's: ``runtime.base.KVCache``)."""

    @property
    def length(self) -> int: ...

    def crop(self, length: int) -> None: ...


class Verifying(Protocol):
    """What a target side reads of a sequence in a step (``engine.Generation`` has it)."""

    prompt_ids: list[int]
    context: list[int]  # the verified sequence so far
    cache: Cache  # holds context[:-1] (a prefix of it before the first step of a deferred prefill)
    params: SamplingParams
    generator: Any  # the request's generator (``TargetSide.generator``)
    uniforms: list[float]  # uniforms drawn ahead from it, for a model target's draws without a draft; [] until then
    rules_state: RulesState | None  # the request's logit-rule counts, when a rule is active
    logprobs: int | None  # top alternatives to report per token; None: no log probabilities


class TargetSide(ABC):
    """The target model's part of the step, for the engine: a request's cache (prefilled, forked, released), and
    the one verify pass over every sequence's block with the acceptance rule. ``specdec.verifier.ModelTarget``
    runs a ``ModelRunner``; the simulator's verifies against a hidden continuation (``specdec.simulate.pair``).

    A cache holds ``context[:-1]`` between steps; ``verify`` appends each sequence's block ``[context[-1],
    ŷ1..ŷτ]`` to it and the engine crops it back to what stands (``cache.crop``, as a ``KVCache``). A request
    whose prefill was deferred (``prefill(..., defer=True)``) starts with less: its first block is
    ``[*context[cache.length:], ŷ1..ŷτ]``, the prompt taken in by the step's one pass.
    """

    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]  # the ids that end a request (the model's and its tokenizer's)
    # Whether ``verify`` chains passes for plain sequences (its ``chains``); a side that does not runs one pass.
    chains_plain: bool = False

    @abstractmethod
    def mode(self) -> AbstractContextManager[Any]:
        """The context the step and the prefill run in (models: torch's inference mode, drafter included)."""

    @abstractmethod
    def generator(self, params: SamplingParams) -> Any:
        """The request's random generator (``DraftAsk.generator``, the acceptance rule's draws)."""

    @abstractmethod
    def rules_state(
        self, rules: LogitsRules, prompt_ids: list[int], eos_ids: frozenset[int], matcher: FormatMatcher | None = None
    ) -> RulesState:
        """The counts of a request whose logit rules are active (``LogitsRules.active``); ``matcher``: its output
        format's (``Engine.formats``), when its rules have one."""

    @abstractmethod
    def prefill(self, prompt_ids: list[int], defer: bool = False, reuse: bool = True) -> tuple[Cache, int]:
        """A new cache holding ``prompt_ids[:-1]`` (the last prompt token opens the first step's block), and how many
        of those tokens came from the side's prefix cache instead of a pass (``reuse``: look there first; a side
        without one: 0). ``defer``: only what the prefix cache had, when the side's ``verify`` takes in what a cache
        lacks (the rest of the prompt then joins the first step's pass); a side that cannot defer prefills now."""

    def prompt_logprobs(
        self, prompt_ids: list[int], params: SamplingParams, k: int, cache: Cache | None = None
    ) -> list[TokenLogprob]:
        """Each prompt token after the first, ``prompt_ids[1:]``, scored by the target given the tokens before it
        (under ``params``' temperature/top-k/top-p, as ``token_logprobs``), with its ``k`` likeliest alternatives: what
        a completion with ``echo`` and ``logprobs`` reports for its prompt. The pass that scores them is a prefill:
        ``cache``, the request's own still empty one (``prefill(..., defer=True)``), is left holding
        ``prompt_ids[:-1]``. A side that cannot score refuses."""
        raise UnsupportedError(f"{type(self).__name__} does not score prompts (prompt log probabilities)")

    # Positions per block of the side's prefix cache, where ``resume`` finds what other requests' prompts ``keep``
    # (prefixes are shared in whole blocks); 0: no prefix cache.
    prefix_block: int = 0

    def resume(self, cache: Cache, prompt_ids: list[int]) -> int:
        """Extend a deferred prompt's ``cache`` (holding the first ``cache.length`` of ``prompt_ids[:-1]``) with what
        the side's prefix cache has kept of the prompt beyond that since its prefill looked; returns the cache's
        length after. A side without a prefix cache: unchanged."""
        return cache.length

    def keep(self, cache: Cache, tokens: list[int]) -> None:  # noqa: B027 - optional hook
        """Keep the prefix of ``tokens`` (a prompt) that ``cache`` holds in the side's prefix cache now, for requests
        arriving while this one runs (``release`` keeps the whole context at its end)."""

    @abstractmethod
    def fork(self, cache: Cache, prompt_ids: list[int]) -> Cache:
        """A copy of an unstepped request's cache of the same prompt (``Engine.start_many``)."""

    @abstractmethod
    def release(self, cache: Cache, tokens: list[int]) -> None:
        """A finished request's cache, which the side may reuse; ``tokens``: the request's context (the cache holds
        its first ``cache.length``), for the side's prefix cache."""

    @abstractmethod
    def verify(
        self,
        live: Sequence[Verifying],
        drafts: Sequence[Draft],
        fills: Sequence[tuple[Verifying, int]] = (),
        chains: Sequence[int] | None = None,
    ) -> tuple[list[Verdict], list[list[TokenLogprob] | None]]:
        """ONE target pass over every sequence's ``[*context[cache.length:], *draft.tokens]``, then each verified
        with its own settings: the verdicts, and the emitted tokens' log probabilities (for requests that asked for
        them). ``fills``: sequences still taking in a deferred prompt, each with the next ``n`` prompt tokens to put
        in its cache in the same pass (nothing verified; only a side that defers prefills gets any). ``chains`` (only
        for a side with ``chains_plain``): passes per sequence; a plain sequence (no draft, no logit rules, no log
        probabilities; greedy or sampled) given k > 1 gets k - 1 more one-row passes after the first, each fed the
        token of the pass before (its argmax, or its draw with the request's generator), in passes shared with the other chaining sequences: its verdict then holds k tokens
        (``Verdict.passes``) and its cache the first k - 1 of them."""
