"""How far back a draft model attends: the context it was trained on, not the whole one.

A small draft is trained on windows of a fixed length (the shipped draft: 256 tokens). Serving, it sees whatever the
request holds: prompts of hundreds of tokens and their continuations. Beyond the length it was trained on its
attention meets distances it never learnt, and its proposals get worse as the context grows: on the load test's
long prompts (`benchmarks/long_prompts.jsonl`, 3-730 tokens) the shipped draft's greedy acceptance at τ = 3 was 0.52
attending to everything and 0.64 attending to its last 256 tokens; on `specdec bench`'s held-out prompts (141-293
tokens, 128 new) 0.73 and 0.81 at τ = 5. Its forward also gets dearer with the context (each row reads its whole
cache: at ~450 tokens a lockstep forward of 7 sequences took twice its weights' time), and a window bounds it.

``specdec.load(draft_window=N)`` / ``--draft-window N`` makes the draft attend to its last N tokens in every layer (a
sliding window, as Mistral's; a layer with a narrower window of its own keeps it); ``"auto"`` (the default) is the
length the draft was trained on where its ``specdec_training.json`` records it (the shipped draft and drafts made by
``specdec distill``), else the whole context; ``"full"`` the whole context. Drafting only proposes: the output never
changes, only acceptance and the draft's cost. Native runtime only (the CPU kernel and the operator path); a draft on
the ``transformers`` runtime attends to everything ("auto"), or refuses an explicit window.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec.draft_vocab import means_full, whole_number  # the same spellings of "all of it": "full", None, 0, "0"
from specdec.errors import InvalidRequestError

TRAINING_FILE = "specdec_training.json"


def trained_context(model_dir: str | Path) -> int | None:
    """The sequence length the draft at ``model_dir`` was trained on (its ``specdec_training.json``'s
    ``settings.seq_len``), or None where it is not recorded."""
    path = Path(model_dir) / TRAINING_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        return None
    settings = doc.get("settings") if isinstance(doc, dict) else None
    seq_len = settings.get("seq_len") if isinstance(settings, dict) else None
    return seq_len if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > 0 else None


def resolve(model_dir: str | Path | None, choice: int | str | None) -> int | None:
    """The window for ``draft_window=choice``: ``"auto"`` (the draft's trained length where recorded, else None),
    ``"full"``/None/0 (None: the whole context), or a positive number of tokens."""
    if choice is None or means_full(choice):  # (None spelled out for the type checker)
        return None
    if choice == "auto":
        return None if model_dir is None else trained_context(model_dir)
    n = whole_number(choice)
    if n is None or n < 1:
        raise InvalidRequestError(
            f"draft_window must be auto, full or a positive number of tokens, got {choice!r}", "draft_window"
        )
    return n


def window_of(runner: Any) -> int | str | None:
    """What a loaded draft attends to, for reports: its window in tokens, "full", or None (no runner)."""
    if runner is None:
        return None
    cap = getattr(runner, "window_cap", None)
    return "full" if cap is None else int(cap)
