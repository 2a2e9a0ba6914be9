"""Native runtime: Llama, Qwen2 and Mistral in plain PyTorch, tuned for the per-operation cost of small models.

Loads the same Hugging Face checkpoint directories as the ``transformers`` runtime (config.json +
safetensors) without its model classes. What keeps a decode step cheap (see docs/runtime.md):

- one preallocated KV cache tensor per request ``[layers, 2, kv_heads, max_context, head_dim]``,
  written by position, so rolling back rejected drafts is moving an integer;
- fused q/k/v and gate/up projections (oneDNN-packed with fused SiLU·up in bf16 on CPU), residual
  adds fused into in-place ``addmm``, RMSNorm as one LayerNorm kernel over [x, -x], norm weights and
  the attention scale folded into the projections at load;
- RoPE from precomputed cos/sin tables as ``x·cos + roll(x)·sin`` written in place;
- grouped-query attention with the query groups folded into the rows of one ``bmm`` (no repeated
  keys), and causal/sliding-window masks sliced from a precomputed band instead of built per step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.errors import ContextLengthError, ModelLoadError, UnsupportedError
from specdec.runtime.base import KVCache, ModelRunner, check_batch_one
from specdec.runtime.hf import check_checkpoint_dir
from specdec.runtime.native_config import DEFAULT_CACHE_LIMIT, FAMILIES, NativeConfig, read_config, rope_tables
from specdec.runtime.native_ops import PreparedLayer, choose_ops, prepare_layer
from specdec.runtime.native_weights import ModelWeights, load_weights

SUPPORTED_MODEL_TYPES = set(FAMILIES)
# Blocks up to this many tokens take their mask from the precomputed band; longer ones (prefill) build one.
BAND_ROWS = 16
COMPILE_MODE = "max-autotune-no-cudagraphs"


class NativeCache(KVCache):
    """Keys and values of one sequence: ``kv[layer, 0=key/1=value, kv_head, position, :]``."""

    def __init__(self, cfg: NativeConfig, max_context: int, device: torch.device, dtype: torch.dtype) -> None:
        # empty, not zeros: positions at or beyond ``length`` are never read.
        self.kv = torch.empty(cfg.layers, 2, cfg.kv_heads, max_context, cfg.head_dim, device=device, dtype=dtype)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} tokens to {length}")
        self._length = length


class NativeRunner(ModelRunner):
    """A Llama-family checkpoint on ``device`` in ``dtype``; batch size 1 per cache."""

    def __init__(
        self,
        cfg: NativeConfig,
        weights: ModelWeights,
        *,
        name: str,
        device: torch.device,
        dtype: torch.dtype,
        max_context: int,
        eos_token_ids: frozenset[int] = frozenset(),
        compile: bool = False,
    ) -> None:
        self.config = cfg
        self._embed = weights.embed  # [V, 2d]
        self.name = name
        self.vocab_size = int(weights.lm_head.shape[0])
        self.max_context = max_context
        self.device = device
        self.dtype = dtype
        self.eos_token_ids = eos_token_ids
        cos, sin = rope_tables(cfg.rope, cfg.head_dim, max_context)
        self._cos = cos.to(device=device, dtype=dtype)  # [T, 1, hd]
        self._sin = sin.to(device=device, dtype=dtype)  # [T, 1, hd], sign of rotate-half folded in
        self._bands = {w: self._band(w) for w in set(cfg.windows)}
        self._ops = choose_ops(device, dtype, compile)
        self._layer_plan = [(prepare_layer(lw, self._ops), win) for lw, win in zip(weights.layers, cfg.windows)]
        self._lm_head = self._ops.prepare(weights.lm_head)
        self._norm_shape = (2 * cfg.hidden,)
        self.compile = compile
        self._compiled: dict[int, Callable[..., torch.Tensor]] = {}

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
    ) -> NativeRunner:
        """Load ``path``. ``max_context`` caps the cache (default: the model's window, at most 8192 positions).

        ``trust_remote_code`` is accepted for parity with the ``transformers`` runtime; no code is ever run.
        """
        path = check_checkpoint_dir(path)
        dev = torch.device(device)
        cfg, raw = read_config(path)
        limit = min(cfg.max_positions, max_context or DEFAULT_CACHE_LIMIT)
        if limit < 1:
            raise ModelLoadError(f"max_context must be positive, got {max_context}")
        weights = load_weights(path, cfg, dev, dtype)
        return cls(
            cfg,
            weights,
            name=str(path),
            device=dev,
            dtype=dtype,
            max_context=limit,
            eos_token_ids=_eos_ids(path, raw),
            compile=compile,
        )

    def new_cache(self) -> NativeCache:
        return NativeCache(self.config, self.max_context, self.device, self.dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
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
        step = self._step_fn(k) if self.compile else self.step
        logits = step(ids, cache.kv, pos, last_only)
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
        """The whole forward over ``ids`` ``[k]`` at positions ``pos..pos+k-1``; writes ``kv``; float32 logits."""
        k = ids.shape[0]
        end = pos + k
        d = self.config.hidden
        x2 = F.embedding(ids, self._embed)  # [k, 2d] = [x, -x]
        x, x_neg = x2[:, :d], x2[:, d:]  # views: the residual stream is updated in place
        cos, sin = self._cos[pos:end], self._sin[pos:end]  # [k, 1, hd]
        spans = {win: self._span(win, pos, k) for win in self._bands}
        for i, (layer, win) in enumerate(self._layer_plan):
            start, mask = spans[win]
            self._layer(x2, x, x_neg, layer, kv[i], pos, end, start, mask, cos, sin)
        if last_only:
            x2 = x2[-1:]
        h = F.layer_norm(x2, self._norm_shape, None, None, self.config.eps)[:, :d]
        return self._ops.linear(h, self._lm_head).float()  # [k, V]

    def _layer(
        self,
        x2: torch.Tensor,
        x: torch.Tensor,
        x_neg: torch.Tensor,
        lw: PreparedLayer,
        kv: torch.Tensor,
        pos: int,
        end: int,
        start: int,
        mask: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """One decoder layer, updating the residual stream ``x2`` = [x, -x] in place."""
        cfg, ops = self.config, self._ops
        k, d = x.shape
        heads, kv_heads, groups, hd = cfg.heads, cfg.kv_heads, cfg.groups, cfg.head_dim
        # LayerNorm of [x, -x] is RMSNorm of x (the mean is 0); its weight is folded into the projection.
        h = F.layer_norm(x2, self._norm_shape, None, None, cfg.eps)[:, :d]
        qkv = ops.linear(h, lw.wqkv, lw.bqkv).view(k, heads + 2 * kv_heads, hd)  # [k, H+2KV, hd]
        qk = qkv[:, : heads + kv_heads]
        if torch.compiler.is_compiling():  # the compiler refuses out= into a strided view, and fuses this anyway
            qk.copy_(torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin))
        else:  # RoPE on queries and keys, in place
            torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin, out=qk)
        kv[:, :, pos:end] = qkv[:, heads:].view(k, 2, kv_heads, hd).permute(1, 2, 0, 3)
        keys = kv[0, :, start:end].transpose(1, 2)  # [KV, hd, T']
        values = kv[1, :, start:end]  # [KV, T', hd]
        # Fold the query groups of each key/value head into rows (order: token, group): [KV, k·G, hd].
        q = qkv[:, :heads].reshape(k, kv_heads, groups, hd).transpose(0, 1).reshape(kv_heads, k * groups, hd)
        scores = torch.bmm(q, keys) if mask is None else torch.baddbmm(mask, q, keys)  # [KV, k·G, T']
        out = torch.bmm(torch.softmax(scores, dim=-1), values)  # [KV, k·G, hd]
        out = out.view(kv_heads, k, groups, hd).transpose(0, 1).reshape(k, heads * hd)
        if lw.bo is not None:
            x.add_(lw.bo)
        x.addmm_(out, lw.wo_t)
        _negate_into(x, x_neg)
        h = F.layer_norm(x2, self._norm_shape, None, None, cfg.eps)[:, :d]
        act = ops.swiglu(h, lw)  # [k, ff]
        if lw.bd is not None:
            x.add_(lw.bd)
        x.addmm_(act, lw.wd_t)
        _negate_into(x, x_neg)

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
        mask = torch.zeros(seen.shape, device=self.device, dtype=self.dtype).masked_fill_(~seen, float("-inf"))
        return mask.repeat_interleave(self.config.groups, dim=0)


def _negate_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = -x`` in one op; the compiler refuses ``out=`` into a strided view, so it gets a copy (that it fuses)."""
    if torch.compiler.is_compiling():
        out.copy_(x.neg())
    else:
        torch.neg(x, out=out)


def native_unsupported_reason(path: str | Path) -> str | None:
    """Why the native runtime cannot run this checkpoint (an unsupported feature), or None if it can."""
    try:
        read_config(Path(path))
    except UnsupportedError as e:
        return str(e)
    return None


def _eos_ids(path: Path, raw: dict[str, Any]) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json (an int or a list in either)."""
    import json

    ids: set[int] = set()
    sources = [raw]
    gen = path / "generation_config.json"
    if gen.exists():
        try:
            sources.append(json.loads(gen.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {gen}: {e}") from e
    for src in sources:
        value = src.get("eos_token_id")
        ids.update(e for e in (value if isinstance(value, list) else [value]) if isinstance(e, int))
    return frozenset(ids)
