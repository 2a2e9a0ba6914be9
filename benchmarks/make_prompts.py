"""Make the shipped held-out prompt set: code-completion cuts of files the default pair never trained on.

Usage (from the repository root, after ``python -m specdec.training.default_pair`` wrote runs/default):

    python benchmarks/make_prompts.py [--count 24] [--out src/specdec/data/heldout_prompts.jsonl]

Each prompt is a cut of a validation-split standard-library file ending at a natural point: just after a
function's signature and docstring (the model writes the body), or at a statement boundary in the middle of a
function body. The context before the cut starts at a line boundary and holds 100-300 tokens. The choice is
seeded, so the same Python version, split and tokenizer give the same file.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from specdec.training.corpus import stdlib_dir

MIN_TOKENS, MAX_TOKENS = 100, 300


@dataclass
class Cut:
    rel: str
    line: int  # the prompt ends after this 1-based line
    kind: str  # "body" (after signature + docstring) or "mid" (inside the body)


def function_cuts(rel: str, source: str) -> list[Cut]:
    """Candidate cut points in one file: after docstrings and at mid-body statement boundaries."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    cuts: list[Cut] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        first = node.body[0]
        has_doc = (
            isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        )
        if has_doc and first.end_lineno is not None:
            cuts.append(Cut(rel, first.end_lineno, "body"))
        # A mid-body cut leaves at least two statements for the model to continue into.
        stmts = node.body[1 if has_doc else 0 :]
        if len(stmts) >= 4:
            stmt = stmts[len(stmts) // 2 - 1]
            if stmt.end_lineno is not None:
                cuts.append(Cut(rel, stmt.end_lineno, "mid"))
    return cuts


def context_before(lines: list[str], end_line: int, tok: Tokenizer, want: int) -> tuple[str, int] | None:
    """Whole lines ending at ``end_line`` holding about ``want`` tokens (within MIN..MAX), or None."""
    start = end_line
    best: tuple[str, int] | None = None
    while start > 0:
        start -= 1
        text = "".join(lines[start:end_line])
        n = len(tok.encode(text).ids)
        if n > MAX_TOKENS:
            break
        if n >= MIN_TOKENS:
            best = (text, n)
            if n >= want:
                break
    return best


def make_prompts(count: int, seed: int, validation: Path, tokenizer: Path) -> list[dict[str, object]]:
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    root = stdlib_dir()
    rels = [r.strip() for r in validation.read_text().splitlines() if r.strip()]
    rng = random.Random(seed)
    rng.shuffle(rels)
    out: list[dict[str, object]] = []
    for rel in rels:  # at most one prompt per file, alternating the kind of cut
        if len(out) >= count:
            break
        path = root / rel
        if not path.exists():
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        kind = "body" if len(out) % 2 == 0 else "mid"
        cuts = [c for c in function_cuts(rel, source) if c.kind == kind] or function_cuts(rel, source)
        rng.shuffle(cuts)
        lines = source.splitlines(keepends=True)
        for cut in cuts:
            found = context_before(lines, cut.line, tok, want=rng.randint(140, 280))
            if found is None or not found[0].strip():
                continue
            text, n = found
            out.append(
                {
                    "id": f"heldout-{len(out):02d}",
                    "source": f"{rel}:{cut.line}",
                    "cut": cut.kind,
                    "tokens": n,
                    "prompt": text,
                }
            )
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--validation", type=Path, default=Path("runs/default/validation_files.txt"))
    p.add_argument("--tokenizer", type=Path, default=Path("runs/default/tokenizer"))
    p.add_argument("--out", type=Path, default=Path("src/specdec/data/heldout_prompts.jsonl"))
    args = p.parse_args(argv)
    prompts = make_prompts(args.count, args.seed, args.validation, args.tokenizer)
    if len(prompts) < args.count:
        print(f"only {len(prompts)} prompts could be cut (asked for {args.count})", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for rec in prompts:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
