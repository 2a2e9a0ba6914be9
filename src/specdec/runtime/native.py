"""Native runtime: Llama, Qwen2 and Mistral in plain PyTorch, tuned for the per-operation cost of small models.

Loads the same Hugging Face checkpoint directories as the ``transformers`` runtime (config.json +
safetensors) without its model classes. What keeps a decode step cheap (see docs/runtime.md):

- one preallocated KV cache tensor per request ``[layers, 2, kv_heads, max_context, head_dim]``,
  written by position, so rolling back rejected drafts is moving an integer;
- fused q/k/v and gate/up projections, products chosen per CPU and dtype (``native_ops``: fp32
  ``x @ Wt``; oneDNN-packed bf16; fbgemm fp16 weights with fp32 activations where the CPU has no
  bf16 products), residual adds fused into in-place ``addmm``, RMSNorm as one LayerNorm kernel over
  [x, -x], norm weights and the attention scale folded into the projections at load;
- RoPE from precomputed tables: one in-place complex multiply on pair-interleaved q/k rows (fp32
  activations), else ``x·cos + roll(x)·sin`` written in place;
- per-layer cache views made once per cache, so attention reads a ``narrow`` of them;
- grouped-query attention with the query groups folded into the rows of one ``bmm`` (no repeated
  keys), and causal/sliding-window masks sliced from a precomputed band instead of built per step.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from specdec.errors import ContextLengthError, ModelLoadError, UnsupportedError
from specdec.runtime.base import KVCache, ModelRunner, check_batch_one, eos_ids_of, token_tensor
from specdec.runtime.hf import check_checkpoint_dir
from specdec.runtime.native_config import (
    DEFAULT_CACHE_LIMIT,
    FAMILIES,
    NativeConfig,
    read_config,
    rope_cis,
    rope_tables,
)
from specdec.runtime.native_kernel import (
    AMX_ROWS,
    CHUNK,
    WEIGHT_TYPES,
    DraftRuleC,
    FusedLlama,
    argmax_rows,
    kernel_argmax_rows,
    kernel_available,
    kernel_isa,
    kernel_sample_rows,
    kernel_sample_with_probs,
    kernel_status,
    kernel_verify_sampled,
    nan_rows_by_torch,
)
from specdec.runtime.native_ops import DenseOps, HalfOps, Ops, choose_ops, half_fits, prepare_layer
from specdec.runtime.native_weights import ModelWeights, load_weights
from specdec.runtime.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from specdec.policy.base import RuleNumbers

SUPPORTED_MODEL_TYPES = set(FAMILIES)
# Blocks up to this many tokens take their mask from the precomputed band; longer ones (prefill) build one.
BAND_ROWS = 16
COMPILE_MODE = "max-autotune-no-cudagraphs"
SPARE_CACHE_BYTES = 2 << 30  # released cache tensors kept for reuse, at most this many bytes in all
# The KV cache's element types, by name (``--kv-dtype``; "auto": ``kv_cache_dtype``).
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def kv_cache_dtype(kv_dtype: str | torch.dtype | None, weights: torch.dtype) -> torch.dtype:
    """The KV cache's element type for ``kv_dtype`` ("fp32", "bf16", "fp16", a torch dtype, or "auto"/None) with
    weights of type ``weights``. "auto" follows the weights, as a checkpoint run in its own dtype would keep its
    cache: 16 bits for 16-bit weights (bf16 for bf16 and int8 weights, fp16 for fp16), fp32 for fp32 weights."""
    if kv_dtype is None or kv_dtype == "auto":
        return {torch.float32: torch.float32, torch.float16: torch.float16}.get(weights, torch.bfloat16)
    if isinstance(kv_dtype, torch.dtype):
        if kv_dtype in KV_DTYPES.values():
            return kv_dtype
    elif isinstance(kv_dtype, str):
        name = KV_DTYPE_NAMES.get(kv_dtype, kv_dtype)
        if name in KV_DTYPES:
            return KV_DTYPES[name]
    raise ModelLoadError(f"kv_dtype must be auto, {', '.join(KV_DTYPES)}, got {kv_dtype!r}")


def kv_dtype_of(runner: object) -> str | None:
    """A loaded runner's KV cache element type, for reports ("fp32", "bf16", "fp16"), or None where the runner does
    not say (the transformers runtime keeps its cache in the model's dtype)."""
    dt = getattr(runner, "cache_dtype", None)
    return None if dt is None else _kv_name(dt)


def _kv_name(dtype: torch.dtype) -> str:
    """A cache element type's short name ("bf16"), or torch's for any other type."""
    name = str(dtype).removeprefix("torch.")
    return KV_DTYPE_NAMES.get(name, name)


class NativeCache(KVCache):
    """Keys and values of one sequence: ``kv[layer, 0=key/1=value, kv_head, position, :]``. (The CPU kernel reads
    and writes the same tensor with its keys in blocks of 16 positions, each block's keys transposed: see
    ``kernels/llama_cpu.cpp``, Attention. A cache belongs to one runner; only that runner reads it.)

    The operator path's per-layer views (keys transposed for the score product) are made once, at its first step,
    not per step; the CPU kernel reads the tensor by address and never needs them (a server makes two caches per
    request: a dozen views each cost more than the rest of a request's admission).
    """

    def __init__(self, kv: torch.Tensor) -> None:
        # [layers, 2, kv_heads, cache_positions, head_dim]; positions at or beyond ``length`` are never read
        self.kv = kv
        self.kv_at = kv.data_ptr()  # the kernel's calls take it by address (``data_ptr`` costs ~1.5 µs after a pass)
        self._length = 0

    @functools.cached_property
    def layer_kv(self) -> list[torch.Tensor]:
        return list(self.kv.unbind(0))  # [2, KV, C, hd] each

    @functools.cached_property
    def keys_t(self) -> list[torch.Tensor]:
        return [lkv[0].transpose(1, 2) for lkv in self.layer_kv]  # [KV, hd, C]

    @functools.cached_property
    def values(self) -> list[torch.Tensor]:
        return [lkv[1] for lkv in self.layer_kv]  # [KV, C, hd]

    @property
    def length(self) -> int:
        return self._length

    def crop(self, length: int) -> None:
        self.check_crop(length)
        self._length = length


def _kernel_rows(t: torch.Tensor) -> bool:
    """Whether the kernel's sampling calls can read ``t`` as it is: a contiguous 2-D fp32 CPU tensor (a pass's
    logits, a draft's distributions)."""
    return t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


class NativeRunner(ModelRunner):
    """A Llama-family checkpoint on ``device`` in ``dtype``; batch size 1 per cache.

    ``compute_dtype`` is the dtype of activations: ``dtype``, except for bf16/fp16 on CPUs without native bf16
    products, where weights are fp16 (fbgemm) and activations fp32, and on the CPU kernel (fp32). ``cache_dtype`` is
    the KV cache's: ``compute_dtype`` on the operator path; on the CPU kernel the ``kv_dtype`` it was loaded with.
    """

    def __init__(
        self,
        cfg: NativeConfig,
        weights: ModelWeights,
        *,
        name: str,
        device: torch.device,
        dtype: torch.dtype,
        ops: Ops,
        max_context: int,
        eos_token_ids: frozenset[int] = frozenset(),
        compile: bool = False,
        fused: FusedLlama | None = None,
        window_cap: int | None = None,
    ) -> None:
        self.config = cfg
        self.window_cap = window_cap  # the attention window imposed at load (``window``); None: the model's own
        self.name = name
        self.vocab_size = int(weights.lm_head.shape[0])
        self.max_context = max_context
        self.device = device
        self.dtype = dtype
        self.compute_dtype = torch.float32 if ops.compute_fp32 or fused is not None else dtype
        self.cache_dtype = self.compute_dtype if fused is None else fused.kv_dtype
        self.eos_token_ids = eos_token_ids
        self._embed = weights.embed  # [V, 2d]
        self._ops = ops
        self.compile = compile
        self._fused = fused
        # What runs the forward: the one-call CPU kernel, or PyTorch operators (which flavour of products).
        self.backend = "cpu-kernel" if fused is not None else f"torch-{ops.__name__}"
        self._compiled: dict[int, Callable[..., torch.Tensor]] = {}
        self.batches = fused is not None  # the CPU kernel runs rows of many sequences in one pass
        # bf16 weights on the AMX build multiply on the tile unit in row groups of up to 16: a pass of 17 rows runs two
        # groups (docs/policy.md, "Row groups in the price of a pass").
        self.row_granule = AMX_ROWS if fused is not None and dtype == torch.bfloat16 and kernel_isa() == "amx" else 0
        self._spare: list[torch.Tensor] = []  # released cache tensors, reused by new_cache (slots)
        # Positions a cache tensor holds: max_context, rounded up to whole key blocks for the CPU kernel.
        self.cache_positions = max_context if fused is None else fused.positions
        # A restricted head (head_tokens): the kernel's logits have one column per kept token, widened here.
        self.head_tokens = None if fused is None or fused.head_ids is None else list(fused.head_ids)
        self._head_index = None if self.head_tokens is None else torch.tensor(self.head_tokens)
        self._pass_logits: weakref.ref[torch.Tensor] | None = None  # the last pass's logits (forward_blocks)
        self._pass_best: list[int] | None = None  # their rows' argmax, where the pass took it (pass_argmax)
        # Whether a pass takes its rows' argmax (the whole head; a kernel of ABI 17 or later: benchmarks/kernel_ab.py
        # runs an older checkout's FusedLlama under this runner)
        self._argmax_in_pass = fused is not None and fused.head_ids is None and getattr(fused, "ARGMAX_IN_PASS", False)
        if fused is not None:
            return  # the kernel holds its own weights and tables
        # Complex RoPE needs complex arithmetic in the compute dtype: fp32/fp64, eager.
        self.complex_rope = self.compute_dtype in (torch.float32, torch.float64) and not compile
        if self.complex_rope:
            self._cis = rope_cis(cfg.rope, cfg.head_dim, max_context).to(device)  # [T, 1, hd/2]
        else:
            cos, sin = rope_tables(cfg.rope, cfg.head_dim, max_context)
            self._cos = cos.to(device=device, dtype=self.compute_dtype)  # [T, 1, hd]
            self._sin = sin.to(device=device, dtype=self.compute_dtype)  # [T, 1, hd], rotate-half sign folded in
        self._bands = {w: self._band(w) for w in set(cfg.windows)}
        self._layer_plan = [(prepare_layer(lw, ops), win) for lw, win in zip(weights.layers, cfg.windows)]
        self._lm_head, self._lm_bias = ops.prepare(weights.lm_head)
        self._norm_shape = (2 * cfg.hidden,)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        compile: bool = False,
        max_context: int | None = None,
        trust_remote_code: bool = False,
        kernel: bool | None = None,
        head_tokens: Sequence[int] | None = None,
        head_required: bool = True,
        window: int | None = None,
        kv_dtype: str | torch.dtype | None = "auto",
    ) -> NativeRunner:
        """Load ``path``. ``max_context`` caps the cache (default: the model's window, at most 8192 positions).

        ``window`` (for draft models: ``specdec.draft_window``): every layer attends to at most the last ``window``
        tokens (a layer's own narrower sliding window is kept). The cache still holds the whole context.

        ``head_tokens`` (CPU kernel only; for draft models): the token ids the output head computes (e.g. the most
        frequent ones: ``specdec.draft_vocab``); every other token's logit is -inf, so it is never proposed, and
        the head costs ``len(head_tokens) / vocab`` of the full one. ``head_required=False``: where the kernel
        cannot run, the full head instead of an error.

        ``kv_dtype``: the KV cache's element type on the CPU kernel (``KV_DTYPES``: "fp32", "bf16", "fp16"; "auto":
        see ``kv_cache_dtype``). The operator path keeps its cache in the compute dtype and refuses another.

        ``kernel``: run the forward through the one-call CPU kernel (``native_kernel``); None (default) uses
        it on CPU whenever it is available and ``compile`` is off, False never, True insists (error if it
        cannot). ``trust_remote_code`` is accepted for parity with the ``transformers`` runtime; no code is
        ever run.
        """
        path = check_checkpoint_dir(path)
        dev = torch.device(device)
        cfg, raw = read_config(path)
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ModelLoadError(f"window must be a positive number of tokens, got {window!r}")
            cfg = dataclasses.replace(cfg, windows=tuple(min(w, window) if w else window for w in cfg.windows))
        limit = min(cfg.max_positions, max_context or DEFAULT_CACHE_LIMIT)
        if limit < 1:
            raise ModelLoadError(f"max_context must be positive, got {max_context}")
        kernel_fits = dev.type == "cpu" and not compile and dtype in WEIGHT_TYPES
        if dtype == torch.int8 and (kernel is False or not (kernel_fits and kernel_available())):
            why = kernel_status() if dev.type == "cpu" and not compile else "it runs on CPU, without --compile"
            raise UnsupportedError(
                f"int8 weights run only on the CPU kernel, which cannot run {path} here ({why}); "
                "use bf16/fp16/fp32 (int8 is meant for draft models: --draft-dtype int8)"
            )
        if kernel and not (kernel_fits and kernel_available()):
            why = kernel_status() if dev.type == "cpu" and not compile else "it runs on CPU, without --compile"
            raise UnsupportedError(f"the CPU kernel cannot run {path}: {why}")
        if kernel is None:
            kernel = kernel_fits and kernel_available()
        if head_tokens is not None and not kernel and not head_required:
            head_tokens = None
        if head_tokens is not None and not kernel:
            why = kernel_status() if dev.type == "cpu" and not compile else "it runs on CPU, without --compile"
            raise UnsupportedError(f"a restricted output head runs only on the CPU kernel, not here ({why})")
        fused = None
        ops: Ops = DenseOps
        if kernel:
            # int8: loaded in fp32, quantized per output channel by FusedLlama.
            weights = load_weights(path, cfg, dev, torch.float32 if dtype == torch.int8 else dtype)
            head = None if head_tokens is None else sorted(set(int(t) for t in head_tokens))
            if head is not None and (not head or head[0] < 0 or head[-1] >= int(weights.lm_head.shape[0])):
                raise ModelLoadError(
                    f"head_tokens must be token ids of {path} (0..{int(weights.lm_head.shape[0]) - 1}), "
                    f"got {len(head)} ids in {head[:1]}..{head[-1:]}"
                )
            fused = FusedLlama(cfg, weights, dtype, limit, head, kv_cache_dtype(kv_dtype, dtype))
        else:
            ops = choose_ops(dev, dtype, compile)
            interleave = (torch.float32 if ops.compute_fp32 else dtype) in (
                torch.float32,
                torch.float64,
            ) and not compile
            load_dtype = torch.float32 if ops is HalfOps else dtype
            weights = load_weights(path, cfg, dev, load_dtype, interleave_rope=interleave, embed_dtype=dtype)
            matrices = [weights.lm_head, *(w for lw in weights.layers for w in lw.matrices())]
            if ops is HalfOps and not half_fits(matrices):
                ops = DenseOps  # a weight beyond fp16's range: plain products in ``dtype`` instead
                weights = load_weights(path, cfg, dev, dtype)
        runner = cls(
            cfg,
            weights,
            name=str(path),
            device=dev,
            dtype=dtype,
            ops=ops,
            max_context=limit,
            eos_token_ids=_eos_ids(path, raw),
            compile=compile,
            fused=fused,
            window_cap=window,
        )
        if fused is None and kv_dtype not in (None, "auto"):
            wanted = kv_cache_dtype(kv_dtype, dtype)  # a bad name is refused here too
            if wanted != runner.cache_dtype:
                raise UnsupportedError(
                    f"kv_dtype {_kv_name(wanted)} runs only on the CPU kernel; "
                    f"{path} runs on {runner.backend}, whose cache is {_kv_name(runner.cache_dtype)}"
                )
        return runner

    def new_cache(self) -> NativeCache:
        """A cache slot: a released one when there is one (its memory already mapped), else a new tensor."""
        if self._spare:
            return NativeCache(self._spare.pop())
        cfg = self.config
        shape = (cfg.layers, 2, cfg.kv_heads, self.cache_positions, cfg.head_dim)
        # empty, not zeros: positions at or beyond a cache's length are never read.
        return NativeCache(torch.empty(shape, device=self.device, dtype=self.cache_dtype))

    def enable_prefix_cache(self, capacity_bytes: int) -> None:
        """Keep finished sequences' keys and values by token prefix, up to ``capacity_bytes``
        (``runtime.prefix_cache``): exact on the CPU kernel only, where a row's keys and values never depend on the
        rows beside it in a pass; elsewhere a ``ValueError`` saying so."""
        if self._fused is None:
            raise ValueError(
                f"prefix caching needs the CPU kernel ({self.name} runs on {self.backend}, whose products may round a "
                "row differently with the rows beside it)"
            )
        self.prefix_cache = PrefixCache(capacity_bytes)

    @torch.inference_mode()
    def reuse_prefix(self, cache: KVCache, tokens: Sequence[int]) -> int:
        if self.prefix_cache is None:
            return cache.length
        if not isinstance(cache, NativeCache):
            raise ValueError("reuse_prefix needs a cache from this runner's new_cache()")
        have = min(cache.length, len(tokens))
        n = self.prefix_cache.restore(cache.kv, tokens, have)
        if n > cache.length:
            cache._length = n
        return cache.length

    @torch.inference_mode()
    def keep_prefix(self, cache: KVCache, tokens: Sequence[int]) -> None:
        if self.prefix_cache is not None and tokens and isinstance(cache, NativeCache):
            self.prefix_cache.store(cache.kv, tokens[: cache.length])

    def release(self, cache: KVCache, tokens: Sequence[int] = ()) -> None:
        self.keep_prefix(cache, tokens)
        kept = sum(t.numel() * t.element_size() for t in self._spare)
        if isinstance(cache, NativeCache) and kept + cache.kv.numel() * cache.kv.element_size() <= SPARE_CACHE_BYTES:
            cache.crop(0)
            self._spare.append(cache.kv)

    @torch.inference_mode()
    def fork_cache(self, cache: KVCache, tokens: Sequence[int]) -> NativeCache:
        """A new slot holding a copy of ``cache``'s filled positions (those beyond its length are never read)."""
        if not isinstance(cache, NativeCache):
            raise TypeError(f"NativeRunner needs a cache from its own new_cache(), got {type(cache).__name__}")
        if len(tokens) != cache.length:
            raise ValueError(f"fork_cache: {len(tokens)} tokens given for a cache holding {cache.length}")
        new = self.new_cache()
        n = cache.length
        if n:
            # The CPU kernel's keys come in blocks of positions (a block's slice of the tensor holds its keys
            # transposed): copy whole blocks. Positions beyond n are copied too and never read.
            block = 1 if self._fused is None else self._fused.key_block
            m = min(self.cache_positions, -(-n // block) * block)
            new.kv.narrow(3, 0, m).copy_(cache.kv.narrow(3, 0, m))
        new._length = n
        return new

    @torch.inference_mode()
    def forward_batch(
        self,
        blocks: Sequence[tuple[torch.Tensor, KVCache]],
        last_only: bool = False,
        keep: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        if self._fused is None or (len(blocks) == 1 and keep is None):
            return [self.forward(ids, cache, last_only) for ids, cache in blocks]
        if keep is not None and len(keep) != len(blocks):
            raise ValueError(f"forward_batch: {len(keep)} keep counts for {len(blocks)} blocks")
        lists = [(check_batch_one(ids).tolist(), cache) for ids, cache in blocks]
        sizes = list(keep) if keep is not None else [1 if last_only else len(ids) for ids, _ in lists]
        logits = self.forward_blocks(lists, sizes)
        out, first = [], 0
        for (ids, _), size in zip(lists, sizes):
            size = min(size, len(ids))
            out.append(logits[first : first + size])
            first += size
        return out

    def forward_blocks(
        self, blocks: Sequence[tuple[Sequence[int], KVCache]], keep: Sequence[int], argmax_only: bool = False
    ) -> torch.Tensor:
        if self._fused is None:
            with torch.inference_mode():
                return super().forward_blocks(blocks, keep)
        if len(keep) != len(blocks):
            raise ValueError(f"forward_blocks: {len(keep)} keep counts for {len(blocks)} blocks")
        # Row indices as Python lists, one tensor in the kernel's call: per-block tensors cost ~1.5 µs each.
        ids_l: list[int] = []
        pos_l: list[int] = []
        kv_l: list[int] = []
        out_l: list[int] = []
        row, limit = 0, self.max_context
        for (ids, cache), size in zip(blocks, keep):
            if not isinstance(cache, NativeCache):
                raise TypeError(f"NativeRunner needs caches from its own new_cache(), got {type(cache).__name__}")
            k, pos = len(ids), cache._length
            if k == 0:
                raise ValueError("forward_batch needs at least one token per block")
            if pos + k > limit:
                raise ContextLengthError(
                    f"{self.name}: {pos + k} tokens do not fit the context window of {limit}", "max_tokens"
                )
            end = row + k
            ids_l += ids
            pos_l += range(pos, pos + k)
            kv_l += [cache.kv_at] * k
            out_l += range(end - (size if size < k else k), end)
            row = end
        # With the whole head, each asked row's argmax comes out of the pass (taken as the head's product finishes each
        # group of outputs, in the computing core's cache): greedy verification reads it (pass_argmax) where a call of
        # its own read the pass's logits again (a 48-row pass: 25 µs in the pass against 75-135 for the call).
        # Where the caller wants only the argmax, the kernel takes it from its int8 copy of the head (the same answer from
        # half the head's bytes; FusedLlama.prunes_head) and returns no logits.
        best: list[int] | None = None
        if self._argmax_in_pass:
            best = []
            if argmax_only and getattr(self._fused, "prunes_head", False):
                logits = self._fused.forward_rows(ids_l, pos_l, kv_l, out_l, best=best, logits=False)
            else:
                logits = self._fused.forward_rows(ids_l, pos_l, kv_l, out_l, best=best)
        else:
            logits = self._widen(self._fused.forward_rows(ids_l, pos_l, kv_l, out_l))
        for ids, cache in blocks:
            cache._length += len(ids)  # type: ignore[attr-defined]
        self._pass_logits = weakref.ref(logits)  # argmax_rows knows it suits the kernel
        self._pass_best = best  # pass_argmax returns it for these logits
        return logits

    def argmax_rows(self, logits: torch.Tensor) -> list[int]:
        if self._fused is None:
            return super().argmax_rows(logits)
        # The kernel's: the same first index of the maximum, ~10x faster than torch's. A pass's own logits skip the
        # checks of a tensor from elsewhere.
        if self._pass_logits is not None and self._pass_logits() is logits:
            return kernel_argmax_rows(self._fused._lib, logits)
        return argmax_rows(logits)

    def pass_argmax(self, logits: torch.Tensor) -> list[int]:
        # The argmax the pass took (forward_blocks with the whole head), for its logits as the caller promises them
        # unchanged since; a row with a NaN gets torch's answer. Anything else: argmax_rows.
        if self._pass_best is not None and self._pass_logits is not None and self._pass_logits() is logits:
            return nan_rows_by_torch(self._pass_best, logits)
        return self.argmax_rows(logits)

    def sample_plain(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        params: Sequence[Any],
        uniforms: Sequence[float],
    ) -> list[int]:
        # With the kernel, a temperature-only request's token comes from its logits in one call (``sd_sample_rows``:
        # softmax(x / T), its inverse distribution function in float64, ~1 ms less a 16-row pass than torch's ops on
        # the caches a pass has just flushed); top-k, top-p and min-p requests draw as every runtime does.
        if self._fused is None or not _kernel_rows(logits):
            return super().sample_plain(logits, rows, params, uniforms)
        native = [i for i, p in enumerate(params) if p.temperature_only]
        out = [0] * len(rows)
        if len(native) < len(rows):
            rest = [i for i, p in enumerate(params) if not p.temperature_only]
            drawn = super().sample_plain(
                logits, [rows[i] for i in rest], [params[i] for i in rest], [uniforms[i] for i in rest]
            )
            for i, token in zip(rest, drawn):
                out[i] = token
        if native:
            temps = [params[i].temperature for i in native]
            us = [uniforms[i] for i in native]
            for i, token in zip(
                native, kernel_sample_rows(self._fused._lib, logits, [rows[i] for i in native], temps, us)
            ):
                out[i] = token
        return out

    def draw_rows(
        self, rows: Sequence[torch.Tensor], params: Sequence[Any], generators: Sequence[torch.Generator]
    ) -> tuple[list[int], list[float], list[float], torch.Tensor]:
        # With the kernel, a temperature-only request's row is drawn and its distribution written in one call
        # (``sd_sample_rows``), where torch's softmax, draw, gather and maximum each cost tens of µs on the caches a
        # pass has just flushed; the others as every runtime draws them.
        native = [i for i, p in enumerate(params) if p.temperature_only]
        if self._fused is None or not native or any(r.dtype != torch.float32 or r.device.type != "cpu" for r in rows):
            return super().draw_rows(rows, params, generators)
        n, vocab = len(rows), rows[0].shape[-1]
        q = torch.empty(n, vocab, dtype=torch.float32)
        tokens, ps, tops = [0] * n, [0.0] * n, [0.0] * n
        rest = [i for i, p in enumerate(params) if not p.temperature_only]
        if rest:
            t, p, top, qr = super().draw_rows(
                [rows[i] for i in rest], [params[i] for i in rest], [generators[i] for i in rest]
            )
            q[rest] = qr
            for k, i in enumerate(rest):
                tokens[i], ps[i], tops[i] = t[k], p[k], top[k]
        us = [torch.rand(1, dtype=torch.float64, generator=generators[i]).item() for i in native]
        block = torch.cat([rows[i] for i in native]).contiguous()
        out = q if len(native) == n else torch.empty(len(native), vocab, dtype=torch.float32)
        t, p, top = kernel_sample_with_probs(
            self._fused._lib, block, range(len(native)), [params[i].temperature for i in native], us, out
        )
        if out is not q:
            q[native] = out
        for k, i in enumerate(native):
            tokens[i], ps[i], tops[i] = t[k], p[k], top[k]
        return tokens, ps, tops, q

    def sampled_verdict(
        self,
        logits: torch.Tensor,
        row0: int,
        params: Any,
        tokens: Sequence[int],
        draft_probs: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[list[bool], int, int, list[float]] | None:
        # A temperature-only request's block in one kernel call (``sd_verify_sampled``): p at each row as
        # ``sd_sample_rows`` takes it, the residual only at the rejection; the same draws from its generator as
        # ``verify_blocks`` makes (τ uniforms in (0, 1], then one in [0, 1)).
        if self._fused is None or not params.temperature_only or not _kernel_rows(logits):
            return None
        q = draft_probs.contiguous()  # (a copy only where it is a view: the same rule either way)
        if not _kernel_rows(q) or q.shape != (len(tokens), logits.shape[1]):
            return None
        rs = (1.0 - torch.rand(len(tokens), generator=generator)).tolist()
        u = torch.rand(1, dtype=torch.float64, generator=generator).item()
        return kernel_verify_sampled(self._fused._lib, logits, row0, params.temperature, tokens, q, rs, u)

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The kernel's logits over the whole vocabulary: -inf for the tokens a restricted head leaves out."""
        if self._head_index is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self._head_index] = logits
        return full

    @property
    def drafts_natively(self) -> bool:  # type: ignore[override]
        """Whether ``draft_greedy`` runs (the CPU kernel drafts a whole greedy lockstep draft in one call)."""
        return self._fused is not None

    def draft_greedy(  # the kernel records no autograd: no inference_mode around it
        self,
        blocks: Sequence[tuple[list[int], KVCache]],
        taus: Sequence[int],
        rules: Sequence[RuleNumbers | None],
        vocab_used: int,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy drafts of several sequences in one kernel call (``FusedLlama.draft_greedy``): each block's
        pending tokens are fed, then up to its τ argmax tokens drafted in lockstep, each cache left holding every
        token fed (pending and drafted but the last, as the drafting loop leaves it). A block of more pending
        tokens than one chunk is first caught up by an ordinary pass."""
        tokens, tops, _, _ = self.draft_rows(blocks, taus, rules, vocab_used)
        return tokens, tops

    def draft_rows(
        self,
        blocks: Sequence[tuple[list[int], KVCache]],
        taus: Sequence[int],
        rules: Sequence[RuleNumbers | None],
        vocab_used: int,
        temps: Sequence[float] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[torch.Tensor | None]]:
        """``draft_greedy`` where some sequences sample: a sequence with ``temps[s] > 0`` (a temperature-only
        request) draws each drafted token from softmax(logits / t) in the kernel, at uniforms drawn up front from its
        generator (τ of them, ``torch.rand``: unused ones where its draft stops early). Returns each sequence's tokens,
        top probabilities, each token's probability (a greedy token's: its top probability) and, for a sampled
        sequence, the distributions drawn from over the first ``vocab_used`` tokens (``[tokens, vocab_used]``; None
        for a greedy one)."""
        if self._fused is None:
            raise RuntimeError("draft_greedy needs the CPU kernel")
        pending: list[list[int]] = []
        caches: list[NativeCache] = []
        total, limit = 0, self.max_context
        for (ids, c), tau in zip(blocks, taus):
            if not isinstance(c, NativeCache):
                raise TypeError(f"NativeRunner needs caches from its own new_cache(), got {type(c).__name__}")
            p = list(ids)
            if not p:
                raise ValueError("draft_greedy needs at least one pending token per sequence")
            # (what a long catch-up below moves into the cache leaves this sum as it is)
            if c._length + len(p) + tau - 1 > limit:
                raise ContextLengthError(
                    f"{self.name}: {c._length + len(p) + tau - 1} tokens do not fit the context window of {limit}",
                    "max_tokens",
                )
            pending.append(p)
            caches.append(c)
            total += len(p)
        if total > CHUNK:  # a long catch-up (after a rollback to 0): all but the last now
            long = [i for i, p in enumerate(pending) if len(p) > 1]
            self.forward_batch([(token_tensor(pending[i][:-1]), caches[i]) for i in long], last_only=True)
            for i in long:
                pending[i] = pending[i][-1:]
        native = [None if r is None else DraftRuleC.make(r.reach_table, r.min_reach, r.min_top) for r in rules]
        tokens_used = vocab_used
        if self.head_tokens is not None:  # the argmax runs over the head's rows: those of tokens below vocab_used
            vocab_used = bisect.bisect_left(self.head_tokens, vocab_used)
        uniforms = None
        if temps is not None and any(t > 0 for t in temps):
            assert generators is not None
            uniforms = [
                torch.rand(tau, dtype=torch.float64, generator=g).tolist() if t > 0 and g is not None else []
                for t, tau, g in zip(temps, taus, generators)
            ]
        tokens, tops, fed, picked = self._fused.draft_greedy(
            pending,
            [c._length for c in caches],
            [c.kv_at for c in caches],
            list(taus),
            native,
            vocab_used,
            None if uniforms is None else list(temps or ()),
            uniforms,
        )
        for c, n in zip(caches, fed):
            c._length += n  # type: ignore[attr-defined]
        if picked is None:
            return tokens, tops, tops, [None] * len(tokens)
        q, flat = picked
        max_tau = q.shape[1]
        probs: list[list[float]] = []
        dists: list[torch.Tensor | None] = []
        for s, toks in enumerate(tokens):
            probs.append(flat[s * max_tau : s * max_tau + len(toks)])
            if temps is None or temps[s] <= 0:
                dists.append(None)
                continue
            rows = q[s, : len(toks)]
            if self._head_index is None:  # the whole head: its rows are the tokens (zeros past vocab_used)
                dists.append(rows[:, :tokens_used])
                continue
            full = rows.new_zeros(
                len(toks), tokens_used
            )  # the head's rows -> their tokens (zeros for tokens it leaves out)
            full[:, self._head_index[:vocab_used]] = rows[:, :vocab_used]
            dists.append(full)
        return tokens, tops, probs, dists

    def forward(self, ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        if self._fused is None:
            return self._forward_ops(ids, cache, last_only)
        return self._forward(ids, cache, last_only)  # the CPU kernel records no autograd: no inference_mode (~10 µs)

    @torch.inference_mode()
    def _forward_ops(self, ids: torch.Tensor, cache: KVCache, last_only: bool) -> torch.Tensor:
        return self._forward(ids, cache, last_only)

    def _forward(self, ids: torch.Tensor, cache: KVCache, last_only: bool) -> torch.Tensor:
        if not isinstance(cache, NativeCache):
            raise TypeError(f"NativeRunner needs a cache from its own new_cache(), got {type(cache).__name__}")
        ids = check_batch_one(ids)
        if ids.device != self.device:
            ids = ids.to(self.device)
        k = int(ids.shape[0])
        pos = cache.length
        if k == 0:
            raise ValueError("forward needs at least one token")
        if pos + k > self.max_context:
            raise ContextLengthError(
                f"{self.name}: {pos + k} tokens do not fit the context window of {self.max_context}", "max_tokens"
            )
        if self._fused is not None:
            logits = self._widen(self._fused.forward(ids, cache.kv, pos, last_only))
        elif self.compile and k <= BAND_ROWS:  # decode and verify blocks; a prompt's prefill (any length) stays eager
            logits = self._step_fn(k)(ids, cache.kv, pos, last_only)
        else:
            logits = self._eager_step(ids, cache, pos, last_only)
        cache._length = pos + k
        return logits

    def _step_fn(self, k: int) -> Callable[..., torch.Tensor]:
        """A compiled step per block size (shapes static in k; the cache position is dynamic)."""
        fn = self._compiled.get(k)
        if fn is None:
            import torch._dynamo

            # Each block size is its own graph; the default limit (8) would fall back to eager after a few.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            fn = self._compiled[k] = torch.compile(self.step, mode=COMPILE_MODE, fullgraph=True)
        return fn

    def step(self, ids: torch.Tensor, kv: torch.Tensor, pos: int, last_only: bool) -> torch.Tensor:
        """The whole forward over ``ids`` ``[k]`` at positions ``pos..pos+k-1``; writes ``kv``; float32 logits.

        The traceable form (``torch.compile``): the per-layer cache views are derived from ``kv`` here.
        """
        layer_kv = list(kv.unbind(0))
        return self._run(
            ids, layer_kv, [lkv[0].transpose(1, 2) for lkv in layer_kv], [lkv[1] for lkv in layer_kv], pos, last_only
        )

    def _eager_step(self, ids: torch.Tensor, cache: NativeCache, pos: int, last_only: bool) -> torch.Tensor:
        return self._run(ids, cache.layer_kv, cache.keys_t, cache.values, pos, last_only)

    def _run(
        self,
        ids: torch.Tensor,
        layer_kv: list[torch.Tensor],
        keys_t: list[torch.Tensor],
        values: list[torch.Tensor],
        pos: int,
        last_only: bool,
    ) -> torch.Tensor:
        cfg, ops = self.config, self._ops
        k = ids.shape[0]
        end = pos + k
        d, hd, heads, kv_heads, groups = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.groups
        rot = heads + kv_heads  # heads that get RoPE: queries, then keys
        x2 = F.embedding(ids, self._embed)  # [k, 2d] = [x, -x]
        if x2.dtype != self.compute_dtype:
            x2 = x2.to(self.compute_dtype)
        x, x_neg = x2[:, :d], x2[:, d:]  # views: the residual stream is updated in place
        if self.complex_rope:
            cis = self._cis[pos:end]  # [k, 1, hd/2]
        else:
            cos, sin = self._cos[pos:end], self._sin[pos:end]  # [k, 1, hd]
        spans = {win: self._span(win, pos, k) for win in self._bands}
        norm_shape, eps = self._norm_shape, cfg.eps
        for i, (lw, win) in enumerate(self._layer_plan):
            start, mask = spans[win]
            # LayerNorm of [x, -x] is RMSNorm of x (the mean is 0); its weight is folded into the projection.
            h = torch.layer_norm(x2, norm_shape, None, None, eps)[:, :d]
            qkv = ops.linear(h, lw.wqkv, lw.bqkv).view(k, heads + 2 * kv_heads, hd)  # [k, H+2KV, hd]
            if self.complex_rope:  # RoPE on queries and keys: one in-place complex multiply
                torch.view_as_complex(qkv.view(k, -1, hd // 2, 2))[:, :rot].mul_(cis)
            else:
                _rope_real(qkv[:, :rot], cos, sin, hd)
            # Write this block's keys and values at their positions.
            layer_kv[i].narrow(2, pos, k).copy_(qkv[:, rot - kv_heads :].view(k, 2, kv_heads, hd).permute(1, 2, 0, 3))
            keys = keys_t[i].narrow(2, start, end - start)  # [KV, hd, T']
            vals = values[i].narrow(1, start, end - start)  # [KV, T', hd]
            if k == 1:  # queries of one token: [KV, G, hd] is a view
                q = qkv[0, :heads].view(kv_heads, groups, hd)
            else:  # fold the query groups of each key/value head into rows (order: token, group): [KV, k·G, hd]
                q = qkv[:, :heads].reshape(k, kv_heads, groups, hd).transpose(0, 1).reshape(kv_heads, k * groups, hd)
            scores = torch.bmm(q, keys) if mask is None else torch.baddbmm(mask, q, keys)  # [KV, k·G, T']
            out = torch.bmm(torch.softmax(scores, dim=-1), vals)  # [KV, k·G, hd]
            if k == 1:
                out = out.view(1, heads * hd)
            else:
                out = out.view(kv_heads, k, groups, hd).transpose(0, 1).reshape(k, heads * hd)
            ops.add_linear_(x, out, lw.wo, lw.bo)
            _negate_into(x, x_neg)
            h = torch.layer_norm(x2, norm_shape, None, None, eps)[:, :d]
            ops.add_linear_(x, ops.swiglu(h, lw), lw.wd, lw.bd)
            _negate_into(x, x_neg)
        if last_only:
            x2 = x2[-1:]
        h = torch.layer_norm(x2, norm_shape, None, None, eps)[:, :d]
        return ops.linear(h, self._lm_head, self._lm_bias).float()  # [k, V]

    def _span(self, window: int | None, pos: int, k: int) -> tuple[int, torch.Tensor | None]:
        """First cache position any of the k queries can see, and the additive mask over ``start..pos+k``.

        A single token sees every position in its span, so it needs no mask at all.
        """
        start = 0 if window is None else max(0, pos - window + 1)
        if k == 1:
            return start, None
        if k <= BAND_ROWS:
            # band[i·G+g, c] is 0 where c - C ∈ (i - window, i]: query i at position pos+i sees key j
            # iff column j + C - pos is open, so the mask is a slice, not a computation.
            c = self.max_context
            return start, self._bands[window][: k * self.config.groups, c - pos + start : c + k]
        return start, self._mask(window, torch.arange(pos, pos + k, device=self.device), start, pos + k)

    def _band(self, window: int | None) -> torch.Tensor:
        rows = torch.arange(BAND_ROWS, device=self.device) + self.max_context
        return self._mask(window, rows, 0, self.max_context + BAND_ROWS)

    def _mask(self, window: int | None, query_pos: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Additive mask ``[len(query_pos)·G, end-start]`` (rows: token, then group) for causal/sliding attention."""
        keys = torch.arange(start, end, device=self.device)[None, :]
        seen = keys <= query_pos[:, None]
        if window is not None:
            seen &= keys > query_pos[:, None] - window
        mask = torch.zeros(seen.shape, device=self.device, dtype=self.compute_dtype)
        return mask.masked_fill_(~seen, float("-inf")).repeat_interleave(self.config.groups, dim=0)


def _negate_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = -x`` in one op; the compiler refuses ``out=`` into a strided view, so it gets a copy (that it fuses)."""
    if torch.compiler.is_compiling():
        out.copy_(x.neg())
    else:
        torch.neg(x, out=out)


def _rope_real(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hd: int) -> None:
    """RoPE in place as ``x·cos + roll(x, hd/2)·sin`` (rotate-half layout; bf16/fp16 and compiled steps)."""
    if torch.compiler.is_compiling():  # the compiler refuses out= into a strided view, and fuses this anyway
        qk.copy_(torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin))
    else:
        torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin, out=qk)


def native_unsupported_reason(path: str | Path) -> str | None:
    """Why the native runtime cannot run this checkpoint (an unsupported feature), or None if it can."""
    try:
        read_config(Path(path))
    except UnsupportedError as e:
        return str(e)
    return None


def _eos_ids(path: Path, raw: dict[str, Any]) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json."""
    import json

    gen = path / "generation_config.json"
    try:
        generation = json.loads(gen.read_text()) if gen.exists() else None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {gen}: {e}") from e
    return eos_ids_of(raw, generation)
