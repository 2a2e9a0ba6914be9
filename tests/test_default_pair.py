"""The shipped default pair: tokenizer round-trips, loads two ways, drafts well enough, records how it was made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.training.corpus import stdlib_dir

# Measured greedy α of the shipped pair on these prompts is recorded in docs/models.md; the floor sits far
# below it so that only a broken or mismatched pair (α of a random draft is ~0) fails.
# Shipped draft: greedy α 0.76 on the 32 prompts of docs/models.md and 0.59 on the 4 prompts of this test
# (32 new tokens, τ = 4); the session-1 one-layer draft it replaced scored ~0.2. The engine is deterministic
# in greedy mode, so this cannot fail by chance; it fails if the pair is broken or mismatched.
ALPHA_FLOOR = 0.30


def _validation_files(target: Path) -> list[Path]:
    names = (target.parent / "validation_files.txt").read_text().split()
    return [stdlib_dir() / n for n in names if (stdlib_dir() / n).is_file()]


@pytest.fixture(scope="module")
def tokenizer(default_pair: tuple[Path, Path]):  # -> PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_pair[0]))


def test_tokenizer_round_trips_every_validation_file(default_pair: tuple[Path, Path], tokenizer) -> None:
    files = _validation_files(default_pair[0])
    if not files:
        pytest.skip("this Python's standard library has none of the validation files")
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text, f
        assert not text or len(ids) < len(text.encode()), f  # BPE compresses code


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300))
def test_tokenizer_round_trips_arbitrary_text(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_both_load_through_transformers(default_pair: tuple[Path, Path], tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tokenizer("def fibonacci(n):\n    ", add_special_tokens=False)["input_ids"]])
    for path in default_pair:
        model = AutoModelForCausalLM.from_pretrained(str(path))
        assert model.config.model_type == "llama" and model.config.vocab_size == len(tokenizer)
        assert next(model.parameters()).dtype == torch.bfloat16  # stored as bf16
        logits = model(input_ids=ids).logits
        assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    assert AutoModelForCausalLM.from_pretrained(str(default_pair[1])).config.num_hidden_layers <= 2


def test_records_how_each_model_was_made_and_fits_the_size_budget(default_pair: tuple[Path, Path]) -> None:
    total = 0
    for path in default_pair:
        meta = json.loads((path / "specdec_training.json").read_text())
        assert meta["seed"] == 0 and meta["tokens"] > 0 and meta["train_seconds"] > 0
        assert meta["corpus"]["python"] and meta["corpus"]["train_files"] > 0
        assert meta["validation"] and "command" in meta
        total += sum(f.stat().st_size for f in path.iterdir())
    assert total <= 60 * 2**20


def _held_out_prompts(target: Path, tokenizer, n: int) -> list[list[int]]:
    """The 24 lines before the middle of each of the first ``n`` usable validation files."""
    prompts = []
    for f in _validation_files(target):
        lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        if len(lines) >= 60:
            mid = len(lines) // 2
            prompts.append(tokenizer("".join(lines[mid - 24 : mid]), add_special_tokens=False)["input_ids"][-200:])
        if len(prompts) == n:
            break
    return prompts


def test_pair_greedy_acceptance_above_floor(default_pair: tuple[Path, Path], tokenizer) -> None:
    from specdec.training.distill_run import measure_acceptance

    prompts = _held_out_prompts(default_pair[0], tokenizer, 4)
    if len(prompts) < 4:
        pytest.skip("this Python's standard library lacks the validation files")
    acc = measure_acceptance(default_pair[0], default_pair[1], prompts, max_new_tokens=32)
    assert acc["drafted"] > 0 and acc["alpha"] > ALPHA_FLOOR, acc


def test_default_load_uses_the_pair(default_pair: tuple[Path, Path]) -> None:
    import specdec

    result = specdec.load().generate("def fibonacci(n):", max_new_tokens=16)
    assert len(result.token_ids) >= 1 and result.stats.drafted > 0 and result.text


@pytest.mark.server
def test_chat_completions_work_with_the_default_pair(default_pair: tuple[Path, Path], tokenizer) -> None:
    """The pair ships a chat template (training.corpus.CHAT_TEMPLATE: messages as comment lines, the assistant's as
    code), so a chat client works against ``specdec serve`` with no model options; the reply is the engine's greedy
    continuation of the rendered conversation, and the draft's tokenizer renders it alike."""
    from transformers import AutoTokenizer

    import specdec
    from specdec.server import ServerSettings, create_app
    from specdec.training.corpus import CHAT_TEMPLATE
    from test_server_app import run

    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert AutoTokenizer.from_pretrained(str(default_pair[1])).chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Python 3."},
        {"role": "user", "content": "reverse a string\nwithout slicing"},
        {"role": "assistant", "content": "def rev(s):\n    return ''.join(reversed(s))"},
        {"role": "user", "content": "now a list"},
    ]
    rendered = "# Python 3.\n# reverse a string\n# without slicing\ndef rev(s):\n    return ''.join(reversed(s))\n# now a list\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    engine = specdec.load()
    app = create_app(engine, ServerSettings(model_name="specdec-default"))
    body = {"model": "specdec-default", "messages": messages, "max_tokens": 16, "temperature": 0}

    r = run(app, lambda client: client.post("/v1/chat/completions", json=body))
    assert r.status_code == 200, r.text
    want = engine.generate(tokenizer(rendered, add_special_tokens=False)["input_ids"], max_new_tokens=16)
    assert r.json()["choices"][0]["message"]["content"] == want.text and want.text
