"""Cost models: seconds for drafting, verifying a block, per-step overhead and prefill.

``cpu`` is "measured on this machine": the JSON file ``specdec bench``/``specdec tune`` write
(``$SPECDEC_COSTS`` or ``~/.cache/specdec/costs.json``) when present, else defaults measured on the
development machine (2-core Zen4 CPU, 8.4M-parameter Llama target in bf16 through the native
runtime, 1.9M 2-layer draft in fp32: verify 3.80 ms for 1 token + 0.047 ms per extra token,
draft 0.59 ms per token, c ≈ 0.16). ``gpu-70b`` is the issue's planning example: a 70B target on
one GPU (verify 25 ms + 0.3 ms per extra token) with a 1B draft at 4 ms per token; its prefill,
0.02 ms per prompt token, assumes most of a prompt is prefix-cached (as in a writing assistant).

Batched steps (many sequences sharing one draft and one target pass, ``simulate_batched``) are costed by
``verify_rows`` (the target pass by its total rows: a measured table by rows, else a memory floor then a
compute slope, t = base + max(floor, per_row·rows)), ``draft_forward`` (one lockstep draft forward by the
sequences drafting in it) and ``step_other`` (the rest of the step, per sequence). A model without batched
figures (``gpu-70b``, a cost file written before them) costs a pass of r rows as a block of r tokens. The
``cpu`` batched defaults are ASSUMPTIONS until measured, shaped after the shipped default pair on the CPU
kernel (docs/benchmarks.md): a one-token pass 2.5 ms (memory-bound: streaming the weights), 16 rows 2.2×
and 64 rows 7× that (fp32 multiply-adds bound beyond ~4 rows), a draft forward 0.15 ms for one row and 5%
more per further row, 0.1 ms of step overhead per sequence. A ``costs.json`` that carries the batched
fields overrides them.
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
    # Batched steps (see the module's docstring). A target pass of r rows: rows_table[r] when measured (between
    # measured sizes: interpolated), else pass_base_s + max(pass_floor_s, pass_per_row_s·r) when pass_per_row_s is
    # set, else verify(r). A lockstep draft forward over n sequences: draft_forward_s·(1 + draft_row_frac·(n-1))
    # (draft_forward_s unset: draft_per_token_s). The rest of a step: other_per_sequence_s per sequence (unset:
    # other_s).
    pass_base_s: float = 0.0
    pass_floor_s: float = 0.0
    pass_per_row_s: float = 0.0
    rows_table: dict[int, float] = field(default_factory=dict)
    draft_forward_s: float | None = None
    draft_row_frac: float = 0.05
    other_per_sequence_s: float | None = None
    batch_source: str = ""  # where the batched figures come from (empty: none given, derived from the solo ones)

    def verify(self, block: int) -> float:
        return self.verify_table.get(block, self.verify_base_s + self.verify_per_extra_s * (block - 1))

    def verify_rows(self, rows: int) -> float:
        """Seconds of one target pass over ``rows`` rows in all (every sequence's [last token, drafts])."""
        if self.rows_table:
            if rows in self.rows_table:
                return self.rows_table[rows]
            sizes = sorted(self.rows_table)
            lo = max((s for s in sizes if s < rows), default=None)
            hi = min((s for s in sizes if s > rows), default=None)
            if lo is not None and hi is not None:
                a, b = self.rows_table[lo], self.rows_table[hi]
                return a + (b - a) * (rows - lo) / (hi - lo)
            if hi is None and len(sizes) > 1:  # beyond the table: the slope of its last two sizes
                s0, s1 = sizes[-2], sizes[-1]
                slope = max(0.0, (self.rows_table[s1] - self.rows_table[s0]) / (s1 - s0))
                return self.rows_table[s1] + slope * (rows - s1)
            return self.rows_table[sizes[0]] * max(1.0, rows / sizes[0]) if hi is None else self.rows_table[hi]
        if self.pass_per_row_s > 0:
            return self.pass_base_s + max(self.pass_floor_s, self.pass_per_row_s * rows)
        return self.verify(rows)

    def draft_forward(self, sequences: int) -> float:
        """Seconds of one lockstep draft forward over ``sequences`` sequences."""
        one = self.draft_per_token_s if self.draft_forward_s is None else self.draft_forward_s
        return one * (1.0 + self.draft_row_frac * (max(1, sequences) - 1))

    def step_other(self, sequences: int) -> float:
        """Seconds of the rest of a step shared by ``sequences`` sequences (policy, bookkeeping, commits)."""
        per = self.other_s if self.other_per_sequence_s is None else self.other_per_sequence_s
        return per * max(1, sequences)

    def noisy(self, seconds: float, rng: random.Random) -> float:
        return seconds * math.exp(rng.gauss(0.0, self.jitter)) if self.jitter else seconds

    @property
    def c(self) -> float:
        """Draft cost per token / target cost per pass."""
        return self.draft_per_token_s / self.verify_base_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["verify_table"] = {str(k): v for k, v in self.verify_table.items()}
        d["rows_table"] = {str(k): v for k, v in self.rows_table.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "file", batch_defaults: CostModel | None = None) -> CostModel:
        """A cost model from JSON (``to_json``; files written before the batched fields read as before). The
        batched fields a file lacks come from ``batch_defaults`` when given, else from the solo figures."""
        try:
            table = {int(k): float(v) for k, v in (d.get("verify_table") or {}).items()}
            batched = _batched_fields(d, source)
            if batched is None and batch_defaults is not None:
                batched = {k: getattr(batch_defaults, k) for k in _BATCH_KEYS}
            elif batched is None:
                batched = {}
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
                **batched,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"bad cost model JSON ({source}): {e!r}", "costs") from None


_BATCH_KEYS = (
    "pass_base_s",
    "pass_floor_s",
    "pass_per_row_s",
    "rows_table",
    "draft_forward_s",
    "draft_row_frac",
    "other_per_sequence_s",
    "batch_source",
)


def _batched_fields(d: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The batched figures of a cost file, or None when it has none (a file written before them)."""
    if not any(k in d for k in _BATCH_KEYS[:-1]):
        return None
    opt = {k: (None if d.get(k) is None else float(d[k])) for k in ("draft_forward_s", "other_per_sequence_s")}
    return {
        "pass_base_s": float(d.get("pass_base_s", 0.0)),
        "pass_floor_s": float(d.get("pass_floor_s", 0.0)),
        "pass_per_row_s": float(d.get("pass_per_row_s", 0.0)),
        "rows_table": {int(k): float(v) for k, v in (d.get("rows_table") or {}).items()},
        "draft_row_frac": float(d.get("draft_row_frac", 0.05)),
        "batch_source": str(d.get("batch_source") or source),
        **opt,
    }


CPU_DEFAULT = CostModel(
    "cpu",
    0.59e-3,
    3.80e-3,
    0.047e-3,
    other_s=0.15e-3,
    prefill_per_token_s=0.06e-3,
    source="defaults measured on a 2-core Zen4 CPU",
    # Batched: assumed until measured (see the module's docstring): 1-4 rows 2.5 ms, 16 rows 5.5 ms, 64 rows 17.5 ms.
    pass_base_s=1.5e-3,
    pass_floor_s=1.0e-3,
    pass_per_row_s=0.25e-3,
    draft_forward_s=0.15e-3,
    draft_row_frac=0.05,
    other_per_sequence_s=0.1e-3,
    batch_source="assumed (shaped after the default pair on the CPU kernel), until measured",
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
        return replace(CostModel.from_json(data, source=str(path), batch_defaults=CPU_DEFAULT), name="cpu")
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
