"""Prefix caching: the keys and values of token prefixes already computed, kept to skip their prefill next time.

A server sees the same prefixes again and again: a chat template's system prompt ahead of every conversation, a
conversation's earlier turns ahead of its next one, a few-shot preamble, the same document asked about twice. Each
time the prefill recomputes keys and values it has computed before, and on a CPU a prompt's prefill is most of a short
request's arithmetic (a 300-token prompt costs the default target ~23 ms of multiply-adds at the two cores' peak;
64 tokens of batched decoding cost less). A ``PrefixCache`` keeps a runner's keys and values by token prefix, in
blocks of ``BLOCK`` positions: a new sequence copies the longest stored prefix of its prompt into its cache
(``NativeRunner.reuse_prefix``) and computes only the rest; a prompt's whole blocks go in as soon as they are computed
(``NativeRunner.keep_prefix``: requests that arrive while it runs find them) and a finished sequence's at its end
(``NativeRunner.release``), prompt and output alike, so a conversation's next turn finds its earlier turns.

Exact: the entry for a block is keyed by every token before it and in it (a block is found only through its parent,
the block before it), so what a sequence copies is what its own prefill would have written to those positions. On
the CPU kernel that is the same bits (a row's keys and values depend on its own row and the cache before it, never on
the other rows of the pass: the property the verify pass relies on), so outputs with the cache are the outputs
without it, token for token; ``NativeRunner`` turns the cache on only there (the operator path's products may round a
row differently with the rows beside it).

Memory: at most ``capacity_bytes`` of blocks; past that the least recently used block with no child goes first (a
block is used whenever a sequence finds or adds a prefix through it, and its ancestors with it, later than it, so the
least recently used block is always a leaf). Not thread-safe: one engine thread uses a runner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Positions a block holds: the CPU kernel's key block (its keys are stored transposed per 16 positions), so a block
# is whole key blocks, and a hit is a multiple of it.
BLOCK = 16


@dataclass
class _Block:
    kv: torch.Tensor  # [layers, 2, kv_heads, BLOCK, head_dim]: positions [i*BLOCK, (i+1)*BLOCK) of a cache
    key: tuple[int, tuple[int, ...]]  # (parent's id, this block's tokens)
    ident: int
    parent: _Block | None
    children: int = 0


@dataclass
class PrefixStats:
    """Counts since the runner loaded (``/health``): tokens looked up (on a sequence's first look) and found, blocks
    kept and evicted."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """Blocks of ``BLOCK`` positions of one runner's caches, found by the tokens up to and through them."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"a prefix cache needs a positive capacity, got {capacity_bytes} bytes")
        self.capacity_bytes = int(capacity_bytes)
        self.bytes = 0
        self.stats = PrefixStats()
        self._blocks: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._next_id = 1  # 0: the root (the empty prefix)

    def __len__(self) -> int:
        return len(self._blocks)

    def _path(self, tokens: Sequence[int]) -> list[_Block]:
        """The stored blocks along ``tokens`` from the start, as far as they go."""
        path: list[_Block] = []
        parent = 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            block = self._blocks.get((parent, tuple(tokens[start : start + BLOCK])))
            if block is None:
                break
            path.append(block)
            parent = block.ident
        return path

    def _touch(self, path: list[_Block]) -> None:
        for block in reversed(path):  # deepest first: each ancestor ends up more recent than its descendants
            self._lru.move_to_end(block.ident)

    def restore(self, kv: torch.Tensor, tokens: Sequence[int], have: int = 0) -> int:
        """Copy the longest stored prefix of ``tokens`` into ``kv`` (a cache tensor ``[layers, 2, kv_heads,
        positions, head_dim]``, positions from 0); returns its length (a multiple of ``BLOCK``, 0 when none).
        ``have``: positions ``kv`` already holds of ``tokens`` (their keys and values, however computed): only the
        blocks from the one holding position ``have`` on are copied, and only when the stored prefix goes beyond it
        (a block partly held is copied whole: its held positions get the same bits again)."""
        skip = have // BLOCK
        if not have:  # a sequence's first look (a later one, for what it still lacks, counts only what it finds)
            self.stats.queried_tokens += len(tokens)
        path = self._path(tokens)
        n = len(path) * BLOCK
        if n <= have:
            return n
        self._touch(path)
        new = path[skip:]
        stacked = torch.stack([b.kv for b in new], dim=3)  # [layers, 2, kv_heads, blocks, BLOCK, head_dim]
        kv.narrow(3, skip * BLOCK, len(new) * BLOCK).copy_(stacked.flatten(3, 4))
        self.stats.hit_tokens += n - have
        return n

    def store(self, kv: torch.Tensor, tokens: Sequence[int]) -> int:
        """Keep the whole blocks of ``tokens`` (the positions ``kv`` holds, from 0) not stored yet; returns how many
        blocks were added. Blocks that do not fit once the least recently used leaves are gone are not kept."""
        whole = len(tokens) // BLOCK
        if not whole:
            return 0
        path = self._path(tokens)  # (whole blocks only)
        added = 0
        parent = path[-1] if path else None
        size = kv[:, :, :, :BLOCK].numel() * kv.element_size()  # a block's bytes
        for i in range(len(path), whole):
            if not self._make_room(size, keep=parent):
                break
            key = (parent.ident if parent is not None else 0, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
            block = _Block(kv.narrow(3, i * BLOCK, BLOCK).clone(), key, self._next_id, parent)
            self._next_id += 1
            self._blocks[key] = block
            self._lru[block.ident] = block
            if parent is not None:
                parent.children += 1
            self.bytes += size
            self.stats.stored_blocks += 1
            added += 1
            path.append(block)
            parent = block
        self._touch(path)
        return added

    def _make_room(self, size: int, keep: _Block | None) -> bool:
        """Evict least recently used leaves until ``size`` more bytes fit (never ``keep``, the block the next one
        hangs from); False when they cannot."""
        if size > self.capacity_bytes:
            return False
        while self.bytes + size > self.capacity_bytes:
            victim = next((b for b in self._lru.values() if b.children == 0 and b is not keep), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, block: _Block) -> None:
        del self._blocks[block.key]
        del self._lru[block.ident]
        self.bytes -= block.kv.numel() * block.kv.element_size()
        self.stats.evicted_blocks += 1
        if block.parent is not None:
            block.parent.children -= 1

    def clear(self) -> None:
        self._blocks.clear()
        self._lru.clear()
        self.bytes = 0

    def describe(self) -> dict[str, int]:
        """The cache's size and counts, for ``/health``."""
        return {
            "capacity_mib": self.capacity_bytes >> 20,
            "kept_bytes": self.bytes,
            "blocks": len(self._blocks),
            "queried_tokens": self.stats.queried_tokens,
            "hit_tokens": self.stats.hit_tokens,
            "evicted_blocks": self.stats.evicted_blocks,
        }
