"""``specdec diagnose TRACE``: ranked causes of a low speedup (or of wrong output), with evidence and actions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.errors import SpecdecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose",
        help="explain a trace: why the speedup is low, whether the output can be trusted",
        description="Read a JSONL trace (--trace of generate/serve/bench), or several as one, and print ranked "
        "findings, each with its evidence and a recommended action. Exit status: 0 (with --strict: 1 when a warning "
        "or critical finding is made), 2 bad input.",
    )
    p.add_argument(
        "trace",
        type=Path,
        nargs="+",
        help="trace file (JSONL, see docs/trace.md); several are read as one trace (a Ray fleet's run.<replica>.jsonl)",
    )
    p.add_argument("--html", type=Path, default=None, metavar="FILE", help="also write an HTML report with plots")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when problems are found (for CI)")
    p.set_defaults(func=run, loads_models=False)  # no models: cli.main leaves transformers unloaded


def run(args: argparse.Namespace) -> int:
    from specdec.diagnose import diagnose

    d = diagnose(args.trace)
    if args.html is not None:
        from specdec.diagnose.html import render_html

        try:
            args.html.write_text(render_html(d), encoding="utf-8")
        except OSError as e:
            raise SpecdecError(f"cannot write the HTML report to {args.html}: {e.strerror or e}") from e
    if args.json:
        print(json.dumps(d.to_json(), indent=2, ensure_ascii=False))
    else:
        print(d.text(), end="")
        if args.html is not None:
            print(f"HTML report: {args.html}")
    return 1 if args.strict and d.problems else 0
