"""Step-by-step rendering of speculative decoding for the terminal (ANSI colours) and for logs (plain text).

Each ``StepRecord`` becomes one line: the accepted draft tokens, the rejected remainder of the draft (never part of
the output), the correction token the target supplied (recovered at a rejection, bonus when every draft token was
accepted, plain when τ = 0), the τ the policy chose and its reason. A footer sums up the request.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from specdec.records import GenerationStats, StepRecord

Style = Literal["ansi", "plain"]
STYLES: tuple[Style, ...] = ("ansi", "plain")

# SGR codes; every styled span is closed with RESET so a cut line never leaks colour.
RESET = "\x1b[0m"
_SGR: dict[str, str] = {
    "accepted": "\x1b[32m",  # green
    "rejected": "\x1b[2;9m",  # dim + strikethrough
    "cut": "\x1b[2;32m",  # dim green: accepted, then dropped by a stop condition
    "recovered": "\x1b[1;33m",  # bold yellow
    "bonus": "\x1b[1;36m",  # bold cyan
    "plain": "\x1b[1;35m",  # bold magenta: τ = 0, the target alone
    "meta": "\x1b[2m",  # dim: step number, reason
    "tau": "\x1b[1m",
}

# Whitespace made visible inside a token (ANSI form); plain form escapes like Python string literals.
_VISIBLE = {" ": "·", "\n": "↵", "\t": "→", "\r": "␍"}


@dataclass(frozen=True)
class StepParts:
    """The tokens of one step, split by what happened to them."""

    accepted: list[int]  # accepted draft tokens that reached the output
    cut: list[int]  # accepted draft tokens dropped because a stop condition ended the request first
    rejected: list[int]  # the first rejected draft token and everything drafted after it
    correction: int | None  # the token the target supplied (None when a stop cut the step before it)

    @classmethod
    def of(cls, rec: StepRecord) -> StepParts:
        kept = rec.n_emitted_accepted
        correction = rec.emitted[rec.n_accepted] if len(rec.emitted) > rec.n_accepted else None
        return cls(
            accepted=rec.draft_tokens[:kept],
            cut=rec.draft_tokens[kept : rec.n_accepted],
            rejected=rec.draft_tokens[rec.n_accepted :],
            correction=correction,
        )


def plain_token(text: str) -> str:
    """A token as a quoted literal with whitespace and control characters escaped: ``' foo\\n'``."""
    body = text.replace("\\", "\\\\").replace("'", "\\'")
    body = body.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return "'" + "".join(c if c.isprintable() or c == " " else f"\\x{ord(c):02x}" for c in body) + "'"


def visible_token(text: str) -> str:
    """A token for the terminal: spaces as ·, newlines as ↵, other control characters escaped, empty as ∅."""
    if not text:
        return "∅"
    return "".join(_VISIBLE.get(c, c if c.isprintable() else f"\\x{ord(c):02x}") for c in text)


class StepRenderer:
    """Renders step records of one tokenizer in one style; token texts are decoded once and cached."""

    def __init__(self, tokenizer: Any, style: Style = "plain") -> None:
        if style not in STYLES:
            raise ValueError(f"unknown step style {style!r}; choose one of: {', '.join(STYLES)}")
        self.style = style
        self._decode: Callable[[list[int]], str] = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        self._pieces: dict[int, str] = {}

    def piece(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = self._decode([token])
        return self._pieces[token]

    # -- one step ----------------------------------------------------------------------------

    def step(self, rec: StepRecord) -> str:
        """One line for one step (no trailing newline)."""
        return self._ansi_step(rec) if self.style == "ansi" else self._plain_step(rec)

    def _plain_step(self, rec: StepRecord) -> str:
        parts = StepParts.of(rec)
        out = [f"step {rec.step} τ={rec.tau}"]
        if parts.accepted:
            out.append(f"[accepted: {self._plain_list(parts.accepted)}]")
        if parts.cut:
            out.append(f"[accepted, cut by stop: {self._plain_list(parts.cut)}]")
        if parts.rejected:
            out.append("[rejected: " + " ".join(f"~~{plain_token(self.piece(t))}~~" for t in parts.rejected) + "]")
        if parts.correction is not None:
            out.append(f"[{rec.correction}: {plain_token(self.piece(parts.correction))}]")
        out.append(f"(reason: {rec.reason})" if rec.reason else "")
        return " ".join(s for s in out if s)

    def _plain_list(self, tokens: list[int]) -> str:
        return " ".join(plain_token(self.piece(t)) for t in tokens)

    def _ansi_step(self, rec: StepRecord) -> str:
        parts = StepParts.of(rec)
        spans = [self._paint("accepted", t) for t in parts.accepted]
        spans += [self._paint("cut", t) for t in parts.cut]
        spans += [self._paint("rejected", t) for t in parts.rejected]
        if parts.correction is not None:
            spans.append(self._paint(rec.correction, parts.correction))
        head = f"{_SGR['meta']}{rec.step:>4}{RESET} {_SGR['tau']}τ={rec.tau:<2}{RESET} │ "
        tail = f" {_SGR['meta']}│ {rec.reason}{RESET}" if rec.reason else ""
        return head + " ".join(spans) + tail

    def _paint(self, kind: str, token: int) -> str:
        return f"{_SGR[kind]}{visible_token(self.piece(token))}{RESET}"

    # -- framing -----------------------------------------------------------------------------

    def legend(self) -> str:
        """What the colours mean (ANSI form); the plain form labels every group inline, so it has none."""
        if self.style == "plain":
            return ""
        keys = [
            ("accepted", "accepted"),
            ("rejected", "rejected (discarded)"),
            ("recovered", "recovered"),
            ("bonus", "bonus"),
            ("plain", "plain (τ=0)"),
        ]
        names = "  ".join(f"{_SGR[k]}{label}{RESET}" for k, label in keys)
        return f"{_SGR['meta']}step τ  │{RESET} {names}  {_SGR['meta']}│ policy reason   (· space, ↵ newline){RESET}"

    def footer(self, stats: GenerationStats) -> str:
        """The request in one line: α, mean accepted length, target passes, speed."""
        text = (
            f"α {stats.acceptance_rate:.2f} ({stats.accepted}/{stats.drafted} drafted tokens accepted) | "
            f"mean accepted length {stats.mean_accepted_length:.2f} tokens/pass (incl. correction token) | "
            f"{stats.target_passes} target passes | {stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s | "
            f"finish: {stats.finish_reason}"
        )
        return f"{_SGR['tau']}{text}{RESET}" if self.style == "ansi" else text


def default_style(stream: TextIO) -> Style:
    """ANSI on a terminal (unless NO_COLOR is set), plain text otherwise."""
    isatty = getattr(stream, "isatty", None)
    tty = bool(isatty and isatty())
    return "ansi" if tty and not os.environ.get("NO_COLOR") else "plain"
