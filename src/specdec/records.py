"""Per-step and per-request facts. Trace, metrics, bench, diagnose and the UI read these.

Conventions (used the same way everywhere):
- ``tau``: draft tokens proposed in the step (0 = plain target step).
- ``accept_flags[t]``: outcome of the acceptance test at draft position t+1 taken alone
  (r_t <= p/q, or draft == target argmax when greedy). Only the consecutively accepted
  prefix counts: ``n_accepted`` = index of the first False (``tau`` when none).
- every step emits ``n_accepted + 1`` tokens: the accepted drafts, then one *correction*
  token whose ``correction`` kind is ``recovered`` (at a rejection), ``bonus`` (all tau
  accepted) or ``plain`` (tau = 0). ``emitted`` may be shorter when a stop condition
  cut the step (EOS, stop string, max_new_tokens). A plain step whose target passes were chained
  (``target_passes`` > 1, ``Engine.chain_plain``) emits one token a pass: ``target_passes`` plain tokens.
- mean accepted length = emitted tokens per target pass, the correction token included.
- in a batched step every sequence's record carries the whole step's times (what the request waited);
  ``batch_size`` and ``rows`` say how many sequences and target rows shared the passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal, TypeVar

Correction = Literal["recovered", "bonus", "plain"]
FinishReason = Literal["stop", "length", "verify_budget", "cancelled"]

TRACE_SCHEMA_VERSION = 1
# A step record's ``reason`` when its draft was read from the request's predicted output (``drafters.prediction``).
PREDICTION_REASON = "prediction"
# A sequence that joined a step after its drafts (``Engine.step``'s ``join``): its prompt in the pass, no draft.
JOINED_REASON = "joined after the step's drafts"


def correction_kind(tau: int, n_accepted: int) -> Correction:
    """The kind of a step's last token: ``plain`` (τ = 0), ``bonus`` (all τ accepted), else ``recovered``."""
    if tau == 0:
        return "plain"
    return "bonus" if n_accepted == tau else "recovered"


@dataclass
class Verdict:
    """What verifying one sequence's block decided (``specdec.verify``; the simulator's target side too)."""

    accept_flags: list[bool]  # per-position test outcome, before taking the prefix
    n_accepted: int
    tokens: list[int]  # [ŷ_1..ŷ_n̂, ȳ]
    correction: Correction
    target_token_probs: list[float]  # p_t(ŷ_t), for traces
    draft_token_probs: list[float]  # q_t(ŷ_t), for traces
    # Target passes the verdict took: more than one for a plain sequence (greedy or sampled) whose step chained its
    # passes (``Engine.chain_plain``), each pass's token (argmax or draw) the next one's row; its tokens one a pass.
    passes: int = 1


@dataclass
class StepRecord:
    request_id: str
    step: int  # 0-based index of the step within its request
    prompt_len: int
    context_len: int  # tokens in the context before this step
    policy: str
    reason: str  # why the policy chose tau this step
    tau: int
    draft_tokens: list[int]
    accept_flags: list[bool]
    n_accepted: int
    correction: Correction
    emitted: list[int]  # tokens appended to the output by this step (after stop truncation)
    draft_time: float  # seconds proposing the draft (draft model forwards, sampling)
    verify_time: float  # seconds in the target's forward pass and the acceptance rule
    # The rest of the step: policy, bookkeeping, stop checks, detokenising (from the request's previous step; the
    # prefills of requests admitted in between are theirs, left out here and counted in latency).
    other_time: float
    # Of ``other_time``, the policies' own work: their learning since the request's previous step and this step's plan
    # (a batch plan made afresh once every few steps carries the learning of the steps replayed before it).
    policy_time: float = 0.0
    draft_token_probs: list[float] = field(default_factory=list)  # q(ŷ_t): the draft's probability of its token
    target_token_probs: list[float] = field(default_factory=list)  # p(ŷ_t) of each draft token (sampled requests)
    draft_confidence: list[float] = field(default_factory=list)  # the draft's top probability at each position
    tau_planned: int | None = None  # τ the policy asked for, before the engine's clamp and the draft rule
    batch_size: int = 1  # sequences that shared this step's draft and target passes
    # Rows of the step's target pass over all its sequences (this one's: tau + 1, and its prompt's tokens at the first
    # step of a request whose prefill joined the step's pass).
    rows: int = 0
    prompt_rows: int = 0  # of those rows, prompt tokens (joining sequences' prompts, pieces of longer ones)
    drafting: int = 0  # sequences of the step that drafted (each lockstep draft forward runs over those left)
    draft_passes: int = 0  # lockstep draft forwards the step ran (its deepest draft)
    # Context tokens the step's drafter took in before drafting, over all its sequences (a draft model's catch-up:
    # 1-2 per sequence that drafted its previous step, one more per plain step since; 0 without a draft model).
    draft_fed: int = 0
    verify_passes: int = 0  # target passes this request has used, this step's included
    max_verify_passes: int | None = None  # the request's cap (its own, or the policy's allowance if smaller)
    # Target passes this step used for this request: 1, or a plain step's chain (``Engine.chain_plain``), each pass one
    # row of it, fed the argmax of the one before; ``rows`` and ``batch_size`` are the first pass's.
    target_passes: int = 1

    @property
    def predicted(self) -> bool:
        """Whether the step drafted from the request's predicted output rather than from its drafter."""
        return self.reason == PREDICTION_REASON

    @property
    def n_emitted_accepted(self) -> int:
        """Accepted draft tokens that reached the output (a stop may cut the step short)."""
        return min(self.n_accepted, len(self.emitted))

    @property
    def total_time(self) -> float:
        return self.draft_time + self.verify_time + self.other_time

    @property
    def pass_key(self) -> tuple[float, float, int, int]:
        """What the records of one step share and no other step's do: its pass and draft times, its rows and its
        sequences (a batched step writes one record per sequence, each with the step's whole times)."""
        return (self.verify_time, self.draft_time, self.rows, self.batch_size)

    def to_json(self) -> dict[str, Any]:
        # Its fields are numbers, strings and flat lists of them: a copy of each list, not ``asdict``'s deep copy of
        # every value (~50 µs a record against ~5; a traced server writes one a sequence a step: at 16 sequences ~1 ms
        # of every step went to the trace, most of it here).
        d = {name: list(v) if isinstance(v := getattr(self, name), list) else v for name in _STEP_FIELDS}
        d["type"] = "step"
        d["v"] = TRACE_SCHEMA_VERSION
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StepRecord:
        """A trace's step line (``to_json``) back as a record: see ``field_values`` for absent and extra keys."""
        return cls(**field_values(cls, d))

    def confidences(self) -> list[float]:
        """The draft's top probability at each drafted position. Records that carry ``draft_confidence`` give it;
        older ones (and traces written before the field) give ``draft_token_probs``, which held the confidence in
        greedy mode and q(ŷ) when sampling, the nearest figure they recorded."""
        conf = getattr(self, "draft_confidence", None)
        return list(conf) if conf else list(self.draft_token_probs)


_STEP_FIELDS = tuple(f.name for f in fields(StepRecord))


def steady_rest(records: Sequence[StepRecord]) -> StepRecord | None:
    """The record of a step that carries the step's own rest: the least ``other_time`` of the records whose request
    stepped before (in a batched step every sequence that stepped in the step before carries the same). A request's
    first step counts its rest from its admission, a moment before the step's plan, not from the step before: taken
    as the step's least, those short rests priced a 16-sequence server's steps ~0.5 ms short wherever requests kept
    joining (2026-11-26). None when every record is a request's first step."""
    best: StepRecord | None = None
    for r in records:
        if r.step > 0 and (best is None or r.other_time < best.other_time):
            best = r
    return best


def tokens_made(records: Sequence[StepRecord]) -> int:
    """Tokens a step's records made before any stop cut them: each record's accepted draft tokens and its own token
    (what a plan predicts of a step; ``emitted`` is after the cut); a chained plain step's, one a pass."""
    return sum(r.n_accepted + r.target_passes for r in records)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    target_passes: int = 0  # verify passes (prefill not counted)
    drafted: int = 0
    accepted: int = 0  # accepted draft tokens that reached the output
    draft_time: float = 0.0
    verify_time: float = 0.0
    other_time: float = 0.0
    prefill_time: float = 0.0
    latency: float = 0.0  # wall time of the whole request, prefill included
    finish_reason: FinishReason = "length"
    # Predicted outputs (``Engine.start(prediction=...)``): the prediction's length (0: none), and of the tokens the
    # steps drafted from it, those accepted into the output and those rejected.
    prediction_tokens: int = 0
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    # Prompt tokens whose keys and values the target's prefix cache held (copied, not computed; 0 without one, and
    # for a sample forked from a sibling's prefill: the prompt's are counted once, at its first sample).
    cached_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """α: accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass, the correction token included."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        decode = self.latency - self.prefill_time
        return self.new_tokens / decode if decode > 0 else 0.0

    def add(self, rec: StepRecord) -> None:
        self.steps += 1
        self.target_passes += rec.target_passes
        self.new_tokens += len(rec.emitted)
        self.drafted += rec.tau
        self.accepted += rec.n_emitted_accepted
        if rec.predicted:
            self.prediction_accepted += rec.n_emitted_accepted
            self.prediction_rejected += rec.tau - rec.n_accepted
        self.draft_time += rec.draft_time
        self.verify_time += rec.verify_time
        self.other_time += rec.other_time

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        d["tokens_per_s"] = self.tokens_per_s
        return d


@dataclass
class RequestSummary:
    """One per finished request: the trace's closing line for that request."""

    request_id: str
    policy: str
    prompt_len: int
    stats: GenerationStats
    settings: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None  # lets `specdec audit --trace` replay the request

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RequestSummary:
        """A trace's request line (``to_json``: the stats flattened into it) back as a summary; the derived figures
        it also carries (``acceptance_rate`` ...) are recomputed by ``GenerationStats``."""
        return cls(**field_values(cls, {**d, "stats": GenerationStats(**field_values(GenerationStats, d))}))

    def to_json(self) -> dict[str, Any]:
        extra = {"prompt_ids": self.prompt_ids} if self.prompt_ids is not None else {}
        return {
            "type": "request",
            "v": TRACE_SCHEMA_VERSION,
            "request_id": self.request_id,
            "policy": self.policy,
            "prompt_len": self.prompt_len,
            "settings": self.settings,
            **self.stats.to_json(),
            **extra,
        }


R = TypeVar("R")


def field_values(cls: type[R], d: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``d`` that are fields of the dataclass ``cls``, to build one from a JSON line. Other keys (``type``,
    ``v``, ``ts``, derived figures) are left out; a field ``d`` lacks takes its default (lines written before the
    field existed), and a field without a default must be there: ``KeyError`` names it."""
    out: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in d:
            out[f.name] = d[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:
            raise KeyError(f.name)
    return out
