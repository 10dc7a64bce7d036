"""Causal attention over a chunk that starts at position 0 - the teacher-forced training forward
(SFT, GRPO's log-probabilities) and unpaged prefill (`Llama.forward_chunk`) - and who computes it.

Implementations (`Llama(..., chunk_attention=...)`, or `PREFT_JAX_CHUNK_ATTENTION` in the
environment):

* ``"xla"`` - the einsum reference: float32 scores [B, KV, G, T, T], a float32 softmax, the
  probabilities in the value dtype, float32 accumulation. Every platform; exact on CPU.
* ``"flash:gpu"`` / ``"flash:tpu"`` - jax's Pallas flash-attention kernels (the Triton ``mha`` on
  a GPU, the Mosaic ``flash_attention`` on a TPU), each with its own fused backward: no [T, T]
  score matrix is written to memory, forward or backward. For the Llama-3.1-8B SFT step (8 x 1024
  tokens) the reference writes and rereads 1 GiB of float32 scores per layer several times a step
  (forward, its rematerialization, the backward); the kernels read q, k, v once per block.
  Lowered for CPU (tests) the GPU kernel runs in Pallas interpret mode, the TPU kernel under
  `force_tpu_interpret_mode()`.

``"auto"`` (the default) resolves when the model is built: on a GPU or a TPU whose kernel lowers,
``flash`` for a bfloat16 model (as MaxText trains with flash attention); ``xla`` everywhere else -
on CPU, and for float32 models (a Triton dot may round float32 operands to TF32; float32 stays on
the reference unless ``flash`` is asked for by name). ``"flash"`` alone means the flash kernel of
the platform the model is built on.

The kernels take as many K/V heads as query heads: K and V are repeated to the query heads first
(head h reads KV head h // G, as the reference). The chunk is padded at its end to the kernels'
block multiple (16-128 positions) and cut back: causal attention never lets a real position see
a padded one. Under a mesh (`jax.set_mesh`) the kernel runs in `jax.shard_map` over the batch and
head axes of the activations' own sharding (`preft_jax.sharding`'s rules), since a Pallas call is
not partitioned by XLA; the sequence axis is never split."""
from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp

from preft_jax import sharding as shd
from preft_jax.lowering import error_line, lowers

log = logging.getLogger("preft_jax.chunk_attention")

ENV = "PREFT_JAX_CHUNK_ATTENTION"
IMPLS = ("xla", "flash:gpu", "flash:tpu")
CHOICES = ("auto", "xla", "flash") + IMPLS[1:]
Q_AXES = ("batch", "seq", "q_heads", "head_dim")

_probed: dict[str, str] = {}
_logged: set = set()


def resolve(choice: str | None, dtype, platform: str | None = None) -> str:
    """`choice` ("auto" | "xla" | "flash" | "flash:gpu" | "flash:tpu"; None: the environment's
    PREFT_JAX_CHUNK_ATTENTION, else "auto") -> one of IMPLS for a model of `dtype` on `platform`
    (default jax.default_backend()). "auto" falls back to "xla", with one log line, where the
    platform's kernel does not lower; a kernel asked for by name that does not lower is an error."""
    where = "chunk_attention"
    if choice is None:
        choice, where = (os.environ.get(ENV, "").strip().lower() or "auto"), ENV
    if choice not in CHOICES:
        raise ValueError(f"{where} must be one of {CHOICES}, got {choice!r}")
    platform = jax.default_backend() if platform is None else platform
    if choice == "xla":
        return "xla"
    if choice == "auto":
        if platform not in ("gpu", "tpu") or jnp.dtype(dtype) != jnp.bfloat16:
            return "xla"
        why = kernel_fails_to_lower(platform)
        if why:
            if ("auto", platform) not in _logged:
                _logged.add(("auto", platform))
                log.warning("chunk attention: the %s flash kernel does not lower here (%s); using xla", platform, why)
            return "xla"
        return f"flash:{platform}"
    asked = choice
    if choice == "flash":
        if platform not in ("gpu", "tpu"):
            raise ValueError(f"{where}='flash' needs a GPU or a TPU (this is {platform!r}); use 'xla', or name "
                             f"a kernel ('flash:gpu' runs in Pallas interpret mode off a GPU; 'flash:tpu' off a "
                             f"TPU only lowers for one, or runs under force_tpu_interpret_mode)")
        choice = f"flash:{platform}"
    kind = choice.split(":")[1]
    if platform == kind:
        why = kernel_fails_to_lower(kind)
        if why:
            raise ValueError(f"{where}={asked!r}: the {kind} flash kernel does not lower here: {why}")
    return choice


def kernel_fails_to_lower(kind: str) -> str:
    """"" when the `kind` ("gpu" | "tpu") flash kernel's forward and backward lower for that
    platform (a small bfloat16 case, probed once per process), else why not in one line."""
    if kind not in _probed:
        from preft_jax.lowering import lowering_platform
        q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

        def f(q, k, v):
            return jax.grad(lambda q, k, v: causal_attention(q, k, v, f"flash:{kind}").astype(jnp.float32).sum(),
                            argnums=(0, 1, 2))(q, k, v)
        try:
            _probed[kind] = lowers(jax.jit(f), q, q, q, platform=lowering_platform(kind))
        except Exception as e:      # noqa: BLE001 - a probe's answer is "not here"
            _probed[kind] = error_line(e)
    return _probed[kind]


def self_check(impl: str, dtype=jnp.bfloat16, T: int = 256, H: int = 4, KV: int = 2, hd: int = 128) -> str:
    """"" when `impl` compiles, runs and matches the XLA reference here - the output and the gradients
    of q, k, v on a small random GQA case (relative max error < 5% in bfloat16, 1e-4 in float32) -
    else why not in one line. Unlike `kernel_fails_to_lower` it runs the kernel (a device run checks
    that a kernel which lowers also compiles and computes before timing anything with it)."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, T, H, hd), dtype)
    k, v = (jax.random.normal(kk, (2, T, KV, hd), dtype) for kk in keys[1:3])
    do = jax.random.normal(keys[3], (2, T, H, hd), dtype)

    def grads(impl_):
        out, vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, impl_), q, k, v)
        return (out,) + vjp(do)
    try:
        got = jax.block_until_ready(jax.jit(lambda: grads(impl))())
        want = jax.jit(lambda: grads("xla"))()
    except Exception as e:      # noqa: BLE001 - any failure: the kernel is not usable here
        return error_line(e)
    tol = 5e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 1e-4
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        err = float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-6))
        if not err < tol:                       # NaN fails too
            return f"{name} differs from the xla reference by {err:.3g} (relative max; tolerance {tol:g})"
    return ""


def causal_attention(q, k, v, impl: str, units=None):
    """q [B, T, H, hd], k and v [B, T, KV, hd] (H a multiple of KV) -> [B, T, H, hd] in q's dtype:
    each position attends to itself and every earlier one, softmax(q k^T / sqrt(hd)) v. `impl`:
    one of IMPLS (`resolve`); `units`: `sharding.axis_units(cfg)` (whole-head splits under a mesh)."""
    if impl == "xla":
        return reference(q, k, v)
    if impl not in IMPLS:
        raise ValueError(f"chunk attention implementation must be one of {IMPLS}, got {impl!r}")
    kind = impl.split(":")[1]
    B, T, H, hd = q.shape
    G = H // k.shape[2]
    if G > 1:                                   # head h reads KV head h // G
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    pad = padded_length(T, kind) - T
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    run = functools.partial(_flash, kind=kind, scale=hd ** -0.5)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        spec = shd.logical_spec(Q_AXES, q.shape, mesh, units or {"q_heads": H}, "chunk attention q")
        run = jax.shard_map(run, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
    out = run(q, k, v)
    return out[:, :T] if pad else out


def padded_length(T: int, kind: str) -> int:
    """The chunk length the `kind` kernel runs: a multiple of 128 (the TPU kernel's lane width, the
    GPU kernel's block), or for a GPU chunk under 128 the next power of two from 16 (Triton
    blocks are powers of two)."""
    if kind == "gpu" and T < 128:
        return max(16, 1 << (T - 1).bit_length())
    return -(-T // 128) * 128


def _flash(q, k, v, *, kind: str, scale: float):
    """The platform's kernel on [B, T, H, hd] operands of equal head counts. "gpu": compiled when
    lowered for cuda or rocm, in Pallas interpret mode elsewhere (CPU tests). "tpu": jax's Mosaic
    kernel; off a TPU it runs only under `jax.experimental.pallas.tpu.force_tpu_interpret_mode()`
    (tests: the forward and its backward must both be traced under it)."""
    if kind == "tpu":
        return _tpu_kernel(q, k, v, scale=scale)
    compiled = functools.partial(_gpu_kernel, scale=scale, interpret=False)
    interp = functools.partial(_gpu_kernel, scale=scale, interpret=True)
    return jax.lax.platform_dependent(q, k, v, cuda=compiled, rocm=compiled, default=interp)


def _gpu_kernel(q, k, v, *, scale: float, interpret: bool):
    from jax.experimental.pallas.ops.gpu.attention import BlockSizes, mha
    T = q.shape[1]
    b, bb = min(128, T), min(32, T)
    blocks = BlockSizes(block_q=b, block_k=b, block_q_dkv=bb, block_kv_dkv=bb, block_q_dq=bb, block_kv_dq=bb)
    return mha(q, k, v, None, sm_scale=scale, causal=True, block_sizes=blocks, interpret=interpret)


def _tpu_kernel(q, k, v, *, scale: float):
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention
    t = lambda x: jnp.swapaxes(x, 1, 2)        # noqa: E731 - [B, T, H, hd] <-> [B, H, T, hd]
    return t(flash_attention(t(q), t(k), t(v), causal=True, sm_scale=scale))


def reference(q, k, v):
    """The "xla" implementation (and the kernels' reference): `masked_attention` with a causal mask."""
    T = q.shape[1]
    return masked_attention(q, k, v, jnp.tril(jnp.ones((T, T), bool))[None])


def masked_attention(q, k, v, mask):
    """q [B, T, H, hd]; k, v [B, S, KV, hd]; mask bool [B or 1, T, S] (True: attended) -> [B, T, H, hd]:
    float32 scores and softmax, the probabilities in v's dtype, float32 accumulation (also the
    model's attention over a contiguous cache, `Llama.decode`)."""
    B, T, H, hd = q.shape
    KV = k.shape[2]
    qg = q.reshape(B, T, KV, H // KV, hd)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * hd ** -0.5
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, hd).astype(q.dtype)
