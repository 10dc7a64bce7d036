"""Lowering for an accelerator: which platform name a "gpu" lowering takes here, and lowering for
a platform this host may not have (cross-lowering: how the cuda / tpu paths are proven and planned
on a CPU host, and how `pallas_lowers_on` probes the kernels).

    lowering_platform("gpu")              # "cuda" or "rocm", from the attached GPU's client
    lower_for(jax.jit(f), *args, platform="cuda")  # = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)),
                                                   #   on any host

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


def target_scope(platform: str):
    """The context a lowering for `platform` runs in: for "cuda" on a host with no GPU, an abstract
    mesh of one abstract `CROSS_GPU`; otherwise nothing."""
    if platform != "cuda" or _gpus():
        return contextlib.nullcontext()
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    device = AbstractDevice(device_kind=CROSS_GPU, num_cores=None, platform="gpu")
    return use_abstract_mesh(AbstractMesh((1,), ("cross_lowering",), abstract_device=device))


def lower_for(jitted, *args, platform: str, **kwargs):
    """`jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))` (platform "gpu" resolved
    by `lowering_platform`), traced and lowered inside `target_scope` (the lowering reads the
    target the trace recorded): on a CPU host too, whatever the jax."""
    platform = lowering_platform(platform)
    with target_scope(platform):
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))
