"""Shared fixtures: tiny random checkpoints written to a temp dir, loaded through the user-facing loader."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random-init checkpoints sharing one tokenizer: targets of several architectures and a 1-layer draft."""
    from specdec.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    tok_dir = tiny_checkpoint(root / "llama", "llama", seed=0, sharpen=4.0)
    out = {"llama": tok_dir}
    out["qwen2"] = tiny_checkpoint(root / "qwen2", "qwen2", seed=1, tokenizer_from=tok_dir, sharpen=4.0)
    out["mistral"] = tiny_checkpoint(root / "mistral", "mistral", seed=2, tokenizer_from=tok_dir, sharpen=4.0)
    out["gpt2"] = tiny_checkpoint(root / "gpt2", "gpt2", seed=3, tokenizer_from=tok_dir, sharpen=4.0)
    out["draft"] = tiny_checkpoint(
        root / "draft", "llama", seed=4, tokenizer_from=tok_dir, layers=1, hidden=32, sharpen=4.0
    )
    return out


@pytest.fixture(scope="session")
def default_pair() -> tuple[Path, Path]:
    """The shipped default pair (skips while it has not been trained and committed yet)."""
    from specdec.api import default_draft, default_target

    target, draft = default_target(), default_draft()
    if not (target / "config.json").exists() or not (draft / "config.json").exists():
        pytest.skip("the shipped default pair is not present in this checkout")
    return target, draft


@pytest.fixture(params=["hf", "native-kernel", "native-torch"])
def runtime_name(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each runtime and back end in turn: transformers, the native runtime on its CPU kernel, and on PyTorch
    operators (the kernel switched off by its environment switch, and switched back on after)."""
    import specdec.runtime.native_kernel as nk

    name = request.param
    if name == "native-kernel" and not nk.kernel_available():
        pytest.skip(f"CPU kernel unavailable: {nk.kernel_status()}")
    if name == "native-torch":
        monkeypatch.setenv(nk.ENV_SWITCH, "0")
        nk._load.cache_clear()
    yield name
    if name == "native-torch":
        monkeypatch.undo()
        nk._load.cache_clear()
