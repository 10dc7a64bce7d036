"""Apply a bank's per-layer adapters to flattened tokens, with a jnp or a Pallas backend.

backend="jnp": plain XLA (one-hot over slots for small banks, per-token gather for large ones).
backend="pallas": grouped SGMV kernel for multi-token chunks (prefill/training), per-token BGMV
gather for single-token decode, batched ReFT kernel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("jnp", "pallas")
_ONE_HOT_MAX_SLOTS = 4


def _check_backend(backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"adapter backend must be one of {BACKENDS}, got {backend!r}")


def lora_delta(x, A, B, idx, backend: str, decode: bool):
    """x: [T, d_in]; A: [N, d_in, r]; B: [N, r, d_out]; idx: int32 [T] -> [T, d_out]."""
    _check_backend(backend)
    if backend == "pallas":
        import pallas_kernels
        fn = pallas_kernels.lora_bgmv if decode else pallas_kernels.lora_sgmv
        return fn(x, A, B, idx)
    n_slots = A.shape[0]
    if n_slots <= _ONE_HOT_MAX_SLOTS:
        onehot = jax.nn.one_hot(idx, n_slots, dtype=jnp.float32)                 # [T, N]
        xa = jnp.einsum("td,ndr->tnr", x, A, preferred_element_type=jnp.float32)
        xa = xa * onehot[:, :, None]
        out = jnp.einsum("tnr,nro->to", xa.astype(B.dtype), B, preferred_element_type=jnp.float32)
    else:
        xa = jnp.einsum("td,tdr->tr", x, A[idx], preferred_element_type=jnp.float32)
        out = jnp.einsum("tr,tro->to", xa.astype(B.dtype), B[idx], preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def reft_intervene(h, R, W, b, subtract, idx, backend: str):
    """h: [T, d]; R, W: [N, r, d]; b: [N, r]; subtract: [N]; idx: int32 [T] -> [T, d].

    h + R^T (W h + b - subtract * R h)   (LoReFT: subtract = 1, DiReFT: subtract = 0)
    """
    _check_backend(backend)
    if backend == "pallas":
        import pallas_kernels
        return pallas_kernels.reft_apply(h, R, W, b, subtract, idx)
    hf = h.astype(jnp.float32)
    Rt, Wt = R[idx].astype(jnp.float32), W[idx].astype(jnp.float32)            # [T, r, d]
    edit = (jnp.einsum("trd,td->tr", Wt, hf) + b[idx].astype(jnp.float32)
            - subtract[idx].astype(jnp.float32)[:, None] * jnp.einsum("trd,td->tr", Rt, hf))
    return (hf + jnp.einsum("trd,tr->td", Rt, edit)).astype(h.dtype)
