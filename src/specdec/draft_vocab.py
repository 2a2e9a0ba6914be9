"""A draft model's output head cut to the tokens that matter: its most frequent ones.

A small draft spends much of each forward in its output head (the shipped draft: 2.1M of its 3.8M parameters,
an 8192 x 256 head). Drafting only ever *proposes*: a token the draft cannot propose is simply never drafted, and
verification then emits the target's own token, so the output is unchanged (greedy: the target's argmax; sampled:
the residual max(0, p - q) covers every token q leaves out). Keeping the N most frequent tokens makes the head
N / vocab of its cost and moves acceptance only by how often the target emits one of the others.

The ranking is counted once on a corpus (never on the prompts it will serve) and saved beside the draft's
``config.json`` as ``token_ranking.json``; ``specdec.load(draft_vocab=N)`` / ``--draft-vocab N`` then keeps the
top N. The shipped draft's ranking is counted on its training split of the Python standard library.

    python -m specdec.draft_vocab path/to/draft --corpus data/*.txt     # rank a draft's tokens on a corpus
    python -m specdec.draft_vocab src/specdec/models/draft --default 4096  # the shipped draft: its training split
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specdec.errors import ModelLoadError

RANKING_FILE = "token_ranking.json"


def rank_tokens(tokenizer_dir: str | Path, texts: Iterable[str]) -> tuple[list[int], list[int]]:
    """Every token id of the tokenizer, most frequent in ``texts`` first (ties, and tokens never seen, by id),
    and the counts in the same order."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    counts: collections.Counter[int] = collections.Counter()
    for text in texts:
        counts.update(tok.encode(text, add_special_tokens=False).ids)
    ids = sorted(range(tok.get_vocab_size()), key=lambda t: (-counts[t], t))
    return ids, [counts[t] for t in ids]


def write_ranking(
    model_dir: str | Path, ids: list[int], counts: list[int], source: str, default: int | None = None
) -> Path:
    """``default``: the head size ``draft_vocab="auto"`` (the default) keeps for this draft; None: the full head."""
    out = Path(model_dir) / RANKING_FILE
    doc: dict[str, Any] = {"source": source, "default_head": default, "tokens": ids, "counts": counts}
    out.write_text(json.dumps(doc) + "\n")
    return out


def _ranking(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / RANKING_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("tokens"), list):
            raise ValueError("no token list")
        return doc
    except ValueError as e:
        raise ModelLoadError(f"{path} is not a token ranking ({e})") from e


def means_full(choice: int | str | None) -> bool:
    """Whether ``draft_vocab=choice`` asks for the whole head (``"full"``, None, 0 or ``"0"``)."""
    return choice is None or choice == "full" or choice == 0 or choice == "0"


def whole_number(choice: object) -> int | None:
    """An option's number: an int, or a string spelling one; None for anything else (a bool is not a number)."""
    if isinstance(choice, str):
        try:
            return int(choice)
        except ValueError:
            return None
    return choice if isinstance(choice, int) and not isinstance(choice, bool) else None


def resolve(model_dir: str | Path, choice: int | str | None) -> list[int] | None:
    """The head tokens for ``draft_vocab=choice``: ``"auto"`` (the ranking's own default, else the full head),
    ``"full"``/None/0 (the full head), or a number of tokens (the most frequent)."""
    if choice is None or means_full(choice):  # (None spelled out for the type checker)
        return None
    if choice == "auto":
        doc = _ranking(Path(model_dir))
        default = None if doc is None else doc.get("default_head")
        return None if not default else head_tokens(model_dir, int(default))
    n = whole_number(choice)
    if n is None:
        raise ModelLoadError(f"draft_vocab must be auto, full or a number of tokens, got {choice!r}")
    return head_tokens(model_dir, n)


def head_tokens(model_dir: str | Path, n: int) -> list[int]:
    """The ``n`` most frequent token ids of the draft at ``model_dir`` (ascending), from its ranking file."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ModelLoadError(f"draft_vocab must be a positive number of tokens, got {n!r}")
    doc = _ranking(Path(model_dir))
    if doc is None:
        raise ModelLoadError(
            f"draft_vocab needs the draft's token ranking, {Path(model_dir) / RANKING_FILE} is missing: make it "
            f"with `python -m specdec.draft_vocab {model_dir} --corpus <text files>`"
        )
    ranked = doc["tokens"]
    if n > len(ranked):
        raise ModelLoadError(f"draft_vocab {n} exceeds the draft's vocabulary ({len(ranked)} tokens)")
    return sorted(int(t) for t in ranked[:n])


def head_size(runner: Any) -> int | str | None:
    """What a loaded draft's output head computes, for reports: its number of tokens, "full", or None (no runner)."""
    if runner is None:
        return None
    head = getattr(runner, "head_tokens", None)
    return "full" if head is None else len(head)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the draft checkpoint directory (its tokenizer.json; the ranking is written there)")
    p.add_argument("--corpus", nargs="*", help="text files to count on (default: the stdlib training split)")
    p.add_argument("--default", type=int, default=None, help="the head size draft_vocab=auto keeps (default: full)")
    args = p.parse_args(argv)
    if args.corpus:
        files = [Path(f) for f in args.corpus]
        ids, counts = rank_tokens(args.model, (f.read_text(encoding="utf-8", errors="replace") for f in files))
        source = f"{len(files)} files given to --corpus"
    else:
        from specdec.training import corpus

        split = corpus.split_sources()
        ids, counts = rank_tokens(args.model, (split.read(f) for f in split.train))
        source = (
            f"the training split of the Python {platform.python_version()} standard library ({len(split.train)} files)"
        )
    out = write_ranking(args.model, ids, counts, source, args.default)
    total = sum(counts)
    cover = {n: sum(counts[:n]) / total for n in (512, 1024, 2048, 4096) if n < len(ids)}
    print(
        f"wrote {out}: {total} tokens counted; the top N cover " + ", ".join(f"{n}: {c:.1%}" for n, c in cover.items())
    )


if __name__ == "__main__":
    main()
