"""Matrix products of the native runtime, in three flavours chosen per device, dtype and CPU.

``DenseOps``: ``torch.mm`` against weights stored transposed (``[in, out]``): MKL sgemm on CPU in fp32
(``x @ Wt`` measured 1.1-1.7x faster than ``F.linear``'s ``x @ W.T`` for k <= 8 on an AVX2 Zen 3),
cuBLAS on GPU, and what ``torch.compile`` sees. Residual projections are in-place ``addmm_``.

``PackedOps``: oneDNN with bf16 weights reordered once at load, for bf16 on CPUs with native bf16
support (AVX512-BW/VL/DQ or AVX-NE-CONVERT: oneDNN refuses the reorder elsewhere). Unpacked bf16
``F.linear`` reorders the weight on every call; oneDNN also fuses SiLU and the gate·up product.

``HalfOps``: fbgemm's fp16-weight GEMM (fp16 weights packed at load, fp32 activations and
accumulation, AVX2 + F16C), for bf16/fp16 on CPUs without native bf16 matrix support. There
PyTorch's bf16 products run in scalar fallbacks (an 8-token block through an 8-layer model took 45 ms),
while a decode step is bound by reading the weights: fp16 weights halve the bytes of fp32 ones and
keep 3 more mantissa bits than bf16. Activations and the KV cache stay fp32.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.runtime.native_weights import LayerWeights

FP16_MAX = 65504.0


@dataclass
class PreparedLayer:
    """A layer's weights in the form its ops take (packed tensors are opaque oneDNN/fbgemm layouts)."""

    wqkv: torch.Tensor  # q/k/v projection
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # output projection, residual
    bo: torch.Tensor | None
    wgu: torch.Tensor | None  # fused [gate; up] (dense, half)
    bgu: torch.Tensor | None
    gate: torch.Tensor | None  # oneDNN-packed gate and up (packed ops)
    up: torch.Tensor | None
    wd: torch.Tensor  # down projection, residual
    bd: torch.Tensor | None


class DenseOps:
    """Projections as ``x @ Wt`` with ``Wt = W.T`` stored contiguous."""

    compute_fp32 = False  # activations in the runtime dtype

    @staticmethod
    def prepare(w: torch.Tensor, b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return w.t().contiguous(), b

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch.mm(x, w) if b is None else torch.addmm(b, x, w)

    @staticmethod
    def add_linear_(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
        """``x += a @ W.T + b`` in place (one ``addmm_`` into the residual stream)."""
        if b is not None:
            x.add_(b)
        x.addmm_(a, w)

    @staticmethod
    def swiglu(x: torch.Tensor, lw: PreparedLayer) -> torch.Tensor:
        """``silu(x·gateᵀ) * (x·upᵀ)`` from the fused [gate; up] weight: one product, two in-place ops."""
        assert lw.wgu is not None
        return _silu_mul(torch.mm(x, lw.wgu) if lw.bgu is None else torch.addmm(lw.bgu, x, lw.wgu))


class PackedOps:
    """oneDNN projections with bf16 weights packed at load (bf16 on CPUs with native bf16 support)."""

    compute_fp32 = False

    @staticmethod
    def prepare(w: torch.Tensor, b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.ops.mkldnn._reorder_linear_weight(w, 1), b

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    add_linear_ = DenseOps.add_linear_  # residual weights stay dense (transposed) for in-place addmm_

    @staticmethod
    def swiglu(x: torch.Tensor, lw: PreparedLayer) -> torch.Tensor:
        """Two fused products: ``g = silu(x·gateᵀ)``, then ``(x·upᵀ) * g`` as a post-op."""
        assert lw.gate is not None and lw.up is not None
        ff = lw.gate.size(0)
        bg, bu = (None, None) if lw.bgu is None else (lw.bgu[:ff], lw.bgu[ff:])
        g = torch.ops.mkldnn._linear_pointwise(x, lw.gate, bg, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, g, lw.up, bu, "mul")


class HalfOps:
    """fbgemm fp16-weight products with fp32 activations (bf16/fp16 on CPUs without native bf16 products)."""

    compute_fp32 = True

    @staticmethod
    def prepare(w: torch.Tensor, b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # fbgemm takes a bias tensor, never None: zeros cost one vector add inside the kernel.
        bias = torch.zeros(w.shape[0], dtype=torch.float32) if b is None else b.float().contiguous()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "deprecated": the replacement op costs ~30 µs more per call
            return torch.fbgemm_pack_gemm_matrix_fp16(w.float().contiguous()), bias

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        assert b is not None  # prepare() always makes one
        return torch.fbgemm_linear_fp16_weight(x, w, b)

    @staticmethod
    def add_linear_(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
        x.add_(HalfOps.linear(a, w, b))

    @staticmethod
    def swiglu(x: torch.Tensor, lw: PreparedLayer) -> torch.Tensor:
        assert lw.wgu is not None and lw.bgu is not None
        return _silu_mul(HalfOps.linear(x, lw.wgu, lw.bgu))


def _silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in place from the fused ``[k, 2·ff]`` product of [gate; up]."""
    g, u = gu.view(gu.shape[0], 2, -1).unbind(1)
    return F.silu(g, inplace=True).mul_(u)


Ops = type[DenseOps] | type[PackedOps] | type[HalfOps]


def prepare_layer(lw: LayerWeights, ops: Ops) -> PreparedLayer:
    """Weights of one layer in the layout ``ops`` takes. Packed (oneDNN) keeps residual projections dense."""
    ff = lw.wgu.shape[0] // 2
    wqkv, bqkv = ops.prepare(lw.wqkv, lw.bqkv)
    res_ops: Ops = DenseOps if ops is PackedOps else ops
    wo, bo = res_ops.prepare(lw.wo, lw.bo)
    wd, bd = res_ops.prepare(lw.wd, lw.bd)
    if ops is PackedOps:
        gate, up = (torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1) for w in (lw.wgu[:ff], lw.wgu[ff:]))
        wgu, bgu = None, lw.bgu
    else:
        gate = up = None
        wgu, bgu = ops.prepare(lw.wgu, lw.bgu)
    return PreparedLayer(wqkv=wqkv, bqkv=bqkv, wo=wo, bo=bo, wgu=wgu, bgu=bgu, gate=gate, up=up, wd=wd, bd=bd)


@functools.cache
def packed_available() -> bool:
    """oneDNN bf16 weight packing works on this CPU (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), 1)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=torch.bfloat16), w, None, "none", [], "")
        return bool(y[0, 0].item() == 8.0)
    except RuntimeError:
        return False


@functools.cache
def half_available() -> bool:
    """fbgemm's fp16-weight GEMM is compiled in and runs on this CPU (it needs AVX2 + F16C)."""
    if not hasattr(torch, "fbgemm_linear_fp16_weight") or "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        w, b = HalfOps.prepare(torch.ones(8, 8))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-time deprecation warning of the first call
            y = HalfOps.linear(torch.ones(1, 8), w, b)
        return bool(y[0, 0].item() == 8.0)
    except RuntimeError:
        return False


def half_fits(weights: list[torch.Tensor]) -> bool:
    """Every weight fits fp16's range (folded norm weights could in principle push one past 65504)."""
    return all(float(w.abs().max()) < FP16_MAX for w in weights)


def choose_ops(device: torch.device, dtype: torch.dtype, compile: bool) -> Ops:
    """oneDNN-packed bf16 or fbgemm fp16 weights for eager bf16/fp16 on CPU; dense everywhere else."""
    if device.type != "cpu" or compile or dtype not in (torch.bfloat16, torch.float16):
        return DenseOps
    if dtype == torch.bfloat16 and packed_available():
        return PackedOps
    if half_available():
        return HalfOps
    return DenseOps
