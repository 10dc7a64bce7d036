"""Grouped (per-slot) token layout shared by the grouped kernels, built once per step.

Tokens are stably sorted by adapter slot and every slot's group is padded up to a multiple of
`block_tokens` rows, so each row tile of the padded buffer belongs to exactly one slot. All shapes
are static: the padded length is the bound

    num_rows = round_up(T + min(N, T) * (block_tokens - 1), block_tokens)

(T tokens, N slots); group sizes are traced values. Build the metadata once per forward step
(`make_group_metadata(adapter_idx, num_groups, block_tokens)`) and pass it to every grouped call of
that step (`lora_sgmv(..., metadata=md)`, `reft_apply(..., metadata=md)`): the sort, the scatter
destinations and the tile tables are then computed once instead of once per projection.

Contract: a call that receives `metadata` must use the same adapter_idx (the slot ids are not
re-read), the same number of slots N (weights' leading dim), the same token count T and the same
block_tokens; the last three are checked at trace time (ValueError), the first cannot be.

Fields (nt = num_rows // block_tokens tiles):
  dest          int32 [T]      padded row of each original token (unique)
  tile_group    int32 [nt]     slot of each tile; tiles past the used ones repeat the last used
                               slot, so consecutive tiles never revisit a slot
  num_used      int32 [1]      tiles that hold real tokens (kernels skip the rest)
  counts        int32 [N]      tokens per slot
  tile_offsets  int32 [N + 1]  slot g owns tiles [tile_offsets[g], tile_offsets[g + 1])
  block_tokens  int (static)   rows per tile
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

DEFAULT_BLOCK_TOKENS = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupMetadata:
    dest: jax.Array
    tile_group: jax.Array
    num_used: jax.Array
    counts: jax.Array
    tile_offsets: jax.Array
    block_tokens: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_tokens(self) -> int:
        return self.dest.shape[0]

    @property
    def num_groups(self) -> int:
        return self.counts.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.tile_group.shape[0]

    @property
    def num_rows(self) -> int:
        return self.num_tiles * self.block_tokens


def padded_rows(num_tokens: int, num_groups: int, block_tokens: int) -> int:
    """Static upper bound on the padded buffer length."""
    bound = num_tokens + min(num_groups, num_tokens) * (block_tokens - 1)
    return -(-bound // block_tokens) * block_tokens


@functools.partial(jax.jit, static_argnums=(1, 2), static_argnames=("num_groups", "block_tokens"))
def make_group_metadata(adapter_idx: jax.Array, num_groups: int,
                        block_tokens: int = DEFAULT_BLOCK_TOKENS) -> GroupMetadata:
    """Layout for integer [T] slot ids in [0, num_groups) (out-of-range ids are clipped)."""
    if adapter_idx.ndim != 1 or not jnp.issubdtype(adapter_idx.dtype, jnp.integer):
        raise ValueError(f"adapter_idx must be a 1-D integer array, got {adapter_idx.dtype}"
                         f"{list(adapter_idx.shape)}")
    if int(num_groups) < 1 or int(block_tokens) < 1:
        raise ValueError(f"num_groups and block_tokens must be positive, got {num_groups}, "
                         f"{block_tokens}")
    num_groups, block = int(num_groups), int(block_tokens)
    (num_tokens,) = adapter_idx.shape
    idx = jnp.clip(adapter_idx.astype(jnp.int32), 0, num_groups - 1)
    num_tiles = padded_rows(num_tokens, num_groups, block) // block

    counts = jnp.zeros((num_groups,), jnp.int32).at[idx].add(1)
    tiles = (counts + block - 1) // block
    tile_end = jnp.cumsum(tiles)
    tile_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), tile_end]).astype(jnp.int32)
    pad_start = (tile_end - tiles) * block
    start = jnp.cumsum(counts) - counts

    order = jnp.argsort(idx, stable=True)
    rank = jnp.zeros((num_tokens,), jnp.int32).at[order].set(jnp.arange(num_tokens, dtype=jnp.int32))
    dest = pad_start[idx] + rank - start[idx]

    tile_group = jnp.searchsorted(tile_end, jnp.arange(num_tiles, dtype=jnp.int32), side="right")
    last_used = num_groups - 1 - jnp.argmax((counts > 0)[::-1]).astype(jnp.int32)
    tile_group = jnp.minimum(tile_group.astype(jnp.int32), last_used)
    num_used = tile_end[-1].astype(jnp.int32).reshape(1)
    return GroupMetadata(dest.astype(jnp.int32), tile_group, num_used, counts, tile_offsets, block)


def check_metadata(md: GroupMetadata, num_tokens: int, num_groups: int, block_tokens: int,
                   kernel: str) -> None:
    """Trace-time check of the metadata contract (see module docstring)."""
    if not isinstance(md, GroupMetadata):
        raise TypeError(f"{kernel}: metadata must be a GroupMetadata from make_group_metadata, "
                        f"got {type(md).__name__}")
    got = (md.num_tokens, md.num_groups, md.block_tokens)
    want = (num_tokens, num_groups, block_tokens)
    if got != want:
        raise ValueError(f"{kernel}: metadata was built for (tokens, slots, block_tokens)={got} but "
                         f"the call has {want}; build it with make_group_metadata(adapter_idx, "
                         f"{num_groups}, {block_tokens})")


def resolve_metadata(kernel: str, adapter_idx, num_groups: int, block_tokens: int | None,
                     metadata: GroupMetadata | None) -> GroupMetadata:
    """The call's layout: `metadata` checked against the call, or built from adapter_idx."""
    if metadata is None:
        return make_group_metadata(adapter_idx, num_groups,
                                   DEFAULT_BLOCK_TOKENS if block_tokens is None else block_tokens)
    check_metadata(metadata, adapter_idx.shape[0], num_groups,
                   metadata.block_tokens if block_tokens is None else block_tokens, kernel)
    return metadata


def scatter_rows(x: jax.Array, md: GroupMetadata, width: int | None = None) -> jax.Array:
    """[T, d] -> [num_rows, width] (width >= d, zero padded) with row t at dest[t], zeros elsewhere."""
    width = x.shape[1] if width is None else width
    out = jnp.zeros((md.num_rows, width), x.dtype)
    if width == x.shape[1]:
        return out.at[md.dest].set(x, unique_indices=True)
    return out.at[md.dest, :x.shape[1]].set(x, unique_indices=True)


def gather_rows(x_pad: jax.Array, md: GroupMetadata, width: int | None = None) -> jax.Array:
    """[num_rows, >= width] -> [T, width], inverse of scatter_rows."""
    out = jnp.take(x_pad, md.dest, axis=0, unique_indices=True)
    return out if width is None or width == out.shape[1] else out[:, :width]
