"""Cost models: seconds for drafting, verifying a block, per-step overhead and prefill.

``cpu`` is "measured on this machine": the JSON file ``specdec bench``/``specdec tune`` write
(``$SPECDEC_COSTS`` or ``~/.cache/specdec/costs.json``) when present, else defaults measured on the
development machine (2-core Zen4 CPU, 8.4M-parameter Llama target in bf16 through the native
runtime, 1.9M 2-layer draft in fp32: verify 3.80 ms for 1 token + 0.047 ms per extra token,
draft 0.59 ms per token, c ≈ 0.16). ``gpu-70b`` is the issue's planning example: a 70B target on
one GPU (verify 25 ms + 0.3 ms per extra token) with a 1B draft at 4 ms per token; its prefill,
0.02 ms per prompt token, assumes most of a prompt is prefix-cached (as in a writing assistant).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from specdec.analysis import StepAggregate
from specdec.errors import InvalidRequestError
from specdec.records import StepRecord


@dataclass(frozen=True)
class CostModel:
    name: str
    draft_per_token_s: float
    verify_base_s: float  # a block of 1 token (a plain step)
    verify_per_extra_s: float  # each further token in the block
    other_s: float = 0.0  # per step: policy, bookkeeping
    prefill_per_token_s: float = 0.0
    jitter: float = 0.03  # lognormal sigma of every timing
    verify_table: dict[int, float] = field(default_factory=dict)  # measured seconds by block size (overrides the line)
    source: str = "given"

    def verify(self, block: int) -> float:
        return self.verify_table.get(block, self.verify_base_s + self.verify_per_extra_s * (block - 1))

    def noisy(self, seconds: float, rng: random.Random) -> float:
        return seconds * math.exp(rng.gauss(0.0, self.jitter)) if self.jitter else seconds

    @property
    def c(self) -> float:
        """Draft cost per token / target cost per pass."""
        return self.draft_per_token_s / self.verify_base_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["verify_table"] = {str(k): v for k, v in self.verify_table.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "file") -> CostModel:
        try:
            table = {int(k): float(v) for k, v in (d.get("verify_table") or {}).items()}
            return cls(
                name=str(d.get("name", "measured")),
                draft_per_token_s=float(d["draft_per_token_s"]),
                verify_base_s=float(d["verify_base_s"]),
                verify_per_extra_s=float(d.get("verify_per_extra_s", 0.0)),
                other_s=float(d.get("other_s", 0.0)),
                prefill_per_token_s=float(d.get("prefill_per_token_s", 0.0)),
                jitter=float(d.get("jitter", 0.03)),
                verify_table=table,
                source=source,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"bad cost model JSON ({source}): {e!r}", "costs") from None


CPU_DEFAULT = CostModel(
    "cpu",
    0.59e-3,
    3.80e-3,
    0.047e-3,
    other_s=0.15e-3,
    prefill_per_token_s=0.06e-3,
    source="defaults measured on a 2-core Zen4 CPU",
)
GPU_70B = CostModel(
    "gpu-70b",
    4.0e-3,
    25.0e-3,
    0.3e-3,
    other_s=0.2e-3,
    prefill_per_token_s=0.02e-3,
    source="given: 70B target on one GPU, 1B draft",
)


def measured_costs_path() -> Path:
    env = os.environ.get("SPECDEC_COSTS")
    return Path(env) if env else Path.home() / ".cache" / "specdec" / "costs.json"


def measured_cpu() -> CostModel:
    path = measured_costs_path()
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InvalidRequestError(f"cannot read measured costs {path}: {e}", "costs") from None
        return replace(CostModel.from_json(data, source=str(path)), name="cpu")
    return CPU_DEFAULT


COSTS = {"cpu": measured_cpu, "gpu-70b": lambda: GPU_70B}


def load_costs(spec: str) -> CostModel:
    """A cost model by name (``cpu``, ``gpu-70b``) or from a JSON file."""
    if spec in COSTS:
        return COSTS[spec]()
    path = Path(spec)
    if not path.is_file():
        raise InvalidRequestError(f"unknown cost model {spec!r}: use one of {', '.join(COSTS)} or a JSON file", "costs")
    try:
        return CostModel.from_json(json.loads(path.read_text()), source=str(path))
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"cost model file {path} is not JSON: {e}", "costs") from None


def fit_costs(
    records: list[StepRecord], name: str = "measured", prefill_per_token_s: float = 0.0, min_count: int = 5
) -> CostModel:
    """Fit a cost model to real step records: median verify seconds per block size seen at least
    ``min_count`` times (rarer sizes are too noisy to trust; the line between the kept sizes covers
    them), and median draft seconds per drafted token."""
    agg = StepAggregate.of(records)
    if not agg.steps:
        raise InvalidRequestError("no step records to fit a cost model to", "records")
    table = agg.verify_table(statistics.median, min_count) or agg.verify_table(statistics.median)
    ks = sorted(table)
    base = table[ks[0]]
    slope = (table[ks[-1]] - base) / (ks[-1] - ks[0]) if len(ks) > 1 else 0.0
    if ks[0] != 1:
        base = max(base - slope * (ks[0] - 1), 1e-9)
    return CostModel(
        name,
        statistics.median(agg.draft_per_token) if agg.draft_per_token else 0.0,
        base,
        max(slope, 0.0),
        statistics.median(agg.other),
        prefill_per_token_s,
        jitter=0.03,
        verify_table=table,
        source="fitted to step records",
    )
