"""Sort-and-pad token layout for grouped (per-adapter) tile kernels.

Tokens are stably sorted by adapter slot and every slot's group is padded up to a multiple of
`block` rows, so each row tile of the padded buffer belongs to exactly one slot. All shapes are
static: the padded length is the bound round_up(T + min(N, T) * (block - 1), block); group sizes
are traced values.

Layout fields (T tokens, N slots, P padded rows, nt = P // block tiles):
  dest        int32 [T]   padded row of each original token (unique)
  tile_group  int32 [nt]  slot of each tile; tiles past the used ones repeat the last used slot,
                          so consecutive tiles never revisit a slot (weight blocks stay resident)
  num_used    int32 [1]   number of tiles that hold real tokens (kernels skip the rest)
  counts      int32 [N]   tokens per slot
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupLayout(NamedTuple):
    dest: jax.Array
    tile_group: jax.Array
    num_used: jax.Array
    counts: jax.Array


def padded_rows(num_tokens: int, num_groups: int, block: int) -> int:
    """Static upper bound on the padded buffer length."""
    bound = num_tokens + min(num_groups, num_tokens) * (block - 1)
    return -(-bound // block) * block


def group_layout(idx: jax.Array, num_groups: int, block: int) -> GroupLayout:
    """Layout for int32 [T] slot ids in [0, num_groups) (out-of-range ids are clipped)."""
    (num_tokens,) = idx.shape
    idx = jnp.clip(idx.astype(jnp.int32), 0, num_groups - 1)
    num_tiles = padded_rows(num_tokens, num_groups, block) // block

    counts = jnp.zeros((num_groups,), jnp.int32).at[idx].add(1)
    padded = (counts + block - 1) // block * block
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    start = jnp.cumsum(counts) - counts

    order = jnp.argsort(idx, stable=True)
    rank = jnp.zeros((num_tokens,), jnp.int32).at[order].set(jnp.arange(num_tokens, dtype=jnp.int32))
    dest = pad_start[idx] + rank - start[idx]

    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * block
    tile_group = jnp.searchsorted(pad_end, tile_start, side="right").astype(jnp.int32)
    last_used = num_groups - 1 - jnp.argmax((counts > 0)[::-1]).astype(jnp.int32)
    tile_group = jnp.minimum(tile_group, last_used)
    num_used = (pad_end[-1] // block).astype(jnp.int32).reshape(1)
    return GroupLayout(dest.astype(jnp.int32), tile_group, num_used, counts)


def scatter_rows(x: jax.Array, dest: jax.Array, num_rows: int) -> jax.Array:
    """[T, d] -> [P, d] with row t at dest[t] and zeros elsewhere."""
    return jnp.zeros((num_rows,) + x.shape[1:], x.dtype).at[dest].set(x, unique_indices=True)


def gather_rows(x_pad: jax.Array, dest: jax.Array) -> jax.Array:
    """[P, d] -> [T, d], inverse of scatter_rows."""
    return jnp.take(x_pad, dest, axis=0, unique_indices=True)
