"""specdec: lossless speculative decoding for Hugging Face causal LMs."""

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

__version__ = "0.1.0"

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
