"""``diagnose``: read a trace, find why speculation is slow (or wrong), rank the findings.

``diagnose(path_or_trace) -> Diagnosis``; ``Diagnosis.text()`` / ``.to_json()``; the HTML report
with plots is ``specdec.diagnose.html.render_html``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.diagnose.analysis import TraceStats, analyse
from specdec.diagnose.checks import CHECKS, Context, Finding
from specdec.trace import Trace, read_trace


@dataclass
class Diagnosis:
    trace: Trace
    stats: TraceStats
    findings: list[Finding]  # ranked: the most likely / most costly cause first

    @property
    def problems(self) -> list[Finding]:
        """Findings that need action (warning or critical)."""
        return [f for f in self.findings if f.severity != "info"]

    @property
    def top(self) -> Finding | None:
        return self.problems[0] if self.problems else None

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": self.trace.path,
            "requests": self.stats.n_requests,
            "steps": len(self.stats.steps),
            "predicted_steps": self.stats.predicted_steps,  # drafted from predicted outputs: not analysed
            "healthy": not self.problems,
            "findings": [f.to_json() for f in self.findings],
            "unreadable_lines": self.trace.bad_lines,
        }

    def text(self) -> str:
        from specdec.diagnose.report import render_text

        return render_text(self)


def diagnose(source: str | Path | Sequence[str | Path] | Trace) -> Diagnosis:
    trace = source if isinstance(source, Trace) else read_trace(source)
    ctx = Context(trace=trace, stats=analyse(trace))
    for check in CHECKS.values():
        for finding in check(ctx):
            ctx.found[finding.code] = finding
    findings = sorted(ctx.found.values(), key=Finding.rank_key)
    return Diagnosis(trace=trace, stats=ctx.stats, findings=findings)


__all__ = ["Diagnosis", "Finding", "diagnose"]
