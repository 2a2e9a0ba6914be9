"""Real model shapes for timing: random-init checkpoints with published configurations, and what a pass costs.

``benchmarks/real_shapes.py`` is the command around this module; the functions here are also for callers that
need a measured cost curve (``pass_times``: t(k) of a runner for k-row verify blocks or k-sequence batches).

The checkpoints have the published bodies (hidden size, layers, heads, MLP width, RoPE, biases, tied embeddings)
of SmolLM2-135M, Qwen2.5-0.5B and Llama-3.2-1B, but the **vocabulary is cut to 8,192 entries** (the shipped
tokenizer's) and the weights are random (std 0.02; norms 1): the time of a pass depends only on the shapes. With
the real vocabularies the output head alone would be 57M (SmolLM2), 136M (Qwen2.5) and 263M (Llama-3.2)
parameters; the figures here leave that cost out.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.runtime.base import KVCache, ModelRunner
from specdec.runtime.native_config import NativeConfig

VOCAB = 8192  # the shipped tokenizer's vocabulary
FORMAT = 1  # bump when the written checkpoints change

_COMMON: dict[str, Any] = {"hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 0, "use_cache": True}
# Published configurations (the models' config.json on the Hugging Face Hub), vocabulary aside.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "published_vocab_size": 49152,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "published_vocab_size": 151936,
    },
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "published_vocab_size": 128256,
    },
    # Not a published model: a few-MB shape with odd sizes, for smoke tests (``--quick``).
    "tiny": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 72,
        "intermediate_size": 200,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "published_vocab_size": VOCAB,
    },
}


def cpu_info() -> dict[str, Any]:
    """The machine a benchmark's figures come from: CPU model, cores, vector extensions, cache sizes, load."""
    info: dict[str, Any] = {"machine": platform.machine(), "cores": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and "model" not in info:
                info["model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags") and "isa" not in info:
                flags = set(line.split(":", 1)[1].split())
                info["isa"] = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")))
    except OSError:
        pass
    for level, key in (("index3", "l3"), ("index2", "l2_per_core")):
        p = Path(f"/sys/devices/system/cpu/cpu0/cache/{level}/size")
        if p.exists():
            info[key] = p.read_text().strip()
    with contextlib.suppress(OSError):
        info["load_average"] = list(os.getloadavg())
    return info


def cache_root() -> Path:
    """Where checkpoints are written: ``$SPECDEC_CACHE_DIR/real_shapes``, else ``~/.cache/specdec/real_shapes``."""
    from specdec.runtime.native_kernel import cache_dir

    return cache_dir("real_shapes")


def checkpoint(name: str, root: Path | None = None, vocab: int = VOCAB, seed: int = 0) -> Path:
    """The random-init checkpoint of shape ``name`` (bf16 safetensors), written on first use."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    if vocab < 1:
        raise ValueError(f"vocab must be positive, got {vocab}")
    out = (root or cache_root()) / f"{name}-v{vocab}-f{FORMAT}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    from safetensors.torch import save_file

    cfg = {k: v for k, v in SHAPES[name].items() if k != "published_vocab_size"}
    cfg.update(_COMMON, vocab_size=vocab, torch_dtype="bfloat16")
    d, ff, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", d // heads)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, d), "model.norm.weight": torch.ones(d, dtype=torch.bfloat16)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(vocab, d)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        for proj, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            tensors[p + f"self_attn.{proj}_proj.weight"] = rand(rows, d)
            if cfg["model_type"] == "qwen2":
                tensors[p + f"self_attn.{proj}_proj.bias"] = rand(rows)
        tensors[p + "self_attn.o_proj.weight"] = rand(d, heads * hd)
        tensors[p + "mlp.gate_proj.weight"] = rand(ff, d)
        tensors[p + "mlp.up_proj.weight"] = rand(ff, d)
        tensors[p + "mlp.down_proj.weight"] = rand(d, ff)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # written meanwhile by another process
        if not (out / "model.safetensors").exists():
            raise
    return out


def matrix_params(cfg: NativeConfig, vocab: int) -> int:
    """Parameters the products read per pass: every layer's projections and the output head."""
    d, hd = cfg.hidden, cfg.head_dim
    per_layer = (cfg.heads + 2 * cfg.kv_heads) * hd * d + d * cfg.heads * hd + 3 * d * cfg.intermediate
    return cfg.layers * per_layer + vocab * d


def pass_flops(cfg: NativeConfig, vocab: int, rows: int, context: int) -> float:
    """Floating-point operations of a pass of ``rows`` rows (products, plus attention over ``context`` positions)."""
    attention = 4.0 * cfg.layers * cfg.heads * cfg.head_dim * (context + rows)
    return rows * (2.0 * matrix_params(cfg, vocab) + attention)


def _kernel() -> ctypes.CDLL:
    from specdec.runtime import native_kernel as nk

    lib = nk._library()
    if lib is None:
        raise RuntimeError(f"CPU kernel unavailable: {nk.kernel_status()}")
    lib.sd_read_bytes.restype = ctypes.c_double
    lib.sd_read_bytes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.sd_fma_peak.restype = ctypes.c_double
    lib.sd_fma_peak.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return lib


# How the read probe reads (streams side by side per thread, lines prefetched ahead): the best of these is the floor.
# One sequential read with the hardware prefetchers alone, and four with a software prefetch, as the AVX2 build's
# one-row products read their four panels: on a Xeon with AMX (session 73) 25 against 30 GB/s, and the products
# reached the second, so a floor from the first alone was 1.2x too low a bar.
READ_PATTERNS = ((1, 0), (4, 32))


def read_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Bytes per second the kernel's threads read from memory (best of ``reps`` sweeps over ``mib`` MiB, well
    beyond any L3, in each of ``READ_PATTERNS``), the way the products stream their weights."""
    return read_probe(threads, mib, reps)()


def read_probe(threads: int, mib: int = 512, reps: int = 3) -> Callable[[], float]:
    """``read_bandwidth`` as a probe to call again and again: its buffer is allocated (and its pages touched) once.
    A probe that allocated its ``mib`` MiB at every call slowed the next pass: on the Xeon of session 73 one
    Qwen2.5-0.5B-shaped pass took 37-51 ms right after such a probe against 32 ms in a row of them, so a round's
    first pass read too slow (docs/benchmarks.md, session 73)."""
    if mib < 1 or reps < 1:
        raise ValueError("read_bandwidth needs mib >= 1 and reps >= 1")
    lib = _kernel()
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)

    def probe() -> float:
        best = math.inf
        for _ in range(reps):
            for streams, ahead in READ_PATTERNS:
                t0 = time.perf_counter()
                lib.sd_read_bytes(buf.data_ptr(), buf.numel() * 4, threads, streams, ahead)
                best = min(best, time.perf_counter() - t0)
        return buf.numel() * 4 / best

    return probe


def fma_peak(threads: int, kind: str = "fp32", seconds: float = 0.2, reps: int = 5) -> float:
    """Floating-point operations per second of the products' instruction in registers: ``"fp32"`` (FMA at the
    build's vector width), ``"bf16dot"`` (VDPBF16PS, AVX512-BF16 and AMX builds) or ``"amx"`` (TDPBF16PS on the tile
    unit, AMX builds only). Best of ``reps``."""
    kinds = {"fp32": 0, "bf16dot": 1, "amx": 2}
    if kind not in kinds:
        raise ValueError(f"kind must be one of {', '.join(kinds)}, got {kind!r}")
    lib = _kernel()
    iters = 100_000
    while True:  # calibrate: one call of about `seconds`
        t0 = time.perf_counter()
        flops = lib.sd_fma_peak(iters, threads, kinds[kind])
        dt = time.perf_counter() - t0
        if flops < 0:
            raise RuntimeError(f"this kernel build has no {kind} products")
        if dt > seconds / 4 or iters > 10**10:
            break
        iters *= 4
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        flops = lib.sd_fma_peak(iters, threads, kinds[kind])
        best = max(best, flops / (time.perf_counter() - t0))
    return best


def batch_forward(runner: ModelRunner) -> Callable[[list[tuple[torch.Tensor, KVCache]]], Any] | None:
    """The runner's one-pass batch (``forward_batch``: rows of several sequences in one pass), or None where the
    runner has none."""
    fb = getattr(runner, "forward_batch", None)
    if fb is None:
        return None
    return lambda blocks: fb(blocks, True)


@dataclass
class PassTimes:
    """Median seconds of a pass per row count: ``block[k]`` (one sequence, k consecutive tokens, logits of every
    row as a verify pass asks) and ``batch[k]`` (k sequences, one token each); ``batch`` is empty, with
    ``batch_missing`` saying why, where the runner cannot run batches. ``block_rounds[k]``: each round's figure (the
    median's samples); ``probes``: what the ``probe`` given to ``pass_times`` returned at the start of each round,
    just before that round's one-row block (e.g. the memory's read bandwidth of that moment)."""

    block: dict[int, float]
    batch: dict[int, float]
    batch_missing: str | None = None
    block_rounds: dict[int, list[float]] = field(default_factory=dict)
    probes: list[float] = field(default_factory=list)


def pass_times(
    runner: ModelRunner,
    ks: Sequence[int],
    *,
    context: int = 64,
    batches: bool = True,
    rounds: int = 5,
    min_seconds: float = 0.05,
    seed: int = 0,
    probe: Callable[[], float] | None = None,
) -> PassTimes:
    """t(k) of ``runner``: each pass runs at ``context`` tokens of cache and is rolled back, so every call sees the
    same context. Row counts take turns in rounds (k = 1, 2, ... then again, each round starting one further along),
    so machine noise and whatever ran before a round hit them alike;
    each entry is the median over ``rounds`` of the mean of enough calls to last ``min_seconds``. ``probe``, when
    given, is called at the start of every round (its values in ``PassTimes.probes``): a limit measured beside the
    passes it bounds, on a machine whose limits move while it runs."""
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 1:
        raise ValueError(f"row counts must be positive, got {list(ks)}")
    if rounds < 1 or context < 1:
        raise ValueError("pass_times needs rounds >= 1 and context >= 1")
    if context + ks[-1] > runner.max_context:
        raise ValueError(f"context {context} + {ks[-1]} rows exceed the runner's {runner.max_context} positions")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, runner.vocab_size, (context,), generator=gen)
    rows = torch.randint(0, runner.vocab_size, (ks[-1],), generator=gen)
    base = runner.new_cache()
    runner.forward(prompt, base, last_only=True)

    def block(k: int) -> None:
        runner.forward(rows[:k], base)
        base.crop(context)

    calls: dict[tuple[str, int], Callable[[], None]] = {("block", k): functools.partial(block, k) for k in ks}
    missing = None
    fb = batch_forward(runner) if batches else None
    if batches and fb is None:
        missing = f"{type(runner).__name__} has no forward_batch"
    if fb is not None:
        caches = [base] + [runner.fork_cache(base, prompt.tolist()) for _ in range(ks[-1] - 1)]

        def batch(k: int) -> None:
            fb([(rows[i : i + 1], caches[i]) for i in range(k)])
            for c in caches[:k]:
                c.crop(context)

        calls.update({("batch", k): functools.partial(batch, k) for k in ks})
    counts: dict[tuple[str, int], int] = {}
    for key, fn in calls.items():  # warm up, and size each measurement to about min_seconds
        fn()
        t0 = time.perf_counter()
        fn()
        counts[key] = max(1, math.ceil(min_seconds / max(time.perf_counter() - t0, 1e-6)))
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    probes: list[float] = []
    order = list(calls)
    for r in range(rounds):
        if probe is not None:
            probes.append(float(probe()))
        turn = order[r % len(order) :] + order[: r % len(order)]  # each round starts one further along
        if probe is not None:
            calls[turn[0]]()  # untimed: the probe's sweep leaves the first pass after it slower
        for key in turn:
            fn = calls[key]
            n = counts[key]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[key].append((time.perf_counter() - t0) / n)
    med = {key: statistics.median(v) for key, v in samples.items()}
    return PassTimes(
        block={k: med[("block", k)] for k in ks},
        batch={k: med[("batch", k)] for k in ks if ("batch", k) in med},
        batch_missing=missing,
        block_rounds={k: samples[("block", k)] for k in ks},
        probes=probes,
    )


def ideal_speedup(t: dict[int, float], draft_cost: float, alpha: float) -> tuple[int, float]:
    """Best (τ, speedup over one-token decoding) of greedy speculation with τ drafted tokens per step, i.i.d.
    acceptance ``alpha`` per token, a draft pass costing ``draft_cost`` × t(1), and a verify pass of τ+1 rows
    costing the measured t(τ+1): speedup = (1 − α^(τ+1)) / (1 − α) × t(1) / (τ·c·t(1) + t(τ+1))."""
    if not 0.0 <= alpha < 1.0 or draft_cost < 0.0 or 1 not in t:
        raise ValueError("ideal_speedup needs 0 <= alpha < 1, draft_cost >= 0 and t(1)")
    best = (0, 1.0)
    for k, tk in sorted(t.items()):
        tau = k - 1
        if tau < 1:
            continue
        tokens = (1.0 - alpha ** (tau + 1)) / (1.0 - alpha)
        s = tokens * t[1] / (tau * draft_cost * t[1] + tk)
        if s > best[1]:
            best = (tau, s)
    return best
