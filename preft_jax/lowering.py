"""Lowering for an accelerator: which platform name a "gpu" lowering takes here, and lowering for
a platform this host may not have (cross-lowering: how the cuda / tpu paths are proven and planned
on a CPU host, and how `pallas_lowers_on` probes the kernels).

    lowering_platform("gpu")              # "cuda" or "rocm", from the attached GPU's client
    lower_for(jax.jit(f), *args, platform="cuda")  # = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)),
                                                   #   on any host
    lowers(jax.jit(f), *args, platform="cuda")     # "" when it lowers, else the error's type and first line
                                                   #   (the probes: pallas_lowers_on, paged_kv.kernel_fails_to_lower)

From jax 0.11 the Pallas Triton lowering asks the device it targets for its compute capability,
and with no GPU attached it raises ("No supported GPU devices found, please specify an abstract
GPU device"); jax 0.10 assumed compute capability 9.0. So a cuda lowering on a host without a GPU
runs under an abstract mesh of one abstract `CROSS_GPU` (an H100: compute capability 9.0, as
before, and the device the prepared run targets); with a GPU attached nothing changes (the
lowering targets that device)."""
from __future__ import annotations

import contextlib

import jax

CROSS_GPU = "NVIDIA H100"        # the abstract device a cuda lowering targets on a host without a GPU


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except Exception:          # noqa: BLE001  (no GPU client: lowering for another machine)
        return []


def lowering_platform(platform: str) -> str:
    """The `lowering_platforms` name of `platform`: "gpu" is "rocm" on a ROCm client, else "cuda"."""
    if platform != "gpu":
        return platform
    gpus = _gpus()
    version = gpus[0].client.platform_version.lower() if gpus else ""
    return "rocm" if "rocm" in version else "cuda"


def _target_scope(platform: str):
    """The context a lowering for the resolved `platform` runs in: for "cuda" on a host with no GPU,
    the current abstract mesh (its axes, none without one) with an abstract `CROSS_GPU` as its
    device - no axis added, so code that shards only under a mesh (`sharding.constrain`) lowers
    as it does on the device, and a caller's mesh keeps its size; otherwise nothing."""
    if platform != "cuda" or _gpus():
        return contextlib.nullcontext()
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    device = AbstractDevice(device_kind=CROSS_GPU, num_cores=None, platform="gpu")
    cur = jax.sharding.get_abstract_mesh()
    return use_abstract_mesh(AbstractMesh(cur.axis_sizes, cur.axis_names, axis_types=cur.axis_types,
                                          abstract_device=device))


def lower_for(jitted, *args, platform: str, **kwargs):
    """`jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))` (platform "gpu" resolved
    by `lowering_platform`), traced and lowered inside `_target_scope` (the lowering reads the
    target the trace recorded): on a CPU host too, whatever the jax. (`platform` is this function's:
    a traced function's own `platform` argument cannot be passed through it.)"""
    platform = lowering_platform(platform)
    with _target_scope(platform):
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))


def lowers(jitted, *args, platform: str, **kwargs) -> str:
    """"" when `lower_for(jitted, *args, platform=platform, **kwargs)` succeeds, else why not: the
    error's type and first line (any error: a probe's answer is "not on this platform")."""
    try:
        lower_for(jitted, *args, platform=platform, **kwargs)
    except Exception as e:     # noqa: BLE001
        return error_line(e)
    return ""


def error_line(e: BaseException, limit: int = 200) -> str:
    """An error in one line: its type and the first line of its message (at most `limit` characters;
    the type again when the message is empty)."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{type(e).__name__}: {first[:limit]}"
