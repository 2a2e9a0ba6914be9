"""Context-dependent logit rules of one request: penalties, ``logit_bias``, ``min_tokens`` (and ``ignore_eos``).

A rule changes the logits of a position according to the tokens before it. Under speculation the rows of a
verify block ``[last, ŷ1..ŷτ]`` have different contexts: row ``i`` continues ``context + ŷ1..ŷi``, so it is
processed with the counts of that context (``RulesState.apply``: the block's tokens added row by row, one
scatter and one cumulative sum, no per-row loop). The draft model applies the same rules at each drafting
position with its own context (``apply`` with ``offset``), so its q is what it sampled from. The target side
alone decides correctness: each row is processed exactly as a target-only run processes that position.

Order, on the raw logits (float32): ``logit_bias`` added; ``repetition_penalty`` (HF/vLLM: a positive logit
of a token seen in prompt + generated tokens is divided by it, a negative one multiplied); frequency and
presence penalties (OpenAI/vLLM, generated tokens only: ``logit[t] -= frequency*count[t] +
presence*(count[t] > 0)``); EOS masked to -inf while fewer than ``min_tokens`` tokens have been generated
at that row; last, every token an output format (``response_format``, ``specdec.output_format``) does not allow
there masked to -inf. Temperature, top-k, top-p and min-p come after (``sampling.logits_to_probs``).

``LogitsRules`` (the checked settings) is plain data; only ``RulesState`` needs torch, and imports it when made
(the engine's step imports this module without torch, for the simulator). A format's matcher is made by the engine
(``Engine.formats``, which holds the tokenizer) and handed to the ``RulesState``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdec.errors import InvalidRequestError
from specdec.output_format import OutputFormat

if TYPE_CHECKING:
    import torch

    from specdec.output_format import FormatMatcher


@dataclass(frozen=True)
class LogitsRules:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False  # not a logits rule: EOS is kept as a token and does not end the request
    output_format: OutputFormat | None = None  # the format the output must follow (``specdec.output_format``)

    @classmethod
    def checked(
        cls,
        *,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        response_format: OutputFormat | Mapping[str, Any] | None = None,
        vocab_size: int,
        max_new_tokens: int,
    ) -> LogitsRules:
        """The rules of a request, each value checked (``InvalidRequestError`` naming the field); the arguments are
        named as ``Engine.start`` names them (``rules_from_settings`` gives them back so)."""
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {value!r}", name)
        if not _is_number(repetition_penalty) or not 0 < repetition_penalty < float("inf"):
            raise InvalidRequestError(
                f"repetition_penalty must be a number > 0 (1 = off), got {repetition_penalty!r}", "repetition_penalty"
            )
        bias: dict[int, float] = {}
        for key, value in (logit_bias or {}).items():
            if isinstance(key, bool) or not isinstance(key, int):
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            if not 0 <= key < vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token id {key} is outside the vocabulary (size {vocab_size})", "logit_bias"
                )
            if not _is_number(value) or not -100.0 <= value <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias value for token {key} must be in [-100, 100], got {value!r}", "logit_bias"
                )
            if value:
                bias[key] = float(value)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be an integer >= 0, got {min_tokens!r}", "min_tokens")
        if min_tokens > max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens ({min_tokens}) must not exceed max_new_tokens ({max_new_tokens})", "min_tokens"
            )
        if not isinstance(ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")
        fmt = OutputFormat.parse(response_format)
        if fmt is not None:  # the format ends the output (only EOS allowed once it is complete)
            for name, value in (("min_tokens", min_tokens), ("ignore_eos", ignore_eos)):
                if value:
                    raise InvalidRequestError(
                        f"{name} cannot be combined with response_format: the format decides where the output ends",
                        name,
                    )
        return cls(
            float(presence_penalty),
            float(frequency_penalty),
            float(repetition_penalty),
            bias,
            min_tokens,
            ignore_eos,
            fmt,
        )

    @property
    def active(self) -> bool:
        """Whether any rule touches the logits (most requests: no, and then nothing is done at all)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.output_format is not None
        )

    def settings(self) -> dict[str, object]:
        """The non-default settings, for request summaries (``rules_from_settings`` reads them back)."""
        out: dict[str, object] = {}
        for name, default in _SCALAR_DEFAULTS:
            if getattr(self, name) != default:
                out[name] = getattr(self, name)
        if self.logit_bias:
            out["logit_bias"] = dict(self.logit_bias)
        if self.output_format is not None:
            out["response_format"] = self.output_format.settings()
        return out


_SCALAR_DEFAULTS = (
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("min_tokens", 0),
    ("ignore_eos", False),
)


def rules_from_settings(settings: Mapping[str, object]) -> dict[str, Any]:
    """The ``Engine.start`` keyword arguments of the rules a request summary recorded (``LogitsRules.settings``, as a
    trace holds them: ``logit_bias`` keyed by token ids written as JSON strings), so a replay decodes as the request
    did."""
    out: dict[str, Any] = {name: settings[name] for name, _ in _SCALAR_DEFAULTS if name in settings}
    bias = settings.get("logit_bias")
    if isinstance(bias, Mapping) and bias:
        out["logit_bias"] = {int(token): float(value) for token, value in bias.items()}
    fmt = settings.get("response_format")
    if isinstance(fmt, Mapping):
        out["response_format"] = dict(fmt)
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN != NaN


class RulesState:
    """The counts one request's rules need, kept incrementally as tokens are committed.

    ``counts[t]``: how often ``t`` was generated; ``seen[t]``: ``t`` is in prompt + generated tokens;
    ``generated``: tokens generated so far; ``matcher``: the output format's place (a rules with a format only).
    """

    def __init__(
        self,
        rules: LogitsRules,
        prompt_ids: Sequence[int],
        vocab_size: int,
        eos_ids: Collection[int],
        device: torch.device,
        matcher: FormatMatcher | None = None,
    ) -> None:
        import torch

        if (rules.output_format is None) != (matcher is None):
            raise ValueError("a RulesState has a format matcher exactly when its rules have an output format")
        self.matcher = matcher
        self.rules = rules
        self.vocab_size = vocab_size
        self.device = device
        self.generated = 0
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if rules.repetition_penalty != 1.0 and prompt_ids:
            self.seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        self._eos = torch.tensor(sorted(t for t in eos_ids if 0 <= t < vocab_size), dtype=torch.long, device=device)
        ids = sorted(rules.logit_bias)
        self._bias_ids = torch.tensor(ids, dtype=torch.long, device=device)
        self._bias = torch.tensor([rules.logit_bias[i] for i in ids], dtype=torch.float32, device=device)
        self._needs_counts = bool(rules.presence_penalty or rules.frequency_penalty or rules.repetition_penalty != 1.0)

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the context (generated)."""
        if not tokens:
            return
        import torch

        self.generated += len(tokens)
        if self.matcher is not None:
            self.matcher.commit(tokens)
        if self._needs_counts:
            ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
            self.counts.index_add_(0, ids, torch.ones(len(tokens), device=self.device))
            self.seen[ids] = True

    def apply(self, logits: torch.Tensor, tokens: Sequence[int] = (), offset: int = 0) -> torch.Tensor:
        """``logits [k, V]`` processed by the rules; row ``i`` continues ``context + tokens[:offset + i]``.

        A verify block ``[last, ŷ1..ŷτ]``: ``tokens = ŷ1..ŷτ``, ``offset = 0``. One draft position after the
        draft tokens ``d``: ``tokens = d``, ``offset = len(d)``, ``k = 1``. Returns ``logits`` itself when no
        rule is active.
        """
        rules = self.rules
        if not rules.active:
            return logits
        import torch

        k = logits.shape[0]
        device = logits.device
        out = logits.float().clone()
        width = out.shape[-1]
        if rules.logit_bias:
            ids, bias = self._bias_ids.to(device), self._bias.to(device)
            keep = ids < width
            out[:, ids[keep]] += bias[keep]
        if self._needs_counts:
            counts = self.counts.to(device)[:width].expand(k, width)
            seen = self.seen.to(device)[:width].expand(k, width)
            extra = list(tokens[: offset + k - 1])
            if extra:
                step = torch.zeros(len(extra) + 1, width, device=device)
                ids = torch.tensor(extra, dtype=torch.long, device=device)
                step[torch.arange(1, len(extra) + 1, device=device), ids] = 1.0
                added = step.cumsum(0)[offset : offset + k]  # row i: the tokens before it in this block
                counts = counts + added
                seen = seen | (added > 0)
            if rules.repetition_penalty != 1.0:
                r = rules.repetition_penalty
                out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
            if rules.frequency_penalty or rules.presence_penalty:
                out = out - (rules.frequency_penalty * counts + rules.presence_penalty * (counts > 0).float())
        if rules.min_tokens and self._eos.numel():
            # Row i is generated token number generated + offset + i (0-based): masked while that is < min_tokens.
            masked = min(k, max(0, rules.min_tokens - self.generated - offset))
            if masked:
                eos = self._eos.to(device)
                out[:masked, eos[eos < width]] = float("-inf")
        if self.matcher is not None:
            allowed = self.matcher.allowed(tokens, offset, k, width, device)
            out.masked_fill_(~allowed, float("-inf"))
            # A draft whose head was cut to its likeliest tokens (``--draft-vocab``) may have no logit for any token
            # the format allows (the end-of-sequence token, say): it draws among them uniformly. (A target's logits
            # are finite: its rows always keep one.)
            stuck = out.amax(dim=-1) == float("-inf")
            if bool(stuck.any()):
                out[stuck] = torch.zeros_like(out[stuck]).masked_fill_(~allowed[stuck], float("-inf"))
        return out
