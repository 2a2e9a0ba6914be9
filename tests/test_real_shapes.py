"""The real-shape benchmark: its measuring functions, and the command run end to end on a tiny shape."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec.runtime.native_kernel as nk
from specdec import real_shapes as rs
from specdec.runtime.native import NativeRunner
from specdec.runtime.native_config import read_config

ROOT = Path(__file__).resolve().parents[1]
needs_kernel = pytest.mark.skipif(not nk.kernel_available(), reason=f"CPU kernel unavailable: {nk.kernel_status()}")


def test_ideal_speedup_by_hand() -> None:
    t = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}  # blocks free, draft free: the longest block wins
    assert rs.ideal_speedup(t, 0.0, 0.5) == (3, pytest.approx((1 - 0.5**4) / 0.5))
    t = {1: 1.0, 2: 2.0, 3: 3.0}  # a block costs k one-token passes: speculation cannot win
    assert rs.ideal_speedup(t, 0.1, 0.8) == (0, 1.0)
    tau, s = rs.ideal_speedup({1: 1.0, 2: 1.1, 3: 1.2}, 0.05, 0.7)
    assert tau == 2 and s == pytest.approx((1 + 0.7 + 0.49) / (2 * 0.05 + 1.2))
    with pytest.raises(ValueError, match="0 <= alpha < 1"):
        rs.ideal_speedup(t, 0.1, 1.0)


def test_checkpoint_has_the_published_body(tmp_path: Path) -> None:
    path = rs.checkpoint("tiny", tmp_path, vocab=300)
    cfg, _ = read_config(path)
    assert (cfg.hidden, cfg.intermediate, cfg.layers, cfg.heads, cfg.kv_heads, cfg.vocab_size) == (
        72,
        200,
        2,
        4,
        2,
        300,
    )
    assert cfg.qkv_bias and not cfg.tie_embeddings
    assert rs.checkpoint("tiny", tmp_path, vocab=300) == path  # written once
    assert rs.matrix_params(cfg, 300) == 2 * ((4 + 4) * 18 * 72 + 72 * 72 + 3 * 72 * 200) + 300 * 72
    with pytest.raises(ValueError, match="unknown shape"):
        rs.checkpoint("gpt-5", tmp_path)
    qwen = rs.SHAPES["qwen2.5-0.5b"]
    assert (qwen["hidden_size"], qwen["intermediate_size"], qwen["num_hidden_layers"]) == (896, 4864, 24)


@needs_kernel
def test_pass_times_blocks_and_batches(tmp_path: Path) -> None:
    runner = NativeRunner.from_pretrained(rs.checkpoint("tiny", tmp_path), dtype=torch.bfloat16, max_context=64)
    pt = rs.pass_times(runner, [3, 1, 2], context=16, rounds=2, min_seconds=0.001)
    assert sorted(pt.block) == [1, 2, 3] and all(t > 0 for t in pt.block.values())
    assert sorted(pt.batch) == [1, 2, 3] and pt.batch_missing is None
    assert all(len(v) == 2 and pt.block[k] == statistics.median(v) for k, v in pt.block_rounds.items())
    assert pt.probes == []
    calls = iter(range(10, 20))  # a probe runs once per round, before the round's passes
    pt = rs.pass_times(runner, [1, 2], context=16, rounds=3, min_seconds=0.001, probe=lambda: float(next(calls)))
    assert pt.probes == [10.0, 11.0, 12.0] and next(calls) == 13
    # after a probe, the round's first pass runs once untimed, and each round starts one row count further along
    log: list[object] = []
    forward = runner.forward

    def logged(ids: torch.Tensor, cache: object, **kw: object) -> object:
        log.append(len(ids))
        return forward(ids, cache, **kw)  # type: ignore[arg-type]

    runner.forward = logged  # type: ignore[method-assign]
    rs.pass_times(
        runner, [1, 2], context=16, rounds=3, min_seconds=1e-9, batches=False, probe=lambda: log.append("p") or 1.0
    )
    probed = [i for i, x in enumerate(log) if x == "p"]
    assert [log[i + 1 : i + 4] for i in probed] == [[1, 1, 2], [2, 2, 1], [1, 1, 2]]  # untimed, then the round
    with pytest.raises(ValueError, match="exceed"):
        rs.pass_times(runner, [1, 60], context=16)
    with pytest.raises(ValueError, match="positive"):
        rs.pass_times(runner, [0, 1])


@needs_kernel
def test_limits_are_measured() -> None:
    assert rs.read_bandwidth(1, mib=16, reps=1) > 1e8  # > 0.1 GB/s on anything that runs this
    # the read probe reads every line once, whatever its pattern: the sum of 1,001 lines of ones (a share not a
    # multiple of the streams, prefetches running past the end) is their count of floats
    lib = rs._kernel()
    ones = torch.ones(1001 * 16)
    for threads, streams, ahead in [(1, 1, 0), (2, 1, 0), (1, 4, 32), (2, 4, 32), (2, 3, 5), (2, 7, 1000)]:
        assert lib.sd_read_bytes(ones.data_ptr(), ones.numel() * 4, threads, streams, ahead) == ones.numel()
    assert rs.fma_peak(1, "fp32", seconds=0.01, reps=1) > 1e9
    with pytest.raises(ValueError, match="kind must be"):
        rs.fma_peak(1, "int4")


@needs_kernel
def test_command_runs_on_a_tiny_shape(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "real_shapes.py"), "--quick", "--out", str(tmp_path)]
    res = subprocess.run(cmd + ["--checkpoints", str(tmp_path / "ck")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    (out,) = tmp_path.glob("real_shapes-*-quick.json")
    data = json.loads(out.read_text())
    s = data["shapes"]["tiny"]
    assert data["limits"]["read_bytes_per_s"] > 0 and data["limits"]["peak_flops"] > 0
    assert set(s["block"]) == set(s["batch"]) == {"1", "2", "3", "4", "6", "8"}
    b = s["block"]["4"]
    assert b["pct_floor"] == pytest.approx(100 * s["floor_seconds"] / b["seconds"])
    assert b["vs_one_row"] == pytest.approx(b["seconds"] / s["block"]["1"]["seconds"])
    assert set(s["ideal_speculative"]) == {"0.6", "0.7", "0.8"}
    assert "floor" in res.stdout


@needs_kernel
def test_command_takes_a_vocabulary_and_a_checkpoint_directory(tmp_path: Path) -> None:
    """``--vocab`` sizes the named shapes' heads; a checkpoint directory is measured as it is (its own head)."""
    own = rs.checkpoint("tiny", tmp_path / "mine", vocab=500)  # "a checkpoint of your own"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "real_shapes.py"), "--quick", "--out", str(tmp_path)]
    cmd += ["--checkpoints", str(tmp_path / "ck"), "--max-rows", "2"]
    res = subprocess.run(
        cmd + ["--shapes", "tiny", str(own), "--vocab", "300"], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (out,) = tmp_path.glob("real_shapes-*-quick.json")
    shapes = json.loads(out.read_text())["shapes"]
    named, mine = shapes["tiny"], shapes[str(own)]
    assert (named["vocab"], mine["vocab"], mine["published_vocab"]) == (300, 500, None)
    assert mine["checkpoint"] == str(own.resolve()) and set(mine["block"]) == {"1", "2"}
    cfg, _ = read_config(own)
    assert mine["matrix_params"] == rs.matrix_params(cfg, 500) == named["matrix_params"] + 200 * 72
    assert "500-token head" in res.stdout
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}))
    for bad, says in (
        (["--vocab", "many"], "--vocab must be"),
        (["--shapes", str(gpt2)], "the CPU kernel cannot run it"),
        (["--shapes", str(tmp_path / "nowhere")], "unknown shape"),
        (["--shapes", str(tmp_path)], "without config.json"),
    ):
        res = subprocess.run(cmd + bad, env=env, capture_output=True, text=True)
        assert res.returncode != 0 and says in res.stderr and "Traceback" not in res.stderr, res.stderr
