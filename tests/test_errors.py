"""Bad input: a typed exception naming what is wrong (API), one line and a non-zero exit (CLI)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import specdec
from specdec.errors import ContextLengthError, InvalidRequestError, ModelLoadError, UnsupportedError, VocabMismatchError


@pytest.fixture(scope="module")
def engine(tiny_models):
    return specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        (dict(prompt=""), InvalidRequestError, "prompt is empty"),
        (dict(prompt=[]), InvalidRequestError, "prompt is empty"),
        (dict(max_new_tokens=0), InvalidRequestError, "max_new_tokens"),
        (dict(max_new_tokens=-3), InvalidRequestError, "max_new_tokens"),
        (dict(tau=-1), InvalidRequestError, "tau"),
        (dict(temperature=-0.5), InvalidRequestError, "temperature"),
        (dict(top_p=0.0), InvalidRequestError, "top_p"),
        (dict(top_p=1.5), InvalidRequestError, "top_p"),
        (dict(top_k=-2), InvalidRequestError, "top_k"),
        (dict(min_p=1.5), InvalidRequestError, "min_p"),
        (dict(min_p=-0.1), InvalidRequestError, "min_p"),
        (dict(max_verify_passes=0), InvalidRequestError, "max_verify_passes"),
        (dict(policy="nonsense"), InvalidRequestError, "unknown policy"),
        (dict(stop=[""]), InvalidRequestError, "stop"),
        (dict(prompt=[1, 2, 10**6]), InvalidRequestError, "outside the vocabulary"),
    ],
)
def test_bad_request_arguments(engine, kwargs, exc, words):
    args = dict(prompt="def f():", max_new_tokens=8)
    args.update(kwargs)
    with pytest.raises(exc, match=words):
        engine.generate(args.pop("prompt"), **args)


def test_prompt_longer_than_context(engine):
    too_long = list(range(1, 11)) * 30  # 300 tokens; the tiny models have 256 positions
    with pytest.raises(ContextLengthError, match="context window of 256"):
        engine.generate(too_long, max_new_tokens=4)
    with pytest.raises(ContextLengthError, match="exceeds the context window"):
        engine.generate(list(range(1, 11)) * 25, max_new_tokens=10)  # 250 + 10 > 256


def test_batch_size_above_one_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="batch size 2"):
        engine.generate(torch.ones(2, 5, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(UnsupportedError, match="batch size 3"):
        engine.target.forward(torch.ones(3, 2, dtype=torch.long), engine.target.new_cache())


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        specdec.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        specdec.load(tmp_path / "empty")


def test_mismatched_vocabularies_name_both_checkpoints(tiny_models, tmp_path):
    from specdec.testing import tiny_checkpoint

    other = tiny_checkpoint(tmp_path / "other", "llama", seed=9, vocab_size=300)
    with pytest.raises(VocabMismatchError) as info:  # "shared": refuse rather than draft through text
        specdec.load(tiny_models["llama"], other, dtype="float32", draft_tokenizer="shared")
    assert str(other) in str(info.value) and str(tiny_models["llama"]) in str(info.value)


def test_tau_without_drafter(tiny_models):
    engine = specdec.load(tiny_models["llama"], dtype="float32")
    with pytest.raises(InvalidRequestError, match="needs a drafter"):
        engine.generate("x", max_new_tokens=2, tau=2)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
        (["--tau", "-2"], "tau must be an integer >= 0"),
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--runtime", "hf", "--compile"], "--compile needs the native runtime"),
        (["--regex", "[a-z"], "response_format: the regex does not compile"),
        (["--json-schema", "schema.json"], "--json-schema: no such file: schema.json"),
        (["--json-schema", "{type: object}"], "--json-schema: the value is not JSON"),
        (["--json-object", "--min-tokens", "2"], "min_tokens cannot be combined with response_format"),
    ],
)
def test_cli_bad_arguments_one_line(tiny_models, extra, words):
    r = _cli(
        "generate",
        "def f():",
        "--target",
        str(tiny_models["llama"]),
        "--draft",
        str(tiny_models["draft"]),
        "--dtype",
        "float32",
        *extra,
    )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-k", "-3"], "top_k"),
        (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
        (["--max-verify-passes", "0"], "max_verify_passes must be a positive integer"),
        (["--stop", ""], "stop strings must be non-empty strings"),
        (["--tau", "-2"], "tau must be an integer >= 0"),
        (["--tau", "2", "--policy", "adaptive"], "cannot be combined with policy 'adaptive'"),
    ],
)
def test_cli_settings_that_need_no_model_are_refused_before_the_models_load(tmp_path, extra, words):
    """A bad sampling setting, length or policy is refused before any checkpoint is read (a 1B one takes ~20 s to
    load): with a target directory that does not exist, the error is still the setting's."""
    r = _cli("generate", "def f():", "--target", str(tmp_path / "no-such-checkpoint"), *extra)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("chatml", "--chat-template: 'chatml' is neither a file nor a Jinja template"),
        ("{{ raise_exception('roles must alternate') }}", "fails on a one-message conversation: TemplateError"),
    ],
)
def test_cli_serve_bad_chat_template_one_line(tiny_models, template, words):
    """Refused before the server listens: the first before any model loads, the second once the tokenizer is there."""
    r = _cli("serve", "--target", str(tiny_models["llama"]), "--no-draft", "--port", "0", "--chat-template", template)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr


def test_cli_missing_dir_and_empty_prompt(tiny_models, tmp_path):
    r = _cli("generate", "hi", "--target", str(tmp_path / "missing"))
    assert (
        r.returncode != 0 and r.stderr.strip() == f"specdec: error: model directory not found: {tmp_path / 'missing'}"
    )
    r = _cli("generate", "", "--target", str(tiny_models["llama"]), "--no-draft")
    assert r.returncode != 0 and r.stderr.strip() == "specdec: error: prompt is empty"


def test_cli_json_output(tiny_models):
    import json

    r = _cli(
        "generate",
        "def f():",
        "--target",
        str(tiny_models["llama"]),
        "--draft",
        str(tiny_models["draft"]),
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
        "--tau",
        "2",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "stats"} and len(out["token_ids"]) == 6
    assert out["stats"]["drafted"] > 0
