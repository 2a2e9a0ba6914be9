"""Checkpoint config for the native runtime: config.json of a Llama-family model, read without ``transformers``.

Each ``model_type`` has a reader in ``FAMILIES`` that fills in what differs between Llama, Qwen2 and
Mistral (biases, sliding windows); RoPE scaling types live in ``ROPE_SCALINGS``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ModelLoadError, UnsupportedError

# The context the static cache covers when the checkpoint allows more: a cache for 128k positions of
# a real model would take gigabytes per request. ``from_pretrained(max_context=...)`` overrides it.
DEFAULT_CACHE_LIMIT = 8192


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    scaling: str  # a key of ROPE_SCALINGS
    params: dict[str, Any]  # the rest of rope_parameters / rope_scaling (factor, ...)


@dataclass(frozen=True)
class NativeConfig:
    model_type: str
    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    windows: tuple[int | None, ...]  # sliding window per layer (None: full attention)
    rope: RopeSpec

    @property
    def groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.heads // self.kv_heads


def _default_inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    return 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [hd/2]


def _linear_inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    # Position interpolation: positions are divided by the factor, i.e. every frequency is.
    return _default_inv_freq(spec, head_dim) / float(_param(spec, "factor"))


def _llama3_inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    # Llama 3.1: long wavelengths are interpolated by the factor, short ones kept, a smooth ramp between.
    inv_freq = _default_inv_freq(spec, head_dim)
    factor = float(_param(spec, "factor"))
    low, high = float(_param(spec, "low_freq_factor")), float(_param(spec, "high_freq_factor"))
    old_context = float(_param(spec, "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


ROPE_SCALINGS: dict[str, Callable[[RopeSpec, int], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}


def _param(spec: RopeSpec, key: str) -> Any:
    if key not in spec.params:
        raise ModelLoadError(f"rope scaling {spec.scaling!r} needs {key!r} in config.json")
    return spec.params[key]


def rope_tables(spec: RopeSpec, head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` and signed ``sin`` tables ``[positions, 1, head_dim]``.

    The sign is folded into ``sin`` so that rotating half of x is ``roll(x, hd/2) * sin``: one op
    instead of slicing, negating and concatenating.
    """
    inv_freq = ROPE_SCALINGS[spec.scaling](spec, head_dim)  # [hd/2]
    freqs = torch.arange(positions, dtype=torch.int64).float()[:, None] * inv_freq[None]  # [T, hd/2]
    cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
    return cos[:, None, :], sin[:, None, :]


def rope_cis(spec: RopeSpec, head_dim: int, positions: int) -> torch.Tensor:
    """complex64 ``cos + i·sin`` ``[positions, 1, head_dim/2]``: RoPE on (x1[j], x2[j]) pairs as one complex multiply.

    ``(x1 + i·x2)(cos + i·sin) = (x1·cos - x2·sin) + i·(x2·cos + x1·sin)``, i.e. ``x·cos + rotate_half(x)·sin``
    on heads whose rows were interleaved into pairs at load (``native_weights._pairs``).
    """
    inv_freq = ROPE_SCALINGS[spec.scaling](spec, head_dim)
    freqs = torch.arange(positions, dtype=torch.int64).float()[:, None] * inv_freq[None]  # fp32, as transformers
    return torch.polar(torch.ones_like(freqs), freqs)[:, None, :]


def read_rope(raw: dict[str, Any], path: Path) -> RopeSpec:
    """RoPE settings from either the transformers-5 ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = str(params.pop("rope_type", params.pop("type", "default")))
    if scaling not in ROPE_SCALINGS:
        raise UnsupportedError(
            f"{path / 'config.json'}: rope scaling type {scaling!r} is not supported by the native runtime "
            f"(supported: {', '.join(ROPE_SCALINGS)}); load it with runtime='hf' (--runtime hf)"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedError(
            f"{path / 'config.json'}: partial_rotary_factor != 1 is not supported by the native runtime"
        )
    return RopeSpec(theta=theta, scaling=scaling, params=params)


def _llama_traits(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)), windows=None)


def _qwen2_traits(raw: dict[str, Any]) -> dict[str, Any]:
    # Qwen2 has biases on q, k and v (not o); sliding windows only on the layers named so in layer_types.
    layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    types = raw.get("layer_types") or [
        "sliding_attention" if window is not None and i >= int(raw.get("max_window_layers", 28)) else "full_attention"
        for i in range(layers)
    ]
    windows = [int(window) if t == "sliding_attention" and window is not None else None for t in types]
    return dict(qkv_bias=True, o_bias=False, mlp_bias=False, windows=windows)


def _mistral_traits(raw: dict[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window", 4096)
    return dict(
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        windows=[int(window) if window is not None else None] * int(raw["num_hidden_layers"]),
    )


FAMILIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama_traits,
    "qwen2": _qwen2_traits,
    "mistral": _mistral_traits,
}


def read_config(path: Path) -> tuple[NativeConfig, dict[str, Any]]:
    """Parse ``path/config.json``; returns the native config and the raw dict (for eos ids)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedError(
            f"{path}: model_type {model_type!r} is not supported by the native runtime "
            f"(supported: {', '.join(FAMILIES)}); load it with runtime='hf'"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedError(f"{path}: hidden_act {act!r} is not supported by the native runtime (only silu)")
    try:
        traits = FAMILIES[model_type](raw)
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        hidden = int(raw["hidden_size"])
        layers = int(raw["num_hidden_layers"])
        config = NativeConfig(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden=hidden,
            intermediate=int(raw["intermediate_size"]),
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // heads),
            eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_positions=int(raw.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=traits["qkv_bias"],
            o_bias=traits["o_bias"],
            mlp_bias=traits["mlp_bias"],
            windows=tuple(traits["windows"] or [None] * layers),
            rope=read_rope(raw, path),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: missing or invalid field {e}") from e
    if heads % kv_heads:
        raise ModelLoadError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if len(config.windows) != layers:
        raise ModelLoadError(f"{path}: layer_types names {len(config.windows)} layers, the model has {layers}")
    return config, raw
