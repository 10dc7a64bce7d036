"""Pick a kernel variant for the platform a call is lowered for (not the process's default backend).

Variants: "tpu" (Mosaic TPU: scalar-prefetched tile -> slot ids, weights blocked by index_map) and
"gpu" (Pallas Triton: ids as ordinary int32 operands, weights unblocked and sliced in the kernel).

platform  interpret  -> what runs
None      None       lowering for tpu: "tpu" compiled; cuda/rocm: "gpu" compiled;
                     anything else (cpu): "tpu" in interpret mode (the CPU default)
None      True/False "tpu" on tpu, "gpu" on cuda/rocm, "tpu" elsewhere, interpreted or not as asked
"tpu"/"gpu" None     that variant, compiled when lowering for its platform, interpreted elsewhere
"tpu"/"gpu" bool     that variant, interpreted or not as asked, on every platform

With platform=None every variant is traced (jax.lax.platform_dependent stages all branches and
lowering keeps the one for the target), so a shape must be tileable by all of them; pass platform=
to trace one variant only.
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping

from jax import lax

VARIANTS = ("tpu", "gpu")
INTERPRET_DEFAULT = "tpu"
_LOWERING_PLATFORMS = {"tpu": ("tpu",), "gpu": ("cuda", "rocm")}


def check_platform(platform: str | None) -> None:
    if platform is not None and platform not in VARIANTS:
        raise ValueError(f"platform must be None (pick by lowering platform) or one of {VARIANTS}, "
                         f"got {platform!r}")


def dispatch(impls: Mapping[str, Callable], args: tuple, *, platform: str | None,
             interpret: bool | None):
    """impls[variant](*args, interpret=bool) for the variant chosen as in the module docstring.

    Every impl must return the same shapes and dtypes for the same args.
    """
    check_platform(platform)
    if platform is not None and interpret is not None:
        return impls[platform](*args, interpret=bool(interpret))
    compiled = False if interpret is None else bool(interpret)
    branches = {}
    for variant in (VARIANTS if platform is None else (platform,)):
        fn = functools.partial(impls[variant], interpret=compiled)
        for lowering_platform in _LOWERING_PLATFORMS[variant]:
            branches[lowering_platform] = fn         # one object: cuda and rocm share a branch
    default = functools.partial(impls[platform or INTERPRET_DEFAULT],
                                interpret=True if interpret is None else bool(interpret))
    return lax.platform_dependent(*args, default=default, **branches)
