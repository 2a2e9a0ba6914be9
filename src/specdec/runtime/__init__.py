"""Runtimes by name. ``auto`` picks the native fast path for architectures it supports, else ``transformers``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import InvalidRequestError, UnsupportedError
from specdec.runtime.base import KVCache, ModelRunner
from specdec.runtime.cpu import cpu_flags
from specdec.runtime.hf import HFRunner, check_checkpoint_dir
from specdec.runtime.native import SUPPORTED_MODEL_TYPES, NativeRunner, native_unsupported_reason

RunnerFactory = Callable[..., ModelRunner]


@dataclass(frozen=True)
class Runtime:
    load: RunnerFactory  # (path, *, device, dtype, **options) -> a loaded runner
    unsupported: Callable[[Path], str | None]  # why it cannot run a checkpoint, or None when it can


def _native_unsupported(path: Path) -> str | None:
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one the native runtime implements"
    return native_unsupported_reason(path)  # a supported family with a feature it lacks (e.g. yarn RoPE)


# Runtimes by name, in the order ``auto`` tries them: the first that can run a checkpoint is chosen.
RUNTIMES: dict[str, Runtime] = {
    "native": Runtime(NativeRunner.from_pretrained, _native_unsupported),
    "hf": Runtime(HFRunner.from_pretrained, lambda path: None),
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    # Per-output-channel int8 weights, on the CPU kernel only; for draft models (the draft only proposes tokens,
    # so the output cannot change; acceptance may).
    "int8": torch.int8,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, runtime: str | None = None) -> torch.dtype:
    """``auto``/None: bf16 on CUDA, on CPUs with native bf16 matrix units, and for the native runtime on
    other CPUs (it stores 16-bit weights and multiplies them with fp32 activations there, which is faster
    than fp32 weights: half the memory traffic); fp32 for the ``transformers`` runtime on such CPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda" or cpu_has_bf16() or runtime == "native":
            return torch.bfloat16
        return torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InvalidRequestError(
            f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}", "dtype"
        ) from None


def cpu_has_bf16() -> bool:
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidRequestError(f"unknown device {device!r}", "device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device cuda was requested but CUDA is not available", "device")
    return dev


def choose_runtime(path: str | Path, runtime: str) -> str:
    if runtime != "auto":
        if runtime not in RUNTIMES:
            raise InvalidRequestError(
                f"unknown runtime {runtime!r}; choose one of: auto, {', '.join(RUNTIMES)}", "runtime"
            )
        return runtime
    checkpoint = check_checkpoint_dir(path)
    return next(name for name, rt in RUNTIMES.items() if rt.unsupported(checkpoint) is None)


def load_runner(
    path: str | Path,
    *,
    runtime: str = "auto",
    device: torch.device,
    dtype: torch.dtype | str | None,
    compile: bool = False,
    **kwargs: object,
) -> ModelRunner:
    """``dtype`` may be ``"auto"``: resolved for the runtime chosen for this checkpoint. ``compile`` needs the
    native runtime."""
    name = choose_runtime(path, runtime)
    if "head_tokens" in kwargs:  # a restricted output head: the CPU kernel's; where it cannot run, an error
        required = kwargs.pop("head_required", True)  # or, asked for by "auto", the full head
        if name != "native":
            if required:
                raise UnsupportedError(
                    f"a restricted draft head (draft_vocab) needs the native runtime's CPU kernel, but {path} runs "
                    "on transformers (a model type or feature the native runtime lacks, or --runtime hf)"
                )
            kwargs.pop("head_tokens")
        else:
            kwargs["head_required"] = required
    if "window" in kwargs:  # a draft's attention window (specdec.draft_window): the native runtime's
        required = kwargs.pop("window_required", True)
        if name != "native":
            if required and kwargs["window"] is not None:
                raise UnsupportedError(
                    f"a draft attention window (draft_window) needs the native runtime, but {path} runs on "
                    "transformers (a model type or feature the native runtime lacks, or --runtime hf)"
                )
            kwargs.pop("window")
    # The KV cache's element type is the CPU kernel's to choose; elsewhere only "auto" (the runtime's own).
    if name != "native" and kwargs.pop("kv_dtype", "auto") not in (None, "auto"):
        raise UnsupportedError(
            f"a KV cache dtype (kv_dtype) needs the native runtime's CPU kernel, but {path} runs on "
            "transformers (a model type or feature the native runtime lacks, or --runtime hf)"
        )
    if compile:
        if name != "native":
            raise UnsupportedError(
                f"--compile needs the native runtime, but {path} runs on transformers "
                "(a model type or feature the native runtime lacks, or --runtime hf)"
            )
        kwargs["compile"] = True
    if dtype == "int8" or dtype == torch.int8:
        if name != "native":
            raise UnsupportedError(
                f"int8 weights need the native runtime's CPU kernel, but {path} runs on transformers "
                "(a model type or feature the native runtime lacks, or --runtime hf)"
            )
        kwargs["kernel"] = True
    return RUNTIMES[name].load(path, device=device, dtype=resolve_dtype(dtype, device, name), **kwargs)


__all__ = [
    "RUNTIMES",
    "HFRunner",
    "Runtime",
    "KVCache",
    "ModelRunner",
    "load_runner",
    "resolve_device",
    "resolve_dtype",
]
