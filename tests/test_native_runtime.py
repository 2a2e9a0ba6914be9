"""The native runtime against transformers: same checkpoints, fp32, logits within 1e-4 and identical greedy text.

Tests of numerics run on both of the native runtime's CPU back ends: the one-call C++ kernel
(``native_kernel``, the default where it builds) and the PyTorch-operator path (``kernel=False``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.errors import ContextLengthError, UnsupportedError
from specdec.runtime import choose_runtime
from specdec.runtime.hf import HFRunner
from specdec.runtime.native import NativeCache, NativeRunner

VOCAB = 96
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=0,
)

# name -> (architecture, config overrides, extra save_pretrained kwargs). Between them: GQA and MQA,
# tied and untied embeddings, Llama attention/MLP biases, Qwen2 qkv bias, RoPE theta and linear/llama3
# scaling, Mistral sliding window shorter than the context, Qwen2 per-layer windows, sharded weights, more
# query heads per key/value head than the CPU kernel's attention tile.
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama-gqa-llama3": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        {},
    ),
    "llama-tied-bias-linear": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
        {},
    ),
    "qwen2-mqa-bias": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1), {"max_shard_size": "40KB"}),
    "qwen2-window-layer": (
        "qwen2",
        dict(
            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=6, max_window_layers=1
        ),
        {},
    ),
    "mistral-window": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=7), {}),
    # 20 query heads on one key/value head: more than the kernel's attention tile (16 queries), head_dim 8
    "llama-mqa-20-heads": (
        "llama",
        dict(hidden_size=80, num_attention_heads=20, num_key_value_heads=1, head_dim=8),
        {},
    ),
}


def write_checkpoint(root: Path, name: str) -> Path:
    """A random checkpoint whose biases and norm weights are random too (zeros/ones would hide mistakes)."""
    import transformers as tf

    arch, overrides, save_kwargs = CASES[name]
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[arch]
    torch.manual_seed(sum(map(ord, name)))
    model = tf.AutoModelForCausalLM.from_config(cls(**{**BASE, **overrides}))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in pname else 0.0))
            else:
                p.mul_(8.0)  # larger weights give peakier, more discriminating logits
    model.save_pretrained(str(root / name), safe_serialization=True, **save_kwargs)
    return root / name


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    return {name: write_checkpoint(root, name) for name in CASES}


BACKENDS = ["kernel", "ops"]


def load(path: Path, backend: str, **kwargs: Any) -> NativeRunner:
    from specdec.runtime.native_kernel import kernel_available, kernel_status

    if backend == "kernel" and not kernel_available():
        pytest.skip(f"CPU kernel unavailable here: {kernel_status()}")
    runner = NativeRunner.from_pretrained(path, kernel=backend == "kernel", **kwargs)
    assert (runner.backend == "cpu-kernel") == (backend == "kernel")
    return runner


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def run_script(runner: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Prefill beyond the windows and the precomputed-mask block size, decode blocks, roll back, decode more."""
    cache = runner.new_cache()
    out = [runner.forward(ids[:20], cache)]
    for a, b in ((20, 21), (21, 24), (24, 29)):
        out.append(runner.forward(ids[a:b], cache))
    cache.crop(22)  # reject drafts: positions 22..28 are rewritten with other tokens
    assert cache.length == 22
    out.append(runner.forward(ids[40:44], cache))
    out.append(runner.forward(ids[44:45], cache, last_only=True))
    cache.crop(0)
    out.append(runner.forward(ids[50:52], cache))  # a fresh start on a reused cache
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(checkpoints: dict[str, Path], name: str, backend: str) -> None:
    path = checkpoints[name]
    native = load(path, backend, dtype=torch.float32)
    hf = HFRunner.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(0))
    got, want = run_script(native, ids), run_script(hf, ids)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == torch.float32 and g.shape == w.shape, i
        assert rel_err(g, w) < 1e-4, f"{name} call {i}: relative error {rel_err(g, w):.2e}"
    assert native.vocab_size == hf.vocab_size and native.eos_token_ids == hf.eos_token_ids == frozenset({0})


def test_sharded_checkpoint_really_is_sharded(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen2-mqa-bias"]
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 1


def test_rope_scaling_changes_logits(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The scaling really is applied: the same weights without it give other logits."""
    src = checkpoints["llama-tied-bias-linear"]
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in src.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(cfg))
    ids = torch.arange(30) % VOCAB
    a, b = (NativeRunner.from_pretrained(p) for p in (src, plain))
    assert rel_err(a.forward(ids, a.new_cache()), b.forward(ids, b.new_cache())) > 1e-3


def test_legacy_rope_fields_and_generation_config_eos(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Older config.json files spell RoPE as rope_theta + rope_scaling{type}; eos ids also come from generation_config."""
    src = checkpoints["llama-gqa-llama3"]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in src.iterdir():
        (legacy / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (legacy / "config.json").write_text(json.dumps(cfg))
    (legacy / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    ids = torch.arange(25) % VOCAB
    a, b = (NativeRunner.from_pretrained(p) for p in (src, legacy))
    assert rel_err(b.forward(ids, b.new_cache()), a.forward(ids, a.new_cache())) < 1e-6
    assert b.eos_token_ids == frozenset({0, 5})


def test_unsupported_rope_scaling_is_a_clear_error(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "yarn"
    bad.mkdir()
    cfg = json.loads((checkpoints["llama-gqa-llama3"] / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match=r"rope scaling type 'yarn' is not supported.*runtime='hf'"):
        NativeRunner.from_pretrained(bad)
    assert choose_runtime(bad, "auto") == "hf"  # auto falls back to transformers, which implements yarn
    assert choose_runtime(checkpoints["llama-gqa-llama3"], "auto") == "native"


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_is_static_and_rollback_moves_a_position(checkpoints: dict[str, Path], backend: str) -> None:
    runner = load(checkpoints["llama-gqa-llama3"], backend, max_context=48)
    cache = runner.new_cache()
    assert isinstance(cache, NativeCache) and cache.kv.shape == (2, 2, 2, 48, 16)
    storage = cache.kv.data_ptr()
    runner.forward(torch.arange(10), cache)
    cache.crop(4)
    runner.forward(torch.arange(3), cache)
    assert cache.length == 7 and cache.kv.data_ptr() == storage
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(8)
    with pytest.raises(ContextLengthError, match="context window of 48"):
        runner.forward(torch.arange(42), cache)
    with pytest.raises(UnsupportedError, match="batch size 2"):
        runner.forward(torch.zeros(2, 3, dtype=torch.long), cache)


def test_argmax_of_a_pass_and_of_other_tensors(checkpoints: dict[str, Path]) -> None:
    """The kernel runner's argmax_rows takes a pass's own logits without the checks, and anything else (a slice, a
    copy, another dtype) through them: torch's answer either way."""
    runner = load(checkpoints["llama-gqa-llama3"], "kernel", max_context=48)
    a, b = runner.new_cache(), runner.new_cache()
    logits = runner.forward_blocks([([3, 5, 7], a), ([11, 2], b)], [3, 2])
    assert runner.argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    logits[1, 4] = float("nan")  # a NaN row: torch's answer, on the fast path too
    assert runner.argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    half = logits[:, : logits.shape[1] // 2]  # not contiguous: checked, torch's
    assert runner.argmax_rows(half) == half.argmax(dim=-1).tolist()
    assert runner.argmax_rows(logits.double()) == logits.double().argmax(dim=-1).tolist()
    assert runner.argmax_rows(runner.forward_blocks([([4], a)], [0])) == []  # a pass that keeps no row


def test_bf16_runs_close_to_fp32(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen2-mqa-bias"]
    ids = torch.arange(30) % VOCAB
    ref = NativeRunner.from_pretrained(path, dtype=torch.float32)
    bf = NativeRunner.from_pretrained(path, dtype=torch.bfloat16)
    want, got = ref.forward(ids, ref.new_cache()), bf.forward(ids, bf.new_cache())
    assert got.dtype == torch.float32 and rel_err(got, want) < 0.05


def test_auto_picks_native_for_llama_family_and_hf_for_gpt2(tiny_models: dict[str, Path]) -> None:
    for arch in ("llama", "qwen2", "mistral"):
        assert choose_runtime(tiny_models[arch], "auto") == "native"
    assert choose_runtime(tiny_models["gpt2"], "auto") == "hf"


@pytest.mark.identity
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_text_identical_to_transformers_runtime(tiny_models: dict[str, Path], arch: str) -> None:
    """Through ``specdec.load``: plain decoding (τ=0) and speculative with τ = 1 and 3, native vs transformers."""
    import specdec

    outputs: dict[str, list[list[int]]] = {}
    for runtime in ("native", "hf"):
        engine = specdec.load(tiny_models[arch], tiny_models["draft"], dtype="fp32", runtime=runtime)
        assert type(engine.target).__name__ == ("NativeRunner" if runtime == "native" else "HFRunner")
        outputs[runtime] = [
            engine.generate("def fibonacci(n):", max_new_tokens=24, tau=tau).token_ids for tau in (0, 1, 3)
        ]
    assert outputs["native"] == outputs["hf"]
    plain, *speculative = outputs["native"]
    assert plain and all(ids == plain for ids in speculative)  # greedy speculation reproduces plain decoding


def test_ops_follow_the_cpu() -> None:
    """fp32 is dense everywhere; bf16 on CPU is oneDNN-packed where the CPU has bf16 products, else fp16 weights."""
    from specdec.runtime.native_ops import DenseOps, HalfOps, PackedOps, choose_ops, half_available, packed_available

    cpu = torch.device("cpu")
    assert choose_ops(cpu, torch.float32, False) is DenseOps
    assert choose_ops(cpu, torch.bfloat16, True) is DenseOps  # the compiler packs on its own
    want = PackedOps if packed_available() else HalfOps if half_available() else DenseOps
    assert choose_ops(cpu, torch.bfloat16, False) is want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_fp32(checkpoints: dict[str, Path], dtype: torch.dtype, backend: str) -> None:
    """bf16/fp16 through the kernel, or whichever products this CPU gets (fp16 weights + fp32 activations on
    AVX2-only CPUs)."""
    path = checkpoints["llama-gqa-llama3"]
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(1))
    ref = run_script(NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=False), ids)
    runner = load(path, backend, dtype=dtype)
    # The kernel's cache follows the weights ("auto": 16 bits); the operator path keeps it in its compute dtype.
    assert runner.dtype == dtype and runner.new_cache().kv.dtype == runner.cache_dtype
    assert runner.cache_dtype == (dtype if backend == "kernel" else runner.compute_dtype)
    for i, (g, w) in enumerate(zip(run_script(runner, ids), ref)):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert rel_err(g, w) < 0.05, f"call {i}: relative error {rel_err(g, w):.2e}"


def test_fp16_weights_fall_back_when_out_of_range(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight beyond fp16's range (folded norms can make one) sends the model to plain products instead."""
    import specdec.runtime.native as native
    from specdec.runtime.native_ops import DenseOps, HalfOps

    if native.choose_ops(torch.device("cpu"), torch.bfloat16, False) is not HalfOps:
        pytest.skip("this CPU runs bf16 through oneDNN, not fp16 weights")
    monkeypatch.setattr(native, "half_fits", lambda weights: False)
    path = checkpoints["qwen2-mqa-bias"]
    runner = NativeRunner.from_pretrained(path, dtype=torch.bfloat16, kernel=False)
    assert runner._ops is DenseOps and runner.compute_dtype == torch.bfloat16
    ids = torch.arange(30) % VOCAB
    ref = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=False)
    assert rel_err(runner.forward(ids, runner.new_cache()), ref.forward(ids, ref.new_cache())) < 0.05


def test_auto_dtype_follows_the_runtime_on_cpus_without_bf16_units(monkeypatch: pytest.MonkeyPatch) -> None:
    import specdec.runtime as rt

    cpu = torch.device("cpu")
    monkeypatch.setattr(rt, "cpu_has_bf16", lambda: False)
    assert rt.resolve_dtype("auto", cpu, "native") == torch.bfloat16  # 16-bit weights, fp32 activations
    assert rt.resolve_dtype("auto", cpu, "hf") == torch.float32  # transformers' bf16 is slow there
    assert rt.resolve_dtype("float32", cpu, "native") == torch.float32  # a forced dtype is kept
    monkeypatch.setattr(rt, "cpu_has_bf16", lambda: True)
    assert rt.resolve_dtype("auto", cpu, "hf") == torch.bfloat16
