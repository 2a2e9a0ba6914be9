"""``specdec.load``: checkpoints (or already-loaded ``transformers`` objects) -> an ``Engine``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.draft_vocab import means_full as draft_vocab_means_full
from specdec.draft_vocab import resolve as draft_vocab_tokens
from specdec.draft_vocab import whole_number
from specdec.draft_window import resolve as draft_window_tokens
from specdec.drafters.base import Drafter
from specdec.drafters.bridge import BridgedDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.engine import Engine, Observer
from specdec.errors import InvalidRequestError, ModelLoadError, UnsupportedError, VocabMismatchError
from specdec.policy import Policy, make_policy, request_policy
from specdec.runtime import load_runner, resolve_device, resolve_dtype
from specdec.runtime.base import ModelRunner
from specdec.runtime.hf import HFRunner, check_checkpoint_dir
from specdec.runtime.native_kernel import release_thread_team

DEFAULT_MODELS = Path(__file__).resolve().parent / "models"


def default_target() -> Path:
    return DEFAULT_MODELS / "target"


def default_draft() -> Path:
    return DEFAULT_MODELS / "draft"


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(
            f"cannot load a tokenizer from {path}: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}"
        ) from e


def has_tokenizer(path: Path) -> bool:
    return any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    )


DRAFT_TOKENIZER_MODES = ("auto", "shared", "bridge")


def vocab_difference(target_tok: Any, draft_tok: Any) -> str | None:
    """How the draft's tokenizer maps some string to a different id than the target's; None if it never does."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(tv) != len(dv):
        return f"{len(dv)} tokens vs {len(tv)} tokens"
    for token, tid in tv.items():
        if dv.get(token) != tid:
            return f"token {token!r} is id {tid} in the target but {dv.get(token)} in the draft"
    return None


def check_same_vocab(target_tok: Any, draft_tok: Any, target_name: str, draft_name: str) -> None:
    """Refuse a draft whose tokenizer maps any string to a different id than the target's."""
    diff = vocab_difference(target_tok, draft_tok)
    if diff is not None:
        raise VocabMismatchError(
            f"draft {draft_name} and target {target_name} do not share a vocabulary: {diff} "
            "(draft_tokenizer='auto' or --draft-tokenizer auto drafts through text instead)"
        )


@dataclass
class DraftSide:
    """What a drafter is built from: the loaded target, and the draft model with both tokenizers."""

    target: ModelRunner
    draft: ModelRunner | None = None
    target_tokenizer: Any = None
    draft_tokenizer: Any = None


def _model_drafter(side: DraftSide) -> Drafter:
    assert side.draft is not None, "a model drafter needs the draft model"
    return ModelDrafter(side.draft, side.target.vocab_size)


def _bridged_drafter(side: DraftSide) -> Drafter:
    assert side.draft is not None, "a bridged drafter needs the draft model"
    return BridgedDrafter(side.draft, side.target_tokenizer, side.draft_tokenizer, side.target.vocab_size)


# Drafters by kind, each built from the loaded models ("model", "bridge": a draft model with the target's
# tokenizer, or with its own, drafting through text).
DRAFTERS: dict[str, Callable[[DraftSide], Drafter]] = {
    "model": _model_drafter,
    "bridge": _bridged_drafter,
    "prompt_lookup": lambda side: PromptLookupDrafter(side.target.vocab_size, side.target.device),
}


def load(
    target: str | Path | Any | None = None,
    draft: str | Path | Any | None = None,
    *,
    tokenizer: Any = None,
    prompt_lookup: bool = False,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = "auto",
    draft_dtype: str | torch.dtype | None = None,
    runtime: str = "auto",
    policy: str | Policy | None = None,
    tau: int | None = None,
    observers: list[Observer] | None = None,
    trace: str | Path | None = None,
    trust_remote_code: bool = False,
    compile: bool = False,
    draft_tokenizer: str = "auto",
    draft_vocab: int | str | None = "auto",
    draft_window: int | str | None = "auto",
    kv_dtype: str | torch.dtype | None = "auto",
    prefix_cache: int | str | None = None,
) -> Engine:
    """Build an engine.

    ``target``/``draft``: checkpoint directories, or loaded ``transformers`` models (then pass
    ``tokenizer``). With no target, the shipped default pair is used (its draft included, unless
    ``prompt_lookup``). ``policy``/``tau``: the default for requests that do not choose their own (a policy
    spec such as ``adaptive:max_tau=8``; ``tau=N`` is ``fixed:tau=N``; default: ``fixed``, τ = 4).
    ``trace``: append a JSONL trace of every step and request to this file (see docs/trace.md).
    ``compile``: ``torch.compile`` each native-runtime model's step, one graph per block size (slow to
    start; see docs/runtime.md for when it pays). Checkpoints on the ``transformers`` runtime refuse it.
    ``draft_tokenizer``: a draft checkpoint with a tokenizer of its own that differs from the target's is
    bridged through text ("auto", said once on stderr; see docs/models.md), refused with
    ``VocabMismatchError`` ("shared"), or bridged even when the tokenizers agree ("bridge").
    ``draft_vocab``: the tokens the draft's output head computes (``specdec.draft_vocab``): a number N (its N most
    frequent, from the draft's ``token_ranking.json``), "full", or "auto" (the ranking's default where the draft
    runs on the CPU kernel: 4096 for the shipped draft; else the full head). The output never changes.
    ``draft_window``: how many of the latest tokens the draft attends to (``specdec.draft_window``): a number N,
    "full", or "auto" (the length the draft was trained on where its ``specdec_training.json`` records it: 256 for
    the shipped draft; else the whole context). Native runtime; the output never changes.
    ``kv_dtype``: the element type of both models' KV caches on the CPU kernel: "fp32", "bf16", "fp16", or "auto"
    (16 bits for 16-bit weights, as a checkpoint run in its own dtype keeps its cache; fp32 for fp32 weights). A
    16-bit cache halves the bytes each row's attention reads (docs/runtime.md); keys and values are rounded to it.
    ``prefix_cache``: keep finished requests' keys and values by token prefix, so a prompt that starts the way an
    earlier request's context did copies that part instead of computing it (``specdec.runtime.prefix_cache``;
    the output never changes): MiB per model (target and draft each), "auto" (``DEFAULT_PREFIX_CACHE_MIB`` where
    the model runs on the CPU kernel, else off), or None/"off"/0 (default: off; ``specdec serve``: auto).
    """
    dev = resolve_device(device)
    prefix_mib = prefix_cache_mib(prefix_cache)
    if kv_dtype not in (None, "auto"):
        from specdec.runtime.native import kv_cache_dtype

        try:
            kv_cache_dtype(kv_dtype, torch.float32)
        except ModelLoadError as e:
            raise InvalidRequestError(str(e), "kv_dtype") from None
    # "auto" stays unresolved until the runtime of each checkpoint is known (see resolve_dtype).
    dt: torch.dtype | str = "auto" if dtype in (None, "auto") else resolve_dtype(dtype, dev)
    ddt = resolve_dtype(draft_dtype, dev) if draft_dtype not in (None, "auto") else dt
    if target is None:
        target = default_target()
        if draft is None and not prompt_lookup:
            draft = default_draft()
    if draft is not None and prompt_lookup:
        raise InvalidRequestError("choose either a draft model or prompt lookup, not both", "draft")
    if draft_tokenizer not in DRAFT_TOKENIZER_MODES:
        raise InvalidRequestError(
            f"draft_tokenizer must be one of {', '.join(DRAFT_TOKENIZER_MODES)}, got {draft_tokenizer!r}",
            "draft_tokenizer",
        )

    if dt == torch.int8:
        raise InvalidRequestError(
            "int8 weights are for the draft model only (draft_dtype='int8', --draft-dtype int8): "
            "the target decides the output and must keep its own weights",
            "dtype",
        )
    target_runner, target_tok = _load_model(
        target, tokenizer, runtime, dev, dt, trust_remote_code, "target", compile=compile, kv_dtype=kv_dtype
    )
    draft_runner: ModelRunner | None = None
    draft_tok: Any = None
    max_context = target_runner.max_context
    kind = "prompt_lookup" if prompt_lookup else None
    if draft is not None:
        head = window = None
        if isinstance(draft, (str, Path)):
            draft_dir = check_checkpoint_dir(draft)
            head = draft_vocab_tokens(draft_dir, draft_vocab)
            window = draft_window_tokens(draft_dir, draft_window)
        else:
            _refuse_draft_options(draft_vocab, draft_window, "a draft checkpoint directory")
        draft_runner, draft_tok = _load_model(
            draft,
            None,
            runtime,
            dev,
            ddt,
            trust_remote_code,
            "draft",
            tokenizer_fallback=target_tok,
            compile=compile,
            head_tokens=head,
            head_required=draft_vocab != "auto",
            window=window,
            window_required=draft_window != "auto",
            kv_dtype=kv_dtype,
        )
        kind = _draft_kind(draft_tokenizer, target_tok, draft_tok, target_runner, draft_runner)
        if kind == "model":  # positions are shared only when the ids are
            max_context = min(max_context, draft_runner.max_context)
        # (a bridged draft's prefixes are its own ids': kept by them, as exact)
        _keep_prefixes(draft_runner, prefix_mib, required=False)  # the target's refusal speaks for both
    else:
        _refuse_draft_options(draft_vocab, draft_window, "a draft model")
    _keep_prefixes(target_runner, prefix_mib, required=prefix_cache != "auto")
    side = DraftSide(target_runner, draft_runner, target_tok, draft_tok)
    drafter = DRAFTERS[kind](side) if kind is not None else None

    if isinstance(policy, Policy):
        if tau is not None:
            raise InvalidRequestError(f"tau={tau} cannot be combined with a policy object", "tau")
        chosen = policy
    else:
        chosen = make_policy(request_policy(policy, tau) or "fixed")
    observers = list(observers or [])
    if trace is not None:
        from specdec.runtime.base import target_meta
        from specdec.trace import JsonlTrace

        observers.append(JsonlTrace(trace, meta=target_meta(target_runner)))
    engine = Engine(target_runner, target_tok, drafter, chosen, observers, max_context=max_context)
    # Loaded: this thread's OpenMP helpers go, so a thread that serves the engine (a server's worker) runs its passes
    # beside no other team (``release_thread_team``: with two, every barrier of a pass sleeps).
    release_thread_team()
    return engine


DEFAULT_PREFIX_CACHE_MIB = 512  # a model's kept prefixes under prefix_cache="auto": ~100k tokens of the default target


def prefix_cache_mib(choice: int | str | None) -> int | None:
    """MiB of kept prefixes per model for ``load(prefix_cache=choice)``: None for off (None, "off", 0),
    ``DEFAULT_PREFIX_CACHE_MIB`` for "auto", else the positive whole number given."""
    if choice is None or choice in ("off", 0, "0"):
        return None
    if choice == "auto":
        return DEFAULT_PREFIX_CACHE_MIB
    n = whole_number(choice)
    if n is None or n < 0:
        raise InvalidRequestError(
            f"prefix_cache must be a number of MiB, 'auto' or 'off', got {choice!r}", "prefix_cache"
        )
    return n or None


def _keep_prefixes(runner: ModelRunner, mib: int | None, required: bool) -> None:
    """Give ``runner`` a prefix cache of ``mib`` MiB where it can keep one exactly (the CPU kernel); where it
    cannot, an error when the size was asked for (``required``), else nothing."""
    if mib is None:
        return
    from specdec.runtime.native import NativeRunner

    reason = None
    if not isinstance(runner, NativeRunner):
        reason = f"prefix caching needs the native runtime's CPU kernel ({runner.name} runs on transformers)"
    else:
        try:
            runner.enable_prefix_cache(mib << 20)
        except ValueError as e:
            reason = str(e)
    if reason is not None and required:
        raise InvalidRequestError(reason, "prefix_cache")


def _refuse_draft_options(draft_vocab: int | str | None, draft_window: int | str | None, needs: str) -> None:
    """``draft_vocab``/``draft_window`` asked of a draft they cannot apply to (none, or a loaded model object)."""
    if not (draft_vocab == "auto" or draft_vocab_means_full(draft_vocab)):
        raise InvalidRequestError(f"draft_vocab needs {needs}", "draft_vocab")
    if draft_window_tokens(None, draft_window) is not None:
        raise InvalidRequestError(f"draft_window needs {needs}", "draft_window")


def _draft_kind(mode: str, target_tok: Any, draft_tok: Any, target: ModelRunner, draft: ModelRunner) -> str:
    """ "model" (the draft reads and writes the target's ids) or "bridge" (it drafts through text)."""
    if mode == "bridge":
        return "bridge"
    if draft_tok is not target_tok:
        diff = vocab_difference(target_tok, draft_tok)
        if diff is None:
            return "model"
        if mode == "shared":
            check_same_vocab(target_tok, draft_tok, target.name, draft.name)
        print(
            f"specdec: draft {draft.name} has its own tokenizer ({diff}): drafting through text "
            "(drafter bridge; greedy and sampled output stay exact, see docs/models.md)",
            file=sys.stderr,
            flush=True,
        )
        return "bridge"
    if min(draft.vocab_size, target.vocab_size) < len(target_tok):
        raise VocabMismatchError(
            f"draft {draft.name} and target {target.name} do not share a vocabulary: "
            f"{draft.vocab_size} vs {target.vocab_size} output rows for a {len(target_tok)}-token "
            "tokenizer (the draft has no tokenizer of its own)"
        )
    return "model"


def _load_model(
    spec: str | Path | Any,
    tokenizer: Any,
    runtime: str,
    device: torch.device,
    dtype: torch.dtype | str,
    trust_remote_code: bool,
    role: str,
    tokenizer_fallback: Any = None,
    compile: bool = False,
    head_tokens: list[int] | None = None,
    head_required: bool = True,
    window: int | None = None,
    window_required: bool = True,
    kv_dtype: str | torch.dtype | None = "auto",
) -> tuple[ModelRunner, Any]:
    if isinstance(spec, (str, Path)):
        path = check_checkpoint_dir(spec)
        extra: dict[str, Any] = {"trust_remote_code": True} if trust_remote_code else {}
        if kv_dtype not in (None, "auto"):
            extra["kv_dtype"] = kv_dtype
        if head_tokens is not None:
            extra.update(head_tokens=head_tokens, head_required=head_required)
        if window is not None:
            extra.update(window=window, window_required=window_required)
        runner = load_runner(path, runtime=runtime, device=device, dtype=dtype, compile=compile, **extra)
        if tokenizer is None:
            if has_tokenizer(path):
                tokenizer = load_tokenizer(path)
            elif tokenizer_fallback is not None:
                tokenizer = tokenizer_fallback
            else:
                raise ModelLoadError(f"{role} checkpoint {path} has no tokenizer files (tokenizer.json, ...)")
        return runner, tokenizer
    if isinstance(spec, torch.nn.Module):
        if compile:
            raise UnsupportedError(f"--compile needs the native runtime; the {role} is a loaded transformers model")
        if kv_dtype not in (None, "auto"):
            raise UnsupportedError(f"kv_dtype needs the native runtime; the {role} is a loaded transformers model")
        runner = HFRunner(
            spec.to(device), name=getattr(getattr(spec, "config", None), "_name_or_path", "") or f"<{role} model>"
        )
        tok = tokenizer if tokenizer is not None else tokenizer_fallback
        if tok is None:
            raise InvalidRequestError(f"pass tokenizer= when the {role} is a loaded model object", "tokenizer")
        return runner, tok
    raise InvalidRequestError(
        f"{role} must be a checkpoint directory or a transformers model, got {type(spec).__name__}", role
    )
