"""``specdec distill`` on tiny random checkpoints: it lowers KL(target ‖ draft), resumes, exports a loadable draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.cli import main as cli_main
from specdec.draft_window import trained_context, window_of
from specdec.errors import InvalidRequestError
from specdec.training.distill import LOG_FILE, DistillConfig, draft_shape
from specdec.training.distill_run import DistillJob, run

SMALL = '{"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2}'


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few dozen small Python-like files (enough for a hash split to hold some out)."""
    d = tmp_path_factory.mktemp("text")
    for i in range(40):
        body = "\n".join(f"    x{j} = compute({i}, {j}) + value_{j % 7}" for j in range(12))
        (d / f"mod_{i}.py").write_text(f"def function_{i}(a, b):\n{body}\n    return a + b * {i}\n")
    return d


def _config(steps: int, **kw: object) -> DistillConfig:
    return DistillConfig(
        steps=steps,
        seq_len=32,
        batch_size=4,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=5,
        threads=1,
        eval_every=steps,
        eval_windows=4,
        ckpt_every=10,
        **kw,
    )  # type: ignore[arg-type]


def _evals(work: Path) -> list[dict]:
    return [e for e in map(json.loads, (work / LOG_FILE).read_text().splitlines()) if "kl" in e or "val_kl" in e]


def test_distill_lowers_kl_and_exports_a_loadable_draft(
    tiny_models: dict[str, Path], text_dir: Path, tmp_path: Path
) -> None:
    import specdec

    out = tmp_path / "draft"
    meta = run(
        DistillJob(
            target=tiny_models["llama"],
            out=out,
            draft_config=SMALL,
            data=[text_dir],
            config=_config(40),
            prompts=2,
            eval_tokens=8,
        ),
        report=lambda s: None,
    )
    start = json.loads((out / LOG_FILE).read_text().splitlines()[0])
    assert start["event"] == "start"
    # Deterministic (seed 0): the untrained draft's KL is ~ log V-ish; 40 steps must cut it substantially.
    assert meta["validation"]["kl"] < 0.7 * start["kl"], (start, meta["validation"])
    assert meta["finished"] and meta["steps"] == 40 and meta["tokens"] == 40 * 4 * 32
    assert 0.0 <= meta["acceptance_greedy"]["alpha"] <= 1.0
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "specdec_training.json"):
        assert (out / f).exists(), f
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1 and cfg["dtype"] == "bfloat16"
    engine = specdec.load(tiny_models["llama"], out, tau=3)
    result = engine.generate("def fibonacci(n):", max_new_tokens=6)
    assert len(result.token_ids) == 6 and result.stats.drafted > 0
    # the draft attends to the 32-token windows it was trained on (draft_window="auto")
    assert trained_context(out) == 32 and window_of(engine.drafter.runner) == 32  # type: ignore[union-attr]


def test_distill_resumes_and_refuses_changed_settings(
    tiny_models: dict[str, Path], text_dir: Path, tmp_path: Path
) -> None:
    out, lines = tmp_path / "draft", []
    job = DistillJob(
        target=tiny_models["llama"], out=out, draft_config=SMALL, data=[text_dir], config=_config(10), prompts=0
    )
    run(job, report=lines.append)
    job.config = _config(20)  # a longer run continues the same state
    meta = run(job, report=lines.append)
    assert any(line.startswith("resumed at step 10") for line in lines)
    assert meta["steps"] == 20
    job.config = _config(30, kl_weight=0.5)
    with pytest.raises(InvalidRequestError, match="different settings"):
        run(job, report=lines.append)


def test_distill_other_architecture_and_samples_from_target(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A GPT-2 target (not Llama), trained on its own samples: the draft gets the target's vocabulary."""
    out = tmp_path / "draft"
    meta = run(
        DistillJob(
            target=tiny_models["gpt2"],
            out=out,
            draft_config=SMALL,
            from_target=True,
            config=_config(3),
            prompts=1,
            eval_tokens=4,
        ),
        report=lambda s: None,
    )
    assert meta["source"]["kind"] == "target-samples" and meta["source"]["sampled_tokens"] == 3 * 4 * 32
    target_vocab = json.loads((tiny_models["gpt2"] / "config.json").read_text())["vocab_size"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == target_vocab


def test_on_policy_rows_are_the_targets_greedy_continuations(tiny_models: dict[str, Path]) -> None:
    """Half of each batch: a quarter of a corpus window, then exactly the target's argmax continuation."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.training.distill_data import OnPolicySource, StreamSource

    target = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()
    vocab = target.config.vocab_size
    stream = np.random.default_rng(0).integers(1, vocab, 5_000).astype(np.int64)
    base = StreamSource(stream, "random")
    source = OnPolicySource(base, target, 0.5, torch.device("cpu"))
    rows = source.batch(4, 31, torch.Generator().manual_seed(0))  # [4, 32]; rows 0-1 continued from 8 tokens
    plain = base.batch(4, 31, torch.Generator().manual_seed(0))  # the same windows, untouched
    assert torch.equal(rows[:, :8], plain[:, :8]) and torch.equal(rows[2:], plain[2:])
    with torch.no_grad():
        argmax = target(input_ids=rows[:2, :-1]).logits.argmax(-1)  # teacher-forced on the rows themselves
    # Incremental (cached) and full fp32 forwards agree up to rounding; random-model near-ties are rare.
    agree = (argmax[:, 7:] == rows[:2, 8:]).float().mean().item()
    assert agree >= 0.95, agree
    assert not torch.equal(rows[:2, 8:], plain[:2, 8:])  # the continuation replaced the corpus text
    assert source.generated_tokens == 2 * 24 and source.describe()["kind"] == "on-policy"


def test_distill_on_policy_run_records_its_source(tiny_models: dict[str, Path], text_dir: Path, tmp_path: Path) -> None:
    meta = run(
        DistillJob(
            target=tiny_models["llama"],
            out=tmp_path / "draft",
            draft_config=SMALL,
            data=[text_dir],
            on_policy=0.5,
            config=_config(3),
            prompts=0,
        ),
        report=lambda s: None,
    )
    assert meta["steps"] == 3 and meta["source"]["kind"] == "on-policy" and meta["source"]["share"] == 0.5
    with pytest.raises(InvalidRequestError, match="--on-policy needs --data"):
        run(
            DistillJob(
                target=tiny_models["llama"],
                out=tmp_path / "d2",
                draft_config=SMALL,
                from_target=True,
                on_policy=0.5,
                config=_config(1),
                prompts=0,
            ),
            report=lambda s: None,
        )


def test_cli_distill_prints_progress_and_alpha(
    tiny_models: dict[str, Path], text_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli_main(
        [
            "distill",
            "--target",
            str(tiny_models["llama"]),
            "--out",
            str(tmp_path / "d"),
            "--data",
            str(text_dir),
            "--draft-config",
            SMALL,
            "--steps",
            "10",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--threads",
            "1",
            "--prompts",
            "2",
            "--eval-tokens",
            "4",
            "--kl-weight",
            "0.7",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "step 10/10" in out and "tok/s" in out and "eta" in out
    assert "greedy acceptance on 2 held-out prompts" in out and "α = " in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kl-weight", "1.5"], "--kl-weight must be in [0, 1]"),
        (["--draft-config", "huge"], "--draft-config must be"),
        (["--draft-config", '{"layers": 2}'], "unknown keys"),
        (["--draft-config", '{"hidden_size": 30, "num_attention_heads": 4}'], "must divide"),
        (["--steps", "0"], "steps must be at least 1"),
        (["--minutes", "-1"], "--minutes must be positive"),
        (["--on-policy", "1.5"], "--on-policy must be in [0, 1)"),
    ],
)
def test_cli_distill_bad_input_is_one_line(
    tiny_models: dict[str, Path],
    text_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    rc = cli_main(
        [
            "distill",
            "--target",
            str(tiny_models["llama"]),
            "--out",
            str(tmp_path / "d"),
            "--data",
            str(text_dir),
            *extra,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_distill_missing_paths(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli_main(["distill", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "d"), "--data", "x.py"])
    assert rc == 2 and "nope" in capsys.readouterr().err
    rc = cli_main(
        [
            "distill",
            "--target",
            str(tiny_models["llama"]),
            "--out",
            str(tmp_path / "d"),
            "--data",
            str(tmp_path / "missing.py"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "missing.py does not exist" in err and len(err.strip().splitlines()) == 1


def test_draft_shape_presets_and_json(tmp_path: Path) -> None:
    assert draft_shape("small")["num_hidden_layers"] == 1
    assert draft_shape('{"num_hidden_layers": 2}')["num_hidden_layers"] == 2
    f = tmp_path / "shape.json"
    f.write_text('{"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}')
    assert draft_shape(str(f))["hidden_size"] == 64
    with pytest.raises(InvalidRequestError, match="positive integer"):
        draft_shape('{"hidden_size": -1}')
