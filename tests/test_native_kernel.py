"""The native runtime's one-call CPU kernel: block invariance, chunked prefill, threads, switches and errors.

Agreement with ``transformers`` (fp32, relative error < 1e-4) is in test_native_runtime.py, which runs
every checkpoint family on both back ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specdec.runtime.native_kernel as nk
from specdec.errors import UnsupportedError
from specdec.runtime.native import NativeRunner

pytestmark = pytest.mark.skipif(not nk.kernel_available(), reason=f"CPU kernel unavailable: {nk.kernel_status()}")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def prefill(runner: NativeRunner, ids: torch.Tensor) -> torch.Tensor:
    return runner.forward(ids, runner.new_cache())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_block_and_single_token_passes_agree_bit_for_bit(
    tiny_models: dict[str, Path], arch: str, dtype: torch.dtype
) -> None:
    """A verify block of k tokens gives exactly the logits of k one-token steps (so greedy speculation can never
    flip a near-tie against plain decoding), and so does a long prefill."""
    runner = NativeRunner.from_pretrained(tiny_models[arch], dtype=dtype, kernel=True)
    ids = torch.randint(0, runner.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    cache = runner.new_cache()
    runner.forward(ids[:20], cache)
    for k in (1, 2, 5, 6, 7, 9, 13):
        block = runner.forward(ids[20 : 20 + k], cache)
        cache.crop(20)
        singles = torch.cat([runner.forward(ids[i : i + 1], cache) for i in range(20, 20 + k)])
        cache.crop(20)
        assert torch.equal(block, singles), f"k={k}"
    # Blocks of up to PACKED_MIN_K (32) tokens keep the equality; a 40-token prefill takes the packed product,
    # which rounds differently, so it is only close.
    steps = runner.new_cache()
    singles = torch.cat([runner.forward(ids[i : i + 1], steps) for i in range(40)])
    assert torch.equal(prefill(runner, ids[:32]), singles[:32])
    assert rel_err(prefill(runner, ids), singles) < 1e-5


def test_chunked_prefill_equals_one_pass(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    runner = NativeRunner.from_pretrained(tiny_models["llama"], dtype=torch.float32, kernel=True)
    ids = torch.randint(0, runner.vocab_size, (50,), generator=torch.Generator().manual_seed(4))
    whole, last = prefill(runner, ids), runner.forward(ids, runner.new_cache(), last_only=True)
    assert rel_err(last, whole[-1:]) < 1e-5  # the head of one row takes the row-dot path, of 50 the packed one
    monkeypatch.setattr(nk, "CHUNK", 7)  # 50 tokens: 7 chunks, the last one short (row-dot path, not packed)
    assert rel_err(prefill(runner, ids), whole) < 1e-5
    chunked_last = runner.forward(ids, runner.new_cache(), last_only=True)
    assert chunked_last.shape == (1, runner.vocab_size) and rel_err(chunked_last, last) < 1e-5
    monkeypatch.setattr(nk, "CHUNK", 25)  # chunks of 25 and 25: each at most 32 tokens, so equal to steps
    steps = runner.new_cache()
    singles = torch.cat([runner.forward(ids[i : i + 1], steps) for i in range(50)])
    assert torch.equal(prefill(runner, ids), singles)


def test_packed_product_matches_for_every_tile_remainder(tiny_models: dict[str, Path]) -> None:
    """Prefills of 33..45 tokens: every remainder of the 6-token tiles, against one-token passes (fp32)."""
    runner = NativeRunner.from_pretrained(tiny_models["qwen2"], dtype=torch.float32, kernel=True)
    ids = torch.randint(0, runner.vocab_size, (45,), generator=torch.Generator().manual_seed(9))
    steps = runner.new_cache()
    singles = torch.cat([runner.forward(ids[i : i + 1], steps) for i in range(45)])
    for k in range(33, 46):
        assert rel_err(prefill(runner, ids[:k]), singles[:k]) < 1e-5, k


def test_thread_count_does_not_change_results(tiny_models: dict[str, Path]) -> None:
    runner = NativeRunner.from_pretrained(tiny_models["qwen2"], dtype=torch.bfloat16, kernel=True)
    ids = torch.randint(0, runner.vocab_size, (30,), generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill(runner, ids)
        torch.set_num_threads(3)
        three = prefill(runner, ids)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)


def test_kernel_and_operator_paths_agree_in_fp32(tiny_models: dict[str, Path]) -> None:
    ids = torch.randint(0, 64, (33,), generator=torch.Generator().manual_seed(6))
    a = prefill(NativeRunner.from_pretrained(tiny_models["mistral"], dtype=torch.float32, kernel=True), ids)
    b = prefill(NativeRunner.from_pretrained(tiny_models["mistral"], dtype=torch.float32, kernel=False), ids)
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_default_is_the_kernel_on_cpu_and_not_with_compile(tiny_models: dict[str, Path]) -> None:
    assert NativeRunner.from_pretrained(tiny_models["llama"]).backend == "cpu-kernel"
    with pytest.raises(UnsupportedError, match="CPU kernel cannot run"):
        NativeRunner.from_pretrained(tiny_models["llama"], kernel=True, compile=True)


def test_switched_off_by_environment(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nk.ENV_SWITCH, "0")
    nk._load.cache_clear()
    try:
        assert not nk.kernel_available() and nk.kernel_status() == f"disabled by {nk.ENV_SWITCH}"
        runner = NativeRunner.from_pretrained(tiny_models["llama"])
        assert runner.backend.startswith("torch-")
        with pytest.raises(UnsupportedError, match=f"disabled by {nk.ENV_SWITCH}"):
            NativeRunner.from_pretrained(tiny_models["llama"], kernel=True)
    finally:
        monkeypatch.delenv(nk.ENV_SWITCH)
        nk._load.cache_clear()
    assert nk.kernel_available()


def test_a_failing_compiler_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\necho 'broken-c++: fatal error: nothing works' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    nk._load.cache_clear()
    try:
        assert not nk.kernel_available()
        assert "compiling the CPU kernel failed" in nk.kernel_status() and "nothing works" in nk.kernel_status()
    finally:
        monkeypatch.undo()
        nk._load.cache_clear()
    assert nk.kernel_available()


def test_out_of_range_token_is_an_error(tiny_models: dict[str, Path]) -> None:
    runner = NativeRunner.from_pretrained(tiny_models["llama"], kernel=True)
    with pytest.raises(ValueError, match="CPU kernel refused"):
        runner.forward(torch.tensor([runner.vocab_size + 3]), runner.new_cache())


def test_status_names_the_instruction_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AVX512-BF16 products where the CPU has them; SPECDEC_CPU_KERNEL_ISA=avx2 forces the fp32 AVX2 build."""
    assert nk.kernel_status() == f"available ({nk.kernel_isa()})"
    monkeypatch.setenv(nk.ISA_SWITCH, "avx2")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    nk._load.cache_clear()
    try:
        assert nk.kernel_isa() == "avx2" and nk.kernel_status() == "available (avx2)"
    finally:
        monkeypatch.undo()
        nk._load.cache_clear()


def test_odd_sizes_take_the_tail_paths_and_still_match_transformers(tmp_path: Path) -> None:
    """hidden 72, head_dim 18, intermediate 100, vocab 97: none a multiple of the 16-wide strides (nor of the
    AVX512 build's 64), so every product, RoPE and attention runs its remainder code."""
    import transformers as tf

    from specdec.runtime.hf import HFRunner

    cfg = tf.LlamaConfig(
        vocab_size=97,
        hidden_size=72,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(7)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
            else:
                p.mul_(8.0)
    model.save_pretrained(str(tmp_path / "odd"), safe_serialization=True)
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(8))
    kernel = NativeRunner.from_pretrained(tmp_path / "odd", dtype=torch.float32, kernel=True)
    hf = HFRunner.from_pretrained(tmp_path / "odd", dtype=torch.float32)
    got, want = prefill(kernel, ids), hf.forward(ids, hf.new_cache())
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    bf = NativeRunner.from_pretrained(tmp_path / "odd", dtype=torch.bfloat16, kernel=True)
    cache = bf.new_cache()
    bf.forward(ids[:20], cache)
    block = bf.forward(ids[20:27], cache)
    cache.crop(20)
    assert torch.equal(block, torch.cat([bf.forward(ids[i : i + 1], cache) for i in range(20, 27)]))
