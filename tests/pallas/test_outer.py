"""grouped_outer (the weight-gradient kernel) of both variants against the jnp reference, on the
padded layout with empty slots and a slot holding every token."""
import numpy as np
import pytest

from pallas_kernels import VARIANTS, make_group_metadata
from pallas_kernels.metadata import scatter_rows
from pallas_kernels.outer import grouped_outer
from pallas_kernels.reference import grouped_outer_reference
from pallas_testing import close, group_idx, rand


@pytest.mark.parametrize("platform", VARIANTS)
@pytest.mark.parametrize("case", ["random_with_empty", "one_slot_all_tokens"])
def test_matches_reference(platform, case):
    idx, n = group_idx(2, case)
    md = make_group_metadata(idx, n, 16)
    L = scatter_rows(rand(3, (idx.shape[0], 40)), md)
    R = scatter_rows(rand(4, (idx.shape[0], 24)), md)
    out = grouped_outer(L, R, md, platform=platform, interpret=True)
    ref = grouped_outer_reference(L, R, md)
    close(out, ref, 1e-5)
    counts = np.bincount(np.asarray(idx), minlength=n)
    assert np.all(np.asarray(out)[counts == 0] == 0) and np.abs(np.asarray(out)).max() > 0
