"""make_group_metadata: the sorted, group-padded layout is a valid tiling (random group sizes,
empty slots, one slot with every token) and its contract is checked."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import GroupMetadata, make_group_metadata, padded_rows
from pallas_testing import GROUP_CASES, group_idx


@pytest.mark.parametrize("case", sorted(GROUP_CASES))
@pytest.mark.parametrize("bt", [8, 16])
def test_layout_is_a_valid_tiling(case, bt):
    idx, n = group_idx(1, case)
    md = make_group_metadata(idx, n, bt)
    T = idx.shape[0]
    ix, dest, tg = np.asarray(idx), np.asarray(md.dest), np.asarray(md.tile_group)
    counts, offs = np.bincount(ix, minlength=n), np.asarray(md.tile_offsets)
    assert md.num_rows == padded_rows(T, n, bt) and md.num_tiles * bt == md.num_rows
    assert md.block_tokens == bt and md.num_groups == n and md.num_tokens == T
    assert len(set(dest.tolist())) == T and dest.max() < md.num_rows
    assert np.all(tg[dest // bt] == ix)                                  # each row in its slot's tile
    for g in range(n):
        assert np.all(np.diff(dest[ix == g]) > 0)                        # stable within a slot
        rows = dest[ix == g]
        assert np.all((rows // bt >= offs[g]) & (rows // bt < offs[g + 1]))
    np.testing.assert_array_equal(np.asarray(md.counts), counts)
    np.testing.assert_array_equal(np.diff(offs), -(-counts // bt))
    used = int(md.num_used[0])
    assert used == offs[-1] and np.all(tg[:used] == np.repeat(np.arange(n), np.diff(offs)))
    assert np.all(np.diff(tg) >= 0) and np.all(tg[used:] == tg[used - 1])


def test_metadata_is_a_pytree_with_static_block_tokens():
    import jax
    md = make_group_metadata(jnp.array([1, 0, 1], jnp.int32), 2, 16)
    leaves, tree = jax.tree_util.tree_flatten(md)
    assert len(leaves) == 5 and jax.tree_util.tree_unflatten(tree, leaves).block_tokens == 16
    out = jax.jit(lambda m: m)(md)
    assert isinstance(out, GroupMetadata) and out.block_tokens == 16


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="integer"):
        make_group_metadata(jnp.zeros((3,), jnp.float32), 2)
    with pytest.raises(ValueError, match="positive"):
        make_group_metadata(jnp.zeros((3,), jnp.int32), 0)
