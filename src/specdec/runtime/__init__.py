"""Runtimes by name. ``auto`` picks the native fast path for architectures it supports, else ``transformers``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.errors import InvalidRequestError, UnsupportedError
from specdec.runtime.base import KVCache, ModelRunner
from specdec.runtime.cpu import cpu_flags
from specdec.runtime.hf import HFRunner, check_checkpoint_dir

RunnerFactory = Callable[..., ModelRunner]
RUNTIMES: dict[str, RunnerFactory] = {"hf": HFRunner.from_pretrained}
# model_type values (config.json) the native runtime implements; filled in when it is importable.
NATIVE_MODEL_TYPES: frozenset[str] = frozenset()

try:  # the native runtime registers itself here
    from specdec.runtime.native import SUPPORTED_MODEL_TYPES, NativeRunner, native_unsupported_reason

    RUNTIMES["native"] = NativeRunner.from_pretrained
    NATIVE_MODEL_TYPES = frozenset(SUPPORTED_MODEL_TYPES)
except ImportError:
    pass

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
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
    model_type = json.loads((check_checkpoint_dir(path) / "config.json").read_text()).get("model_type")
    # A supported architecture with a feature the native runtime lacks (e.g. yarn RoPE) falls back to transformers.
    if model_type in NATIVE_MODEL_TYPES and native_unsupported_reason(path) is None:
        return "native"
    return "hf"


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
    if compile:
        if name != "native":
            raise UnsupportedError(
                f"--compile needs the native runtime, but {path} runs on transformers "
                "(a model type or feature the native runtime lacks, or --runtime hf)"
            )
        kwargs["compile"] = True
    return RUNTIMES[name](path, device=device, dtype=resolve_dtype(dtype, device, name), **kwargs)


__all__ = ["RUNTIMES", "HFRunner", "KVCache", "ModelRunner", "load_runner", "resolve_device", "resolve_dtype"]
