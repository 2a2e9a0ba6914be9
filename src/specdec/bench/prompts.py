"""Prompt files, the one reader for every tool that takes ``--prompts`` (``specdec bench``, ``tune``, ``audit``,
``benchmarks/load_test.py``): JSONL, each line a prompt; and ``bench``'s τ lists."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specdec.errors import InvalidRequestError

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "heldout_prompts.jsonl"
# What a prompt file holds, for every ``--prompts`` help text.
FILE_HELP = 'JSONL, one prompt per line: a JSON string or an object with a "prompt" field'


@dataclass
class Prompt:
    id: str
    text: str
    source: str = ""
    ids: list[int] = field(default_factory=list)


def load_prompts(path: str | Path) -> list[Prompt]:
    """A JSONL file, one prompt per line: a JSON string, or an object with a non-empty string ``"prompt"``
    (``"id"`` and ``"source"`` optional; a line without an id is ``line<N>``). Blank lines are skipped. Errors
    (``InvalidRequestError``, param ``prompts``) name the file and the line."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"prompt file not found: {p}", "prompts")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidRequestError(f"cannot read prompt file {p}: {reason}", "prompts") from None
    prompts: list[Prompt] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{p}:{n}: not valid JSON ({e.msg})", "prompts") from None
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise InvalidRequestError(
                f'{p}:{n}: expected a non-empty JSON string or an object with a non-empty string "prompt"', "prompts"
            )
        prompts.append(Prompt(id=str(obj.get("id", f"line{n}")), text=obj["prompt"], source=str(obj.get("source", ""))))
    if not prompts:
        raise InvalidRequestError(f"prompt file {p} holds no prompts", "prompts")
    ids = [q.id for q in prompts]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise InvalidRequestError(f"prompt file {p}: id {dup!r} appears more than once", "prompts")
    return prompts


def parse_taus(text: str) -> list[int]:
    """``"1-8"``, ``"2,4,6"`` or a mix (``"1-3,6"``) -> sorted distinct τ values >= 1."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                out.update(range(lo, hi + 1))
            elif part:
                out.add(int(part))
    except ValueError:
        raise InvalidRequestError(f"--taus: cannot read {text!r}; use e.g. 1-8 or 2,4,6", "taus") from None
    if not out or min(out) < 1:
        raise InvalidRequestError(f"--taus: τ values must be integers >= 1, got {text!r}", "taus")
    return sorted(out)
