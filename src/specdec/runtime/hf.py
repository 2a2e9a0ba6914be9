"""Runtime over ``transformers``: any ``AutoModelForCausalLM`` checkpoint, with a DynamicCache per request."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ModelLoadError
from specdec.runtime.base import KVCache, ModelRunner, check_batch_one, eos_ids_of


class HFCache(KVCache):
    def __init__(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def crop(self, length: int) -> None:
        self.check_crop(length)
        if length < self._length:
            # transformers >= 5 takes a negative count of tokens to remove.
            self.cache.crop(length - self._length)
            self._length = length

    def advance(self, k: int) -> None:
        self._length += k

    def fork(self) -> HFCache:
        """An independent copy (every layer's key and value tensors cloned)."""
        import copy

        new = HFCache.__new__(HFCache)
        new.cache = copy.deepcopy(self.cache)
        new._length = self._length
        return new


def context_window(config: Any) -> int:
    for attr in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


class HFRunner(ModelRunner):
    """Wraps a loaded ``transformers`` causal LM (from a directory or an existing object)."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        self.model = model.eval()
        self.name = name
        config = model.config  # type: ignore[attr-defined]
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
        self.max_context = context_window(config)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.eos_token_ids = eos_ids_of(config, getattr(model, "generation_config", None))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False,
    ) -> HFRunner:
        from transformers import AutoModelForCausalLM

        path = check_checkpoint_dir(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path),
                dtype=dtype,
                use_safetensors=True,
                trust_remote_code=trust_remote_code,
            )
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"cannot load checkpoint {path}: {first}") from e
        return cls(model.to(device), str(path))

    def new_cache(self) -> HFCache:
        return HFCache()

    def fork_cache(self, cache: KVCache, tokens: Sequence[int]) -> HFCache:
        assert isinstance(cache, HFCache)
        if len(tokens) != cache.length:
            raise ValueError(f"fork_cache: {len(tokens)} tokens given for a cache holding {cache.length}")
        return cache.fork()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        assert isinstance(cache, HFCache)
        ids = check_batch_one(ids).to(self.device)
        k = ids.shape[0]
        start = cache.length
        out = self.model(
            input_ids=ids[None],
            past_key_values=cache.cache,
            use_cache=True,
            position_ids=torch.arange(start, start + k, device=self.device)[None],
            logits_to_keep=1 if last_only else 0,
        )
        cache.advance(k)
        return out.logits[0].float()


def check_checkpoint_dir(path: str | Path) -> Path:
    """A local checkpoint directory with a config.json, or a ModelLoadError naming what is missing."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model directory not found: {p}")
    if not p.is_dir():
        raise ModelLoadError(f"model path is not a directory: {p}")
    if not (p / "config.json").exists():
        raise ModelLoadError(f"not a Hugging Face checkpoint (no config.json): {p}")
    return p
