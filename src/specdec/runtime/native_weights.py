"""Weights for the native runtime: safetensors (single file or sharded) -> fused, device-resident tensors.

Per layer, q/k/v are concatenated into one projection and gate/up into another. Constant factors are
folded into weights (in fp32, before rounding to the runtime dtype): each RMSNorm weight into the
columns of the projection that reads the normalised vector, and the attention scale 1/sqrt(head_dim)
into the query rows (RoPE is linear, so scaling before or after it is the same). With
``interleave_rope`` the rows of each query and key head are reordered from halves (``x1 | x2``, the
Hugging Face rotate-half layout) to pairs (``x1[0], x2[0], x1[1], ...``) so that RoPE is one complex
multiply; queries and keys are permuted alike, so their dot products, and the logits, are unchanged.
The embedding is
stored as [E, -E]: the runtime carries the residual stream as [x, -x], whose LayerNorm (one fused
kernel, mean exactly 0) is x's RMSNorm twice over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import ModelLoadError
from specdec.runtime.native_config import NativeConfig

INDEX_FILE = "model.safetensors.index.json"


@dataclass
class LayerWeights:
    wqkv: torch.Tensor  # [(H + 2·KV)·hd, d], input norm folded in
    bqkv: torch.Tensor | None  # [(H + 2·KV)·hd]
    wo: torch.Tensor  # [d, H·hd]
    bo: torch.Tensor | None  # [d]
    wgu: torch.Tensor  # [2·ff, d], post-attention norm folded in
    bgu: torch.Tensor | None  # [2·ff]
    wd: torch.Tensor  # [d, ff]
    bd: torch.Tensor | None  # [d]

    def matrices(self) -> list[torch.Tensor]:
        return [self.wqkv, self.wo, self.wgu, self.wd]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, 2·d]: [E, -E]
    layers: list[LayerWeights]
    lm_head: torch.Tensor  # [V, d], final norm folded in


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: ``model.safetensors``, shards named by the index, or any ``*.safetensors``."""
    from safetensors.torch import load_file

    index = path / INDEX_FILE
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"cannot read the shard index {index}: {e}") from e
        shards = [path / f for f in files]
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"no *.safetensors weights in {path} (the native runtime reads safetensors only)")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not shard.exists():
            raise ModelLoadError(f"shard {shard.name} named by {INDEX_FILE} is missing from {path}")
        try:
            tensors.update(load_file(str(shard), device="cpu"))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"cannot read {shard}: {e}") from e
    return tensors


class _Picker:
    """Takes named tensors out of a state dict, converted, with a clear error for a missing one."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path, device: torch.device, dtype: torch.dtype) -> None:
        self.tensors, self.path, self.device, self.dtype = tensors, path, device, dtype

    def raw(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"checkpoint {self.path} has no tensor {name!r}") from None

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def get(self, name: str) -> torch.Tensor:
        return self.put(self.raw(name))

    def maybe(self, name: str, present: bool) -> torch.Tensor | None:
        return self.get(name) if present else None


def _pairs(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head reordered from halves to interleaved pairs (see the module docstring)."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    return w.reshape(-1, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


def _fused_qkv(
    p: _Picker, prefix: str, cfg: NativeConfig, suffix: str, norm: torch.Tensor, interleave: bool
) -> torch.Tensor:
    q, k, v = (p.raw(f"{prefix}.self_attn.{n}_proj.{suffix}").float() for n in "qkv")
    if interleave:
        q, k = _pairs(q, cfg.head_dim), _pairs(k, cfg.head_dim)
    qkv = torch.cat([q * cfg.head_dim**-0.5, k, v], dim=0)
    return p.put(qkv * norm if suffix == "weight" else qkv)


def _layer(p: _Picker, i: int, cfg: NativeConfig, interleave: bool) -> LayerWeights:
    pre = f"model.layers.{i}"
    mlp = f"{pre}.mlp"
    bias_gu = None
    if cfg.mlp_bias:
        bias_gu = p.put(torch.cat([p.raw(f"{mlp}.gate_proj.bias"), p.raw(f"{mlp}.up_proj.bias")]))
    ln1 = p.raw(f"{pre}.input_layernorm.weight").float()[None, :]  # [1, d]: scales the columns
    ln2 = p.raw(f"{pre}.post_attention_layernorm.weight").float()[None, :]
    gate_up = torch.cat([p.raw(f"{mlp}.gate_proj.weight"), p.raw(f"{mlp}.up_proj.weight")], dim=0).float()
    return LayerWeights(
        wqkv=_fused_qkv(p, pre, cfg, "weight", ln1, interleave),
        bqkv=_fused_qkv(p, pre, cfg, "bias", ln1, interleave) if cfg.qkv_bias else None,
        wo=p.get(f"{pre}.self_attn.o_proj.weight"),
        bo=p.maybe(f"{pre}.self_attn.o_proj.bias", cfg.o_bias),
        wgu=p.put(gate_up * ln2),
        bgu=bias_gu,
        wd=p.get(f"{mlp}.down_proj.weight"),
        bd=p.maybe(f"{mlp}.down_proj.bias", cfg.mlp_bias),
    )


def load_weights(
    path: Path,
    cfg: NativeConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    interleave_rope: bool = False,
    embed_dtype: torch.dtype | None = None,
) -> ModelWeights:
    """Weights in ``dtype`` (the embedding in ``embed_dtype``, default ``dtype``)."""
    p = _Picker(read_tensors(path), path, device, dtype)
    embed = p.raw("model.embed_tokens.weight")
    if cfg.tie_embeddings:
        lm_head = embed
    elif "lm_head.weight" in p.tensors:
        lm_head = p.raw("lm_head.weight")
    else:
        raise ModelLoadError(f"checkpoint {path} has no lm_head.weight and tie_word_embeddings is false")
    if embed.shape != (cfg.vocab_size, cfg.hidden):
        raise ModelLoadError(
            f"checkpoint {path}: embedding is {tuple(embed.shape)}, config.json says {(cfg.vocab_size, cfg.hidden)}"
        )
    layers = [_layer(p, i, cfg, interleave_rope) for i in range(cfg.layers)]
    norm = p.raw("model.norm.weight").float()[None, :]
    embed2 = torch.cat([embed, -embed], dim=1).to(device=device, dtype=embed_dtype or dtype).contiguous()
    return ModelWeights(embed=embed2, layers=layers, lm_head=p.put(lm_head.float() * norm))
