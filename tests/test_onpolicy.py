"""On-policy distillation (training/onpolicy.py): the greedy replay, and a tiny end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.training import onpolicy


def test_greedy_replay_counts_steps_like_the_engine() -> None:
    # τ = 4. Step 1: positions 0, 1 agree, 2 does not -> 2 accepted of 4 drafted, the target's token at 2.
    # Step 2 starts at 3: positions 3..6 agree -> 4 of 4 accepted, bonus token at 7. 8 tokens in 2 passes.
    m = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    r = onpolicy.greedy_alpha_from_matches(m, tau=4)
    assert r == {"alpha": 0.75, "per_token_acceptance": round(6 / 7, 4), "mean_accepted_length": 4.0}
    # Nothing agrees: every step drafts min(τ, remaining) and emits one token.
    r = onpolicy.greedy_alpha_from_matches(torch.zeros(2, 5, dtype=torch.bool), tau=4)
    assert r["alpha"] == 0.0 and r["mean_accepted_length"] == 1.0
    # Everything agrees: α = 1, steps of τ + 1 tokens.
    r = onpolicy.greedy_alpha_from_matches(torch.ones(1, 10, dtype=torch.bool), tau=4)
    assert r["alpha"] == 1.0 and r["mean_accepted_length"] == 5.0


def test_lr_schedule_warms_up_then_decays_to_min() -> None:
    s = onpolicy.Settings(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert onpolicy.lr_at(0, 100, s) == pytest.approx(1e-4)
    assert onpolicy.lr_at(9, 100, s) == pytest.approx(1e-3)
    assert onpolicy.lr_at(100, 100, s) == pytest.approx(1e-4)


def test_tiny_run_writes_loadable_drafts_and_figures(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    tiny_target = tiny_models["llama"]
    vocab = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    np.save(tmp_path / "train.npy", rng.integers(1, vocab, 20_000, dtype=np.uint16))
    np.save(tmp_path / "val.npy", rng.integers(1, vocab, 5_000, dtype=np.uint16))
    work = tmp_path / "work"
    argv = [
        "--work",
        str(work),
        "--target",
        str(tiny_target),
        "--train",
        str(tmp_path / "train.npy"),
        "--val",
        str(tmp_path / "val.npy"),
        "--device",
        "cpu",
        "--drafts",
        "d256x1,d256x1_ce",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--pool-rows",
        "4",
        "--gen-batch",
        "2",
        "--eval-prompts",
        "2",
    ]
    assert onpolicy.main(argv) == 0
    summary = json.loads((work / "onpolicy.json").read_text())
    assert summary["steps"] == 3 and summary["pool_rows"] == 4
    for name in ("d256x1", "d256x1_ce"):
        acc = summary["emulated_acceptance"][name]
        assert 0.0 <= acc["alpha"] <= 1.0 and acc["mean_accepted_length"] >= 1.0
        model = AutoModelForCausalLM.from_pretrained(str(work / name))
        assert model.config.num_hidden_layers == 1 and next(model.parameters()).dtype == torch.bfloat16
        meta = json.loads((work / name / "specdec_training.json").read_text())
        assert "--steps 3" in meta["command"] and meta["validation"]["kl"] > 0
    assert [json.loads(x) for x in (work / "log.jsonl").read_text().splitlines()] == []  # logs every 100 steps


def test_unknown_draft_name_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        onpolicy.main(["--drafts", "d256x1,huge"])
    assert e.value.code == 2 and "unknown draft names ['huge']" in capsys.readouterr().err
