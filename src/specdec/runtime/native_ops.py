"""Matrix products of the native runtime, in two flavours chosen per device and dtype.

``Dense``: plain ``F.linear`` (MKL sgemm on CPU in fp32, cuBLAS on GPU; what ``torch.compile`` sees).
``Packed``: oneDNN with weights reordered once at load, for bf16 on CPU. Unpacked bf16 ``F.linear``
reorders the weight on every call, which dominated a decode step (the 8192-row output projection alone
cost 3-5× more unpacked); oneDNN also fuses SiLU and the gate·up product into the projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.runtime.native_weights import LayerWeights


@dataclass
class PreparedLayer:
    """A layer's weights in the form its ops take (packed tensors are opaque oneDNN layouts)."""

    wqkv: torch.Tensor  # [(H + 2·KV)·hd, d]
    bqkv: torch.Tensor | None
    wo_t: torch.Tensor  # [H·hd, d]
    bo: torch.Tensor | None
    gate: torch.Tensor | None  # [ff, d] (packed ops)
    up: torch.Tensor | None  # [ff, d] (packed ops)
    wgu: torch.Tensor | None  # [2·ff, d] (dense ops)
    bgu: torch.Tensor | None
    wd_t: torch.Tensor  # [ff, d]
    bd: torch.Tensor | None


class DenseOps:
    """Projections through ``F.linear``."""

    @staticmethod
    def prepare(w: torch.Tensor) -> torch.Tensor:
        return w

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, b)

    @staticmethod
    def swiglu(x: torch.Tensor, lw: PreparedLayer) -> torch.Tensor:
        """``silu(x·gateᵀ) * (x·upᵀ)`` from the fused [gate; up] weight: one product, two pointwise ops."""
        assert lw.wgu is not None
        h = F.linear(x, lw.wgu, lw.bgu)  # [k, 2·ff]
        ff = h.shape[-1] // 2
        return F.silu(h[:, :ff]).mul_(h[:, ff:])


class PackedOps:
    """oneDNN projections with weights packed at load (bf16 on CPU)."""

    @staticmethod
    def prepare(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w, 1)

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    @staticmethod
    def swiglu(x: torch.Tensor, lw: PreparedLayer) -> torch.Tensor:
        """Two fused products: ``g = silu(x·gateᵀ)``, then ``(x·upᵀ) * g`` as a post-op."""
        assert lw.gate is not None and lw.up is not None
        ff = lw.gate.size(0)
        bg, bu = (None, None) if lw.bgu is None else (lw.bgu[:ff], lw.bgu[ff:])
        g = torch.ops.mkldnn._linear_pointwise(x, lw.gate, bg, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, g, lw.up, bu, "mul")


def prepare_layer(lw: LayerWeights, ops: type[DenseOps] | type[PackedOps]) -> PreparedLayer:
    """Residual projections stay dense (in-place ``addmm_`` into the residual stream); the rest per ``ops``."""
    ff = lw.wgu.shape[0] // 2
    packed = ops is PackedOps
    return PreparedLayer(
        wqkv=ops.prepare(lw.wqkv),
        bqkv=lw.bqkv,
        wo_t=lw.wo_t,
        bo=lw.bo,
        gate=ops.prepare(lw.wgu[:ff].contiguous()) if packed else None,
        up=ops.prepare(lw.wgu[ff:].contiguous()) if packed else None,
        wgu=None if packed else lw.wgu,
        bgu=lw.bgu,
        wd_t=lw.wd_t,
        bd=lw.bd,
    )


def packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def choose_ops(device: torch.device, dtype: torch.dtype, compile: bool) -> type[DenseOps] | type[PackedOps]:
    """Packed oneDNN for eager bf16 on CPU; dense everywhere else (the compiler packs on its own)."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not compile and packed_available():
        return PackedOps
    return DenseOps
