"""The contenders ``specdec bench`` times: our engine (target-only, fixed τ, named policies) and
``transformers`` ``generate()`` (target-only, assisted by the draft, prompt lookup).

Every contender takes the same prompt token ids and returns a ``RunResult``: its generated tokens
(EOS excluded), its wall time (prefill included) and what it can tell about its steps.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.engine import Engine
from specdec.records import StepRecord


@dataclass
class RunResult:
    tokens: list[int]  # generated tokens, EOS and anything after it excluded
    seconds: float  # wall time of the whole request, prefill included
    target_passes: int  # target forward passes that emitted tokens
    drafted: int | None = None  # None: the contender does not expose it
    accepted: int | None = None
    draft_time: float | None = None
    verify_time: float | None = None  # target forward time (transformers: measured by hooks)
    other_time: float | None = None
    prefill_time: float | None = None
    counts_exact: bool = True  # False: drafted/accepted inferred from forward-call counts
    rejections: int | None = None  # drafting steps that ended in a rejection (n̂ < τ)
    records: list[StepRecord] = field(default_factory=list)  # our engine's steps (other contenders: none)


# runs[contender key][prompt id] -> one RunResult per repeat
Runs = dict[str, dict[str, list[RunResult]]]


class Contender(ABC):
    key: str  # stable identifier used in the JSON (e.g. "fixed_tau4")
    label: str  # what the table prints
    kind: str  # target_only | fixed | policy | trace | hf_target | hf_assisted | hf_lookup | planted
    tau: int | None = None  # fixed draft length, where there is one
    ignore_eos: bool = False  # fixed-length outputs: EOS is a token like any other (bench --ignore-eos)

    @abstractmethod
    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult: ...

    def describe(self) -> dict[str, Any]:
        return {"key": self.key, "label": self.label, "kind": self.kind, "tau": self.tau}


class EngineContender(Contender):
    """Our engine with a fixed τ (0 = target-only) or a named policy."""

    def __init__(
        self, key: str, label: str, kind: str, engine: Engine, tau: int | None = None, policy: str | None = None
    ) -> None:
        self.key, self.label, self.kind, self.engine, self.tau, self.policy = key, label, kind, engine, tau, policy

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        t0 = time.perf_counter()
        res = self.engine.generate(
            prompt_ids, max_new_tokens=max_new_tokens, tau=self.tau, policy=self.policy, ignore_eos=self.ignore_eos
        )
        seconds = time.perf_counter() - t0
        s = res.stats
        return RunResult(
            tokens=list(res.token_ids),
            seconds=seconds,
            target_passes=s.target_passes,
            drafted=s.drafted,
            accepted=s.accepted,
            draft_time=s.draft_time,
            verify_time=s.verify_time,
            other_time=s.other_time,
            prefill_time=s.prefill_time,
            records=list(res.records),
            rejections=sum(1 for r in res.records if r.tau > 0 and r.n_accepted < r.tau),
        )

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["runtime"] = type(self.engine.target).__name__
        if self.policy:
            d["policy"] = self.policy
        return d


class CallMeter:
    """Counts and times a module's forward calls through hooks (a few µs per call)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self.seconds = 0.0
        self._t0 = 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


@dataclass
class HFModels:
    """``transformers`` copies of the target and draft, with meters on their forward calls."""

    target: torch.nn.Module
    draft: torch.nn.Module | None
    target_meter: CallMeter
    draft_meter: CallMeter | None
    # (target tokenizer, draft tokenizer) when the draft has a tokenizer of its own: generate() then bridges
    # through text (transformers' universal assisted decoding)
    tokenizers: tuple[Any, Any] | None = None
    assisted_skipped: str | None = None  # why the assisted contender cannot run, when it cannot

    @classmethod
    def load(
        cls,
        target_dir: str,
        draft_dir: str | None,
        dtype: torch.dtype,
        draft_dtype: torch.dtype,
        device: torch.device,
        tokenizers: tuple[Any, Any] | None = None,
    ) -> HFModels:
        from transformers import AutoModelForCausalLM

        def one(path: str, dt: torch.dtype) -> torch.nn.Module:
            model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=dt)
            return model.to(device).eval()

        target = one(target_dir, dtype)
        draft = one(draft_dir, draft_dtype) if draft_dir else None
        skipped = None
        if draft is not None and tokenizers is not None and _vocab_rows(target) == _vocab_rows(draft):
            # generate() takes both tokenizers only for models whose vocabulary sizes differ; with equal sizes it
            # would feed the target's ids to the draft as they are.
            skipped = (
                "the draft has its own tokenizer but as many vocabulary rows as the target: transformers' "
                "assisted generation would mix up their ids (it bridges only vocabularies of different sizes)"
            )
            draft = None
        return cls(
            target,
            draft,
            CallMeter(target),
            CallMeter(draft) if draft is not None else None,
            tokenizers=tokenizers,
            assisted_skipped=skipped,
        )


def _vocab_rows(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    return int(rows) if rows is not None else None


class HFContender(Contender):
    """``model.generate(...)`` greedy; ``mode``: target (plain), assisted (draft model) or lookup (n-gram)."""

    def __init__(
        self,
        key: str,
        label: str,
        kind: str,
        models: HFModels,
        eos_ids: frozenset[int],
        generate_kwargs: dict[str, Any],
    ) -> None:
        self.key, self.label, self.kind, self.models = key, label, kind, models
        self.eos_ids = eos_ids
        self.generate_kwargs = generate_kwargs

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        m = self.models
        device = next(m.target.parameters()).device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, P]
        eos = [] if self.ignore_eos else sorted(self.eos_ids)
        m.target_meter.reset()
        if m.draft_meter is not None:
            m.draft_meter.reset()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = m.target.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                num_beams=1,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos or None,  # None: no EOS stops generation (--ignore-eos)
                pad_token_id=eos[0] if eos else (min(self.eos_ids) if self.eos_ids else None),
                **self.generate_kwargs,
            )
        seconds = time.perf_counter() - t0
        tokens = cut_at_eos(out[0, len(prompt_ids) :].tolist(), frozenset(eos))
        passes = m.target_meter.calls  # the first call (prefill) also emits a token
        result = RunResult(
            tokens=tokens, seconds=seconds, target_passes=passes, verify_time=m.target_meter.seconds, counts_exact=False
        )
        if self.kind == "hf_assisted" and m.draft_meter is not None:
            # Each assistant forward proposes one candidate; each target pass emits accepted + 1 tokens.
            result.drafted = m.draft_meter.calls
            result.accepted = max(0, len(tokens) - passes)
            result.draft_time = m.draft_meter.seconds
        return result

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["runtime"] = "transformers generate()"
        d["generate_kwargs"] = {
            k: v
            for k, v in self.generate_kwargs.items()
            if k not in ("assistant_model", "tokenizer", "assistant_tokenizer")
        }
        if "assistant_tokenizer" in self.generate_kwargs:
            d["assistant_tokenizer"] = "the draft's own (universal assisted decoding)"
        if "assistant_model" in self.generate_kwargs:
            gc = self.generate_kwargs["assistant_model"].generation_config
            defaults = _hf_generation_defaults()
            d["assistant_schedule"] = {  # None in the checkpoint means the transformers default applies
                k: getattr(gc, k, None) if getattr(gc, k, None) is not None else defaults.get(k)
                for k in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
            }
        return d


def _hf_generation_defaults() -> dict[str, Any]:
    from transformers import GenerationConfig

    getter = getattr(GenerationConfig, "_get_default_generation_params", None)
    return dict(getter()) if callable(getter) else {}


def cut_at_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i]
    return tokens


def hf_contenders(models: HFModels, eos_ids: frozenset[int], lookup_tokens: int) -> list[Contender]:
    out: list[Contender] = [HFContender("hf_target", "transformers generate()", "hf_target", models, eos_ids, {})]
    if models.draft is not None:
        kwargs: dict[str, Any] = {"assistant_model": models.draft}
        label = "transformers assisted (draft)"
        if models.tokenizers is not None:
            kwargs["tokenizer"], kwargs["assistant_tokenizer"] = models.tokenizers
            label = "transformers assisted (draft, own tokenizer)"
        out.append(HFContender("hf_assisted", label, "hf_assisted", models, eos_ids, kwargs))
    out.append(
        HFContender(
            "hf_lookup",
            f"transformers prompt lookup ({lookup_tokens})",
            "hf_lookup",
            models,
            eos_ids,
            {"prompt_lookup_num_tokens": lookup_tokens},
        )
    )
    return out
