"""Plain-text rendering of a diagnosis: ranked findings, each with its evidence and a recommended action."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.diagnose import Diagnosis

MARK = {"critical": "[CRITICAL]", "warning": "[WARNING] ", "info": "[info]    "}


def render_text(d: Diagnosis, width: int = 100) -> str:
    st = d.stats
    lines = [f"specdec diagnose: {d.trace.path}  ({st.n_requests} requests, {len(st.steps)} steps)"]
    if st.predicted_steps:
        lines.append(
            f"  note: {st.predicted_steps} step(s) that drafted from requests' predicted outputs (prediction) left out "
            "of the analysis: they say how well a prediction matched, not how the drafter does"
        )
    if d.trace.bad_lines:
        lines.append(f"  note: {len(d.trace.bad_lines)} unreadable line(s) skipped, first: {d.trace.bad_lines[0]}")
    problems = d.problems
    lines.append(
        f"  {len(problems)} problem(s) found" if problems else "  no problems found: speculation looks healthy"
    )
    lines.append("")
    rank = 0
    for f in d.findings:
        if f.severity != "info":
            rank += 1
            head = f"{rank}. {MARK[f.severity]} {f.title}  ({f.code})"
        else:
            head = f"-  {MARK[f.severity]} {f.title}  ({f.code})"
        lines.append(head)
        for e in f.evidence:
            lines.extend(textwrap.wrap(e, width, initial_indent="     - ", subsequent_indent="       "))
        if f.code != "summary":
            lines.extend(textwrap.wrap(f.action, width, initial_indent="     → ", subsequent_indent="       "))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
