"""specdec: lossless speculative decoding for Hugging Face causal LMs.

The names below load on first use (PEP 562), so ``import specdec.diagnose`` or ``specdec.simulate``
does not pull in torch and the engine; ``specdec.load``, ``specdec.Engine`` ... import them when read.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# How long an OpenMP thread spins for the next parallel region before it sleeps (GNU OpenMP, read once, when torch
# loads it): 3,000 pauses instead of libgomp's ~300,000 (several milliseconds). The CPU kernel's passes do not wait at
# OpenMP barriers between their phases (runtime/kernels/llama_cpu.cpp, share_out), so the spin only bridges the gaps
# between kernel calls: short within a step's draft, but through the step's Python (a millisecond or more) a spinning
# helper thread held a core that a server's event loop, its clients or the step's own thread then had to share. Set
# GOMP_SPINCOUNT or OMP_WAIT_POLICY yourself to choose otherwise (import torch after specdec, or set them beforehand).
# Measured: docs/runtime.md, "Threads".
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "3000"

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("specdec")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

# public name -> the module that defines it
_EXPORTS = {
    "default_draft": "specdec.api",
    "default_target": "specdec.api",
    "load": "specdec.api",
    "Engine": "specdec.engine",
    "Generation": "specdec.engine",
    "GenerationResult": "specdec.engine",
    "StepEvent": "specdec.engine",
    "ContextLengthError": "specdec.errors",
    "InvalidRequestError": "specdec.errors",
    "ModelLoadError": "specdec.errors",
    "SpecdecError": "specdec.errors",
    "UnsupportedError": "specdec.errors",
    "VocabMismatchError": "specdec.errors",
    "GenerationStats": "specdec.records",
    "RequestSummary": "specdec.records",
    "StepRecord": "specdec.records",
    "SamplingParams": "specdec.sampling",
}

if TYPE_CHECKING:
    from specdec.api import default_draft, default_target, load
    from specdec.engine import Engine, Generation, GenerationResult, StepEvent
    from specdec.errors import (
        ContextLengthError,
        InvalidRequestError,
        ModelLoadError,
        SpecdecError,
        UnsupportedError,
        VocabMismatchError,
    )
    from specdec.records import GenerationStats, RequestSummary, StepRecord
    from specdec.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "ContextLengthError",
    "Engine",
    "Generation",
    "GenerationResult",
    "GenerationStats",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestSummary",
    "SamplingParams",
    "SpecdecError",
    "StepEvent",
    "StepRecord",
    "UnsupportedError",
    "VocabMismatchError",
    "default_draft",
    "default_target",
    "load",
]
