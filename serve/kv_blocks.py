"""The KV block pool: fixed-size blocks of the paged KV cache, reference counted, with a prefix cache.

A sequence's KV lives in `block_size`-token blocks named by its block table. Full blocks can be
*cached*: registered under a hash that covers every token up to the block's end and the identity
of the adapter that produced them, so a later sequence with the same prefix (and the same adapter,
or none when the prefix is provably adapter-free, see `block_hashes` and
`preft_jax.adapters.policy.adapted_windows`) reuses the block instead of
recomputing it. Unreferenced cached blocks stay resident until the pool needs room and are then
evicted least-recently-used first.

Block 0 is reserved: it is never handed out, so padding entries of block tables can point at it.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np

NULL_BLOCK = 0


class NoFreeBlocks(RuntimeError):
    """The pool has neither a free nor an evictable block."""


@dataclasses.dataclass
class PrefixStats:
    hits: int = 0            # blocks served from the cache
    misses: int = 0          # cacheable blocks that had to be computed
    evictions: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"need num_blocks >= 2 (block 0 is reserved) and block_size >= 1, got "
                             f"{num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._free: collections.deque[int] = collections.deque(range(1, num_blocks))
        self._ref = [0] * num_blocks                 # a list: per-block reads and writes are Python ints
        self._hash: dict[int, bytes] = {}                       # block -> its hash (cached blocks)
        self._by_hash: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()   # LRU first
        self.stats = PrefixStats()

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks that can ever hold KV (block 0 excluded)."""
        return self.num_blocks - 1

    @property
    def num_available(self) -> int:
        """Blocks allocatable right now: free + cached-but-unreferenced (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash)

    def usage(self) -> float:
        return 1.0 - self.num_available / self.capacity

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash.pop(block)]
            self.stats.evictions += 1
        else:
            raise NoFreeBlocks("the KV block pool is exhausted")
        self._ref[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """n blocks, in the order n `allocate` calls would give them (free ones first, then the least
        recently used evictable ones)."""
        if n > self.num_available:
            raise NoFreeBlocks(f"need {n} KV blocks, {self.num_available} available")
        free = self._free
        if n > len(free):
            return [self.allocate() for _ in range(n)]
        blocks = [free.popleft() for _ in range(n)]
        ref = self._ref
        for block in blocks:
            ref[block] = 1
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drops one reference per block; unreferenced cached blocks become evictable (most recent last),
        the others free. Blocks are freed in reverse so a sequence's tail is evicted before its head."""
        for block in reversed(list(blocks)):
            if block == NULL_BLOCK:
                continue
            if self._ref[block] <= 0:
                raise RuntimeError(f"KV block {block} freed more often than allocated")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._hash:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def share(self, blocks: Sequence[int]) -> None:
        """Takes one more reference on each (held) block: a forked sequence shares its parent's KV."""
        for block in blocks:
            if block == NULL_BLOCK or self._ref[block] <= 0:
                raise RuntimeError(f"KV block {block} is not held; it cannot be shared")
            self._ref[block] += 1

    def refcount(self, block: int) -> int:
        return int(self._ref[block])

    # ---- prefix cache -----------------------------------------------------------------------
    def lookup(self, h: bytes) -> int | None:
        """The cached block with hash `h`, with a reference taken (a hit), or None."""
        if not self.enable_prefix_cache:
            return None
        block = self._by_hash.get(h)
        if block is None:
            return None
        if self._ref[block] == 0:
            self._evictable.pop(block, None)
        self._ref[block] += 1
        self.stats.hits += 1
        return block

    def register(self, block: int, h: bytes) -> None:
        """Marks a full, computed block as cached under `h` (no-op if `h` is already cached)."""
        if not self.enable_prefix_cache or h in self._by_hash or block in self._hash:
            return
        self._hash[block] = h
        self._by_hash[h] = block

    def count_miss(self, n: int = 1) -> None:
        self.stats.misses += n

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (e.g. after the KV buffer was rebuilt)."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self._hash.clear()
        self._by_hash.clear()


# ---------------------------------------------------------------------------------------- hashing
def block_hashes(tokens: Sequence[int], block_size: int, windows: Sequence[tuple[int, int]],
                 adapter_key: bytes | None, n_blocks: int | None = None) -> list[bytes]:
    """Chained hashes of the first `n_blocks` full blocks of `tokens` (default: every full block).

    hash_b = H(hash_{b-1}, tokens of block b, which of block b's positions are adapted and by whom).
    `windows`: the adapted positions, [start, end) (`preft_jax.adapters.policy.adapted_windows`). A
    block with none of them hashes as a base block (shared with base requests and across adapters);
    otherwise its hash holds the adapter's identity and the adapted offsets inside the block, so a
    block is reused only by a sequence that adapted the same positions of it (with the chain: the
    same positions of every block before it). A last_k window that moves with the prompt's length, an
    aLoRA start inside a block, or a PreFT prompt whose earlier turn's generated (base) tokens are now
    adapted prompt tokens all hash apart.
    """
    full = len(tokens) // block_size if n_blocks is None else min(n_blocks, len(tokens) // block_size)
    out, parent = [], b""
    arr = np.asarray(tokens[:full * block_size], np.int64)
    for b in range(full):
        start, end = b * block_size, (b + 1) * block_size
        h = hashlib.blake2b(digest_size=16)
        h.update(parent)
        h.update(arr[start:end].tobytes())
        inside = [(max(a, start) - start, min(e, end) - start) for a, e in windows if a < end and e > start]
        if inside:
            h.update(b"A" + (adapter_key or b"") + np.asarray(inside, np.int64).tobytes())
        else:
            h.update(b"B")
        parent = h.digest()
        out.append(parent)
    return out
