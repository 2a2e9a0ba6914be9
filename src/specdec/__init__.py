"""specdec: lossless speculative decoding for Hugging Face causal LMs.

The names below load on first use (PEP 562), so ``import specdec.diagnose`` or ``specdec.simulate``
does not pull in torch and the engine; ``specdec.load``, ``specdec.Engine`` ... import them when read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
