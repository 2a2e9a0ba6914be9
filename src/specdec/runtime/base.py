"""What the engine needs from a model: a forward over a block of tokens with a KV cache.

A runtime owns the weights; each request owns a ``KVCache`` made by ``new_cache``, so
many requests can be in flight on one model. ``forward`` appends its block to the
cache; ``cache.crop(n)`` rolls back to the first n tokens (rejected drafts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from specdec.runtime.prefix_cache import PrefixCache


class KVCache(ABC):
    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens currently held."""

    @abstractmethod
    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (``0 <= length <= self.length``)."""

    def check_crop(self, length: int) -> None:
        """Refuse a ``crop`` target outside ``0 .. self.length`` (for implementations of ``crop``)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")


class ModelRunner(ABC):
    """A causal LM loaded for inference: one cache per sequence; ``forward_batch`` runs blocks of many."""

    name: str  # checkpoint directory or model id, for messages
    vocab_size: int  # rows of the output distribution
    max_context: int  # tokens the cache can hold (the model's context window)
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int] = frozenset()  # from config.json / generation_config.json
    batches: bool = False  # True where forward_batch runs all its blocks in one pass (else one pass per block)
    # Rows a pass's products take in one group, where a pass of more rows than one group pays for the second about
    # whole (the CPU kernel's AMX build: 16); 0 where its cost grows smoothly with the rows.
    row_granule: int = 0

    @abstractmethod
    def new_cache(self) -> KVCache: ...

    @abstractmethod
    def forward(self, ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Run ``ids`` (int64 ``[k]``) at positions ``cache.length .. cache.length+k-1``.

        Returns float32 logits ``[k, vocab_size]`` (``[1, vocab_size]`` when ``last_only``),
        row i being the distribution of the token after ``ids[i]``; the cache grows by k.
        """

    def forward_batch(
        self,
        blocks: Sequence[tuple[torch.Tensor, KVCache]],
        last_only: bool = False,
        keep: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """Run several sequences' blocks (each ``ids [k_i]`` with its own cache, at that cache's positions);
        returns each block's logits as ``forward`` would: all its rows, its last (``last_only``), or its last
        ``keep[i]`` (a block that also takes in the tokens before the ones that matter: a prompt joining a
        step). A block's logits do not depend on the other blocks. This default runs one pass per block;
        runtimes that batch (``batches``) run one pass in all.
        """
        if keep is None:
            return [self.forward(ids, cache, last_only) for ids, cache in blocks]
        out = []
        for (ids, cache), k in zip(blocks, keep):
            logits = self.forward(ids, cache, last_only=k <= 1)  # one row serves a keep of 0 or 1
            out.append(logits[logits.shape[0] - min(k, logits.shape[0]) :])
        return out

    def forward_blocks(
        self, blocks: Sequence[tuple[Sequence[int], KVCache]], keep: Sequence[int], argmax_only: bool = False
    ) -> torch.Tensor:
        """``forward_batch`` for blocks given as token lists, keeping the last ``keep[i]`` rows of block i: their
        logits as ONE tensor ``[sum of rows kept, vocab]``, block after block (one argmax serves a whole verify
        pass). Runtimes that batch build the pass's rows without a tensor per block.

        ``argmax_only``: the caller reads nothing of the result but ``pass_argmax`` (greedy rows without logit rules
        or log probabilities). A runtime may then skip the logits and return a tensor without columns (the CPU
        kernel's int8 head: the same argmax)."""
        if len(keep) != len(blocks):
            raise ValueError(f"forward_blocks: {len(keep)} keep counts for {len(blocks)} blocks")
        device = self.device
        tensors = [(token_tensor(list(ids), device), cache) for ids, cache in blocks]
        return torch.cat(self.forward_batch(tensors, keep=keep))

    def argmax_rows(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax of ``logits`` (``[rows, vocab]``, from this runner): the first index of the row's
        maximum, ``torch.argmax``'s rule. Runtimes may compute it faster (the CPU kernel does)."""
        return logits.argmax(dim=-1).tolist()

    def pass_argmax(self, logits: torch.Tensor) -> list[int]:
        """``argmax_rows`` of the logits ``forward_blocks`` just returned, not changed since (greedy verification,
        right after its pass). Runtimes may return what the pass computed along the way (the CPU kernel does)."""
        return self.argmax_rows(logits)

    def sample_plain(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        params: Sequence[Any],
        uniforms: Sequence[float],
    ) -> list[int]:
        """One draw for each row ``rows[i]`` of ``logits`` (``[rows, vocab]`` from this runner, as the model gave
        them: a sampled request without logit rules or a draft) from its request's distribution (``params[i]``, a
        ``SamplingParams`` that samples) at its uniform ``uniforms[i]`` in [0, 1): the inverse of the distribution
        function, as ``verify_blocks`` draws (``sample_rows_at`` of ``probs_by_settings``). Runtimes may draw a
        request's token faster by a rule of their own, the same for the request in every step whatever is beside it
        (the CPU kernel draws a temperature-only request's from the logits themselves: ``sd_sample_rows``)."""
        from specdec.sampling import probs_by_settings, sample_rows_at

        probs = probs_by_settings([logits[r : r + 1] for r in rows], params)
        return [int(t) for t in sample_rows_at(probs, uniforms).tolist()]

    def draw_rows(
        self, rows: Sequence[torch.Tensor], params: Sequence[Any], generators: Sequence[torch.Generator]
    ) -> tuple[list[int], list[float], list[float], torch.Tensor]:
        """A sampled draft's picks: one draw from each row (``[1, vocab]`` logits from this runner, fit to the
        vocabulary) under its request's settings (``params[i]``, a sampling ``SamplingParams``) with its generator,
        one uniform each. Returns the tokens, each one's probability, the likeliest token's, and the distributions
        drawn from (float32 ``[len(rows), vocab]``, for the acceptance rule's residuals). Runtimes may draw a
        request's rows by a rule of their own, the same for it whatever is beside it (the CPU kernel draws a
        temperature-only request's with ``sd_sample_rows``)."""
        from specdec.sampling import probs_by_settings, sample_rows

        q = probs_by_settings(list(rows), params)
        ys = sample_rows(q, generators)
        ps = q.gather(1, ys[:, None]).squeeze(1).tolist()
        tops = q.amax(-1).tolist()  # (max(-1) finds the indices too: ~0.1 ms more over 16 x 8,192)
        return [int(y) for y in ys.tolist()], ps, tops, q

    def sampled_verdict(
        self,
        logits: torch.Tensor,
        row0: int,
        params: Any,
        tokens: Sequence[int],
        draft_probs: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[list[bool], int, int, list[float]] | None:
        """A sampled block's verdict by the runtime's own rule (each test's outcome, n̂, the last token, p(ŷ) of each
        draft token) from the target's rows ``row0 .. row0 + τ`` of a pass's ``logits``, drawing what ``verify_blocks``
        draws from ``generator`` (τ acceptance uniforms, then one); None where the runtime has no rule of its own for
        this request (``verify_blocks`` then decides it). The CPU kernel decides a temperature-only request's."""
        return None

    # Whether ``draft_greedy`` runs a whole greedy draft in one call (the native runtime's CPU kernel).
    drafts_natively: bool = False

    def draft_greedy(
        self,
        blocks: Sequence[tuple[list[int], KVCache]],
        taus: Sequence[int],
        rules: Sequence[Any],
        vocab_used: int,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy drafts of several sequences in one call (see ``NativeRunner.draft_greedy``); only runners whose
        ``drafts_natively`` is true have it."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in one call")

    def draft_rows(
        self,
        blocks: Sequence[tuple[list[int], KVCache]],
        taus: Sequence[int],
        rules: Sequence[Any],
        vocab_used: int,
        temps: Sequence[float] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[torch.Tensor | None]]:
        """``draft_greedy`` where temperature-only sequences sample in the same call (see
        ``NativeRunner.draft_rows``); only runners whose ``drafts_natively`` is true have it."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in one call")

    prefix_cache: PrefixCache | None = None  # where the runner keeps prefixes (``reuse_prefix``); None: it does not

    def release(self, cache: KVCache, tokens: Sequence[int] = ()) -> None:  # noqa: B027 - optional hook
        """A finished sequence's cache, which the runner may reuse for the next one. ``tokens``: the ids the cache
        holds (its first ``len(tokens)`` positions), kept as prefixes where the runner has a prefix cache
        (``keep_prefix``)."""

    def reuse_prefix(self, cache: KVCache, tokens: Sequence[int]) -> int:
        """Extend ``cache``, which holds the first ``cache.length`` of ``tokens`` (none when it is new), with what the
        runner kept (``keep_prefix``, ``release``) of the longest prefix of ``tokens`` beyond that; returns the cache's
        length after (unchanged: nothing further kept, or no prefix cache). The rest of ``tokens`` is the caller's to
        feed."""
        return cache.length

    def keep_prefix(self, cache: KVCache, tokens: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Keep the prefix of ``tokens`` that ``cache`` holds (its first ``cache.length`` positions), where the runner
        has a prefix cache, for other sequences to reuse (``reuse_prefix``); the cache goes on as it was."""

    def fork_cache(self, cache: KVCache, tokens: Sequence[int]) -> KVCache:
        """A new cache holding what ``cache`` holds (``tokens``, the ids it was filled with), independent of it
        from then on: n samples of one prompt share its prefill (``Engine.start_many``).

        Runtimes copy their tensors; this default, for a runtime that cannot, prefills ``tokens`` again.
        """
        if len(tokens) != cache.length:
            raise ValueError(f"fork_cache: {len(tokens)} tokens given for a cache holding {cache.length}")
        new = self.new_cache()
        if tokens:
            self.forward(token_tensor(tokens, self.device), new, last_only=True)
        return new


def token_tensor(tokens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.tensor(tokens, dtype=torch.long, device=device)``, built by numpy on the CPU, which keeps the GIL.

    ``torch.tensor`` lets the GIL go while it copies; in a server the event loop, another thread, then takes it for its
    whole burst of work and the engine's thread waits (tests/test_gil_hygiene.py). A request's prefill and catch-up
    make their tensors here."""
    ids = torch.from_numpy(np.fromiter(tokens, dtype=np.int64, count=len(tokens)))
    return ids if torch.device(device).type == "cpu" else ids.to(device)


def check_batch_one(ids: torch.Tensor) -> torch.Tensor:
    """Accept ``[k]`` or ``[1, k]``; refuse real batches with a clear error instead of reshaping."""
    from specdec.errors import UnsupportedError

    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise UnsupportedError(f"batch size {ids.shape[0]} is not supported: specdec runs one sequence per request")
        ids = ids[0]
    if ids.dim() != 1:
        raise UnsupportedError(f"expected token ids of shape [k] or [1, k], got {tuple(ids.shape)}")
    return ids


def eos_ids_of(*sources: Any) -> frozenset[int]:
    """EOS ids named by configs (``config.json``/``generation_config.json`` as dicts, or transformers config
    objects) and tokenizers: each source's ``eos_token_id``, an int or a list; None sources are skipped. The
    one place a model's end-of-sequence ids are read."""
    ids: set[int] = set()
    for src in sources:
        value = src.get("eos_token_id") if isinstance(src, Mapping) else getattr(src, "eos_token_id", None)
        for e in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(e, int) and not isinstance(e, bool):
                ids.add(e)
    return frozenset(ids)


def target_meta(runner: ModelRunner) -> dict[str, Any]:
    """What a trace's header says of the target that served it: its checkpoint and its ``numerics``."""
    return {"target": runner.name, "target_numerics": numerics(runner)}


def numerics(runner: ModelRunner) -> dict[str, str | None]:
    """What a runner's logits depend on besides its checkpoint, for traces and audits: two runs of one checkpoint
    that agree on these give the same logits bit for bit (the CPU kernel's promise) and so the same greedy outputs;
    where one differs (a dtype, the KV cache's type, the runtime, the kernel's instruction set, the device) a near-tie
    may round the other way."""
    from specdec.runtime.native import kv_dtype_of

    runtime = str(getattr(runner, "backend", type(runner).__name__))
    isa = None
    if runtime == "cpu-kernel":
        from specdec.runtime.native_kernel import kernel_isa

        isa = kernel_isa()
    return {
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "runtime": runtime,
        "kv_dtype": kv_dtype_of(runner),
        "isa": isa,
    }
