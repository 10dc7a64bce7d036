"""grouped_outer: per-slot sum of tile outer products on the padded layout (weight gradients).

grouped_outer(L, R, md) -> float32 [N, a, b], out[g] = sum over the rows p of slot g's tiles of
L[p]^T R[p]; L [P, a], R [P, b] in the layout of `md` (group-padding rows of at least one operand
must be zero). Empty slots get zeros. Variants: tpu/outer.py, gpu/outer.py; reference:
reference.grouped_outer_reference.
"""
from __future__ import annotations

from .dispatch import dispatch
from .gpu import outer as gpu_outer
from .metadata import GroupMetadata
from .tpu import outer as tpu_outer

_IMPLS = {"tpu": tpu_outer.grouped_outer, "gpu": gpu_outer.grouped_outer}


def grouped_outer(L, R, md: GroupMetadata, *, platform: str | None = None,
                  interpret: bool | None = None):
    return dispatch(_IMPLS, (L, R, md), platform=platform, interpret=interpret)
