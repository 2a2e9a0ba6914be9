"""A draft whose output head keeps only its most frequent tokens (``specdec.draft_vocab``, ``draft_vocab=N``):
the ranking file, the CPU kernel's restricted head, and the output, which never changes (greedy: identical to
target-only; sampled: the target's law, in test_distribution.py's style)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec
import specdec.runtime.native_kernel as nk
from specdec.draft_vocab import RANKING_FILE, head_tokens, rank_tokens, resolve, write_ranking
from specdec.errors import ModelLoadError, UnsupportedError
from specdec.runtime.native import NativeRunner

kernel_only = pytest.mark.skipif(not nk.kernel_available(), reason=f"CPU kernel unavailable: {nk.kernel_status()}")


def ranked_draft(tiny_models: dict[str, Path], root: Path, first: list[int] | None = None, default: int | None = None):
    """A copy of the tiny draft with a ranking: ``first`` (if given) ahead of the rest, else by id."""
    out = root / "ranked-draft"
    if not out.exists():
        shutil.copytree(tiny_models["draft"], out)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    lead = list(first or [])
    ids = lead + [t for t in range(vocab) if t not in set(lead)]
    write_ranking(out, ids, [0] * vocab, "test", default)
    return out


def test_rank_tokens_orders_by_count_then_id(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_models["llama"] / "tokenizer.json"))
    texts = ["def f(x): return x", "x = x + 1", "return"]
    ids, counts = rank_tokens(tiny_models["llama"], texts)
    assert sorted(ids) == list(range(tok.get_vocab_size()))
    assert counts == sorted(counts, reverse=True) and sum(counts) == sum(len(tok.encode(t).ids) for t in texts)
    assert all(a < b for (a, ca), (b, cb) in zip(zip(ids, counts), zip(ids[1:], counts[1:])) if ca == cb)
    draft = tmp_path / "d"
    shutil.copytree(tiny_models["draft"], draft)
    write_ranking(draft, ids, counts, "test", default=5)
    assert head_tokens(draft, 5) == sorted(ids[:5])
    assert resolve(draft, "auto") == sorted(ids[:5]) and resolve(draft, "7") == sorted(ids[:7])
    assert resolve(draft, "full") is None and resolve(draft, None) is None and resolve(draft, 0) is None
    with pytest.raises(ModelLoadError, match="exceeds the draft's vocabulary"):
        head_tokens(draft, len(ids) + 1)
    with pytest.raises(ModelLoadError, match="auto, full or a number"):
        resolve(draft, "most")
    with pytest.raises(ModelLoadError, match="positive number"):
        head_tokens(draft, -3)
    (draft / RANKING_FILE).write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="not a token ranking"):
        head_tokens(draft, 1)
    (draft / RANKING_FILE).unlink()
    assert resolve(draft, "auto") is None  # no ranking: auto is the full head
    with pytest.raises(ModelLoadError, match="token ranking.*missing.*specdec.draft_vocab"):
        resolve(draft, 5)


@kernel_only
def test_restricted_head_logits_are_the_full_heads_columns(tiny_models: dict[str, Path]) -> None:
    """The kept columns equal the full head's bit for bit (each output is its own chain), the others are -inf; the
    kernel's greedy draft proposes the argmax of those widened logits, token by token."""
    path = tiny_models["draft"]
    full = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=True)
    keep = list(range(3, full.vocab_size, 3))
    cut = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=True, head_tokens=keep[::-1] + keep[:2])
    assert cut.head_tokens == keep and cut.vocab_size == full.vocab_size
    ids = torch.randint(0, full.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    a, b = full.forward(ids, full.new_cache()), cut.forward(ids, cut.new_cache())
    assert torch.equal(b[:, keep], a[:, keep])
    others = [t for t in range(full.vocab_size) if t not in set(keep)]
    assert bool(torch.isinf(b[:, others]).all()) and bool((b[:, others] < 0).all())
    # draft_greedy (one kernel call for the whole lockstep draft) against token-at-a-time argmax
    prompt = ids[:6].tolist()
    c1 = cut.new_cache()
    cut.forward(torch.tensor(prompt[:-1]), c1)
    tokens, _ = cut.draft_greedy([(prompt[-1:], c1)], [5], [None], cut.vocab_size)
    c2, want, last = cut.new_cache(), [], prompt[-1]
    cut.forward(torch.tensor(prompt[:-1]), c2)
    for _ in range(5):
        last = int(cut.forward(torch.tensor([last]), c2).argmax())
        want.append(last)
    assert tokens[0] == want and all(t in set(keep) for t in want)


@kernel_only
@pytest.mark.parametrize("n", [1, 7, 60])
def test_greedy_output_is_target_only_with_any_head(tiny_models: dict[str, Path], tmp_path: Path, n: int) -> None:
    draft = ranked_draft(tiny_models, tmp_path)
    target_only = specdec.load(tiny_models["llama"], dtype="float32")
    engine = specdec.load(tiny_models["llama"], draft, dtype="float32", draft_vocab=n)
    assert len(engine.drafter.runner.head_tokens) == n  # type: ignore[union-attr]
    for prompt in ["def fibonacci(n):", "import os\nimport sys\n", "class A:\n    def __init__(self):"]:
        want = target_only.generate(prompt, max_new_tokens=30).token_ids
        for tau in (1, 4):
            assert engine.generate(prompt, max_new_tokens=30, tau=tau).token_ids == want, (prompt, tau)
    batch = [engine.start(p, max_new_tokens=20, tau=3) for p in ["x = 1", "def g():", "for i in range(3):"]]
    while not all(g.done for g in batch):
        engine.step(batch)
    for g, p in zip(batch, ["x = 1", "def g():", "for i in range(3):"]):
        assert g.result().token_ids == target_only.generate(p, max_new_tokens=20).token_ids


@kernel_only
def test_auto_takes_the_rankings_default_and_refusals_are_clear(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    draft = ranked_draft(tiny_models, tmp_path, default=9)
    engine = specdec.load(tiny_models["llama"], draft, dtype="float32")
    assert len(engine.drafter.runner.head_tokens) == 9  # type: ignore[union-attr]
    full = specdec.load(tiny_models["llama"], draft, dtype="float32", draft_vocab="full")
    assert full.drafter.runner.head_tokens is None  # type: ignore[union-attr]
    # transformers runtime: auto falls back to the full head, an explicit size is refused
    hf = specdec.load(tiny_models["llama"], draft, dtype="float32", runtime="hf")
    assert not getattr(hf.drafter.runner, "head_tokens", None)  # type: ignore[union-attr]
    with pytest.raises(UnsupportedError, match="draft_vocab.*CPU kernel"):
        specdec.load(tiny_models["llama"], draft, dtype="float32", runtime="hf", draft_vocab=9)
    with pytest.raises(specdec.InvalidRequestError, match="draft_vocab needs a draft"):
        specdec.load(tiny_models["llama"], dtype="float32", prompt_lookup=True, draft_vocab=9)
    # "full", None, 0 and "0" all mean the whole head: nothing to refuse without a ranked draft directory
    for whole in ("full", None, 0, "0"):
        specdec.load(tiny_models["llama"], dtype="float32", prompt_lookup=True, draft_vocab=whole)


def test_cli_refuses_a_bad_head_size_in_one_line(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    draft = ranked_draft(tiny_models, tmp_path)
    for value, message in [("lots", "auto, full or a number"), ("100000", "exceeds the draft's vocabulary")]:
        r = subprocess.run(
            [sys.executable, "-m", "specdec.cli", "generate", "x = 1", "--target", str(tiny_models["llama"])]
            + ["--draft", str(draft), "--max-new-tokens", "4", "--draft-vocab", value],
            capture_output=True,
            text=True,
            timeout=120,
            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        )
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
