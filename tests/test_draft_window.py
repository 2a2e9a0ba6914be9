"""A draft that attends to its latest N tokens (``specdec.draft_window``, ``draft_window=N``): the window in the
native runtime's layers (the same as a model's own sliding window), ``auto`` from the length the draft was trained on,
clear refusals, and the output, which never changes."""

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
from specdec.draft_window import resolve, trained_context, window_of
from specdec.errors import UnsupportedError
from specdec.runtime.native import NativeRunner

kernel_only = pytest.mark.skipif(not nk.kernel_available(), reason=f"CPU kernel unavailable: {nk.kernel_status()}")


def trained_draft(tiny_models: dict[str, Path], root: Path, seq_len: object = 12) -> Path:
    """A copy of the tiny draft whose specdec_training.json says it was trained on ``seq_len``-token windows."""
    out = root / "trained-draft"
    if not out.exists():
        shutil.copytree(tiny_models["draft"], out)
    (out / "specdec_training.json").write_text(json.dumps({"role": "test draft", "settings": {"seq_len": seq_len}}))
    return out


def test_resolve_reads_the_trained_length_and_refuses_nonsense(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    assert trained_context(tiny_models["draft"]) is None  # nothing recorded: auto is the whole context
    assert resolve(tiny_models["draft"], "auto") is None
    draft = trained_draft(tiny_models, tmp_path)
    assert trained_context(draft) == 12 and resolve(draft, "auto") == 12
    assert resolve(draft, "5") == 5 and resolve(draft, 7) == 7 and resolve(None, 3) == 3
    for whole in ("full", None, 0, "0"):
        assert resolve(draft, whole) is None
    for bad in ("wide", -2, "-2", 1.5, True):
        with pytest.raises(specdec.InvalidRequestError, match="draft_window must be auto, full or a positive"):
            resolve(draft, bad)  # type: ignore[arg-type]
    for odd in (0, "256", None, True):  # a training file without a usable length: auto is the whole context
        (draft / "specdec_training.json").write_text(json.dumps({"settings": {"seq_len": odd}}))
        assert resolve(draft, "auto") is None
    (draft / "specdec_training.json").write_text("not json")
    assert resolve(draft, "auto") is None


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=kernel_only), False])
def test_the_window_is_a_sliding_window_in_every_layer(
    tiny_models: dict[str, Path], tmp_path: Path, kernel: bool
) -> None:
    """``window=W`` on a Llama checkpoint computes what the same weights compute as a Mistral checkpoint with
    ``sliding_window=W`` (a model's own window, checked against transformers in test_native_runtime); it changes the
    logits only once the context is longer than W."""
    path = tiny_models["draft"]
    mistral = tmp_path / "as-mistral"
    shutil.copytree(path, mistral)
    cfg = json.loads((mistral / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=6)
    (mistral / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1))

    def logits(runner: NativeRunner, n: int) -> torch.Tensor:
        return runner.forward(ids[:n], runner.new_cache())

    full = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=kernel)
    windowed = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=kernel, window=6)
    own = NativeRunner.from_pretrained(mistral, dtype=torch.float32, kernel=kernel)
    assert windowed.config.windows == own.config.windows == (6,) and window_of(windowed) == 6
    assert window_of(full) == "full" and window_of(None) is None
    assert torch.equal(logits(windowed, 6), logits(full, 6))  # no row sees further back than 6 tokens yet
    long_w, long_own, long_full = logits(windowed, 20), logits(own, 20), logits(full, 20)
    assert torch.equal(long_w, long_own)
    assert torch.equal(long_w[:6], long_full[:6]) and not torch.allclose(long_w[6:], long_full[6:])
    # step by step through the cache, as a draft runs: the same rows
    cache, rows = windowed.new_cache(), []
    windowed.forward(ids[:9], cache)
    for t in range(9, 20):
        rows.append(windowed.forward(ids[t : t + 1], cache)[-1])
    assert torch.allclose(torch.stack(rows), long_w[9:], atol=1e-5)
    # a model's own narrower window is kept
    narrower = NativeRunner.from_pretrained(mistral, dtype=torch.float32, kernel=kernel, window=10)
    assert narrower.config.windows == (6,)


@pytest.mark.parametrize("window", [1, 3, 200])
def test_greedy_output_is_target_only_whatever_the_window(tiny_models: dict[str, Path], window: int) -> None:
    target_only = specdec.load(tiny_models["llama"], dtype="float32")
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32", draft_window=window)
    assert window_of(engine.drafter.runner) == window  # type: ignore[union-attr]
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class A:\n    def __init__(self):"]
    for prompt in prompts:
        want = target_only.generate(prompt, max_new_tokens=30).token_ids
        for tau in (1, 4):
            assert engine.generate(prompt, max_new_tokens=30, tau=tau).token_ids == want, (prompt, tau)
    batch = [engine.start(p, max_new_tokens=20, tau=3) for p in prompts]
    while not all(g.done for g in batch):
        engine.step(batch)
    for g, p in zip(batch, prompts):
        assert g.result().token_ids == target_only.generate(p, max_new_tokens=20).token_ids


def test_auto_takes_the_trained_length_and_refusals_are_clear(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    draft = trained_draft(tiny_models, tmp_path)
    engine = specdec.load(tiny_models["llama"], draft, dtype="float32")
    assert window_of(engine.drafter.runner) == 12  # type: ignore[union-attr]
    full = specdec.load(tiny_models["llama"], draft, dtype="float32", draft_window="full")
    assert window_of(full.drafter.runner) == "full"  # type: ignore[union-attr]
    # transformers runtime: auto attends to everything, an explicit window is refused
    hf = specdec.load(tiny_models["llama"], draft, dtype="float32", runtime="hf")
    assert window_of(hf.drafter.runner) == "full"  # type: ignore[union-attr]
    with pytest.raises(UnsupportedError, match="draft_window.*native runtime"):
        specdec.load(tiny_models["llama"], draft, dtype="float32", runtime="hf", draft_window=8)
    with pytest.raises(specdec.InvalidRequestError, match="draft_window needs a draft model"):
        specdec.load(tiny_models["llama"], dtype="float32", prompt_lookup=True, draft_window=8)
    for whole in ("full", None, 0, "0", "auto"):
        specdec.load(tiny_models["llama"], dtype="float32", prompt_lookup=True, draft_window=whole)


def test_the_shipped_draft_attends_to_the_256_tokens_it_was_trained_on(default_pair: tuple[Path, Path]) -> None:
    _, draft = default_pair
    assert trained_context(draft) == 256 and resolve(draft, "auto") == 256


def test_cli_refuses_a_bad_window_in_one_line(tiny_models: dict[str, Path]) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "x = 1", "--target", str(tiny_models["llama"])]
        + ["--draft", str(tiny_models["draft"]), "--max-new-tokens", "4", "--draft-window", "-5"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "draft_window must be auto, full or a positive" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_interleaved_ab_benchmark_runs_and_checks_outputs(default_pair: tuple[Path, Path], tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import draft_ab
    finally:
        sys.path.pop(0)
    out = tmp_path / "ab.json"
    argv = ["--a", "draft_window=full", "--b", "draft_window=auto", "--tau", "3", "--n-prompts", "2"]
    assert draft_ab.main([*argv, "--repeats", "1", "--max-new-tokens", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["engine"] for r in report["rows"]] == ["target-only", "A", "B"] and report["differing"] == 0
    assert all(r["tok_s"] > 0 for r in report["rows"]) and report["rows"][0]["alpha"] is None
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        draft_ab.main(["--a", "draft_window"])
