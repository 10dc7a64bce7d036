"""Native CPU decode (float32) as XLA FFI custom calls: the one path here that is not Pallas,
because XLA:CPU runs a decode step's small-M matmuls well below this CPU's float32 GEMM rate
(docs/benchmarks.md, section 1).

    pack_panels(w [..., K, N]) -> [..., P, K, 48]           once, at load (P = ceil(N / 48))
    packed_matmul(x [..., K], w_packed, n, layer=None) -> [..., n]   one matrix, or layer `layer` of a
                                                              stack read in place (benchmarks.gemm_floor)
    decode_step(h, block_tables, context_lens, chunk_lens, write_index, inv_freq, weights, final_norm,
                lm_head, vocab_size, k_pool, v_pool, eps) -> (logits, greedy, k_pool, v_pool)
    packed_matmul_reference(x, w_packed, n, layer=None)       plain jnp, the same contract
    available() -> bool; unavailable_reason() -> str

`decode_step` runs one token per row through every decoder layer of a Llama-family model (RMSNorm,
q/k/v with optional bias, HF rotate-half RoPE, GQA attention over a paged pool, SwiGLU MLP) and the
final norm and LM head (logits and each row's greedy token), writing
each row's new K/V at its flat pool index (`write_index` >= pool size: dropped, a padding row), with
the semantics of preft_jax's paged "gather" path: every row reads the pool before the layer's new K/V
are written. `chunk_lens[r] == 0` marks a padding row (no attention; its logits are unspecified).
`weights` (see `pack_decoder`): attn_norm, mlp_norm [L, d]; w_qkv [L, P, d, 48] (q|k|v columns);
b_qkv [L, n_q + 2 n_kv]; w_o [L, P, q_dim, 48]; w_gu [L, P, d, 48] (gate|up columns); w_down
[L, P, ffn, 48]. The pools [L, KV, NB, bs, hd] are aliased to the outputs (donate them). A block
id outside the pool, a context longer than its table or a negative write index is a run-time error
(XlaRuntimeError), never a stray read or write.

Contract: float32, forward only, one CPU device (a custom call is not partitioned). The library is
compiled on first use (_build.py: checksummed, rebuilt when corrupt, $CXX honoured); `available()`
says whether it could be, and why not; `library_status()` what this process loaded;
`cached_libraries()` / `clear_cached_libraries()` list and delete the cached builds.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _build
from ._build import cached_libraries, clear_cached_libraries, library_status  # noqa: F401  (cache info / clear, /health)

PANEL = 48
DECODER_WEIGHTS = ("attn_norm", "mlp_norm", "w_qkv", "b_qkv", "w_o", "w_gu", "w_down")


def unavailable_reason() -> str:
    """"" when the native ops can run here, else why not."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    return _build.load()


def available() -> bool:
    return unavailable_reason() == ""


def _require():
    why = unavailable_reason()
    if why:
        raise RuntimeError(f"native CPU decode is unavailable: {why}")


def pack_panels(w):
    """w [..., K, N] -> [..., P, K, 48] float32: column panel p holds columns [48p, 48p + 48) (zero past N)."""
    w = jnp.asarray(w, jnp.float32)
    K, N = w.shape[-2:]
    P = -(-N // PANEL)
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, P * PANEL - N)])
    return jnp.swapaxes(w.reshape(*w.shape[:-1], P, PANEL), -3, -2)


def _check_packed(wp, K, n, what):
    if wp.dtype != jnp.float32 or wp.ndim < 3 or wp.shape[-1] != PANEL or wp.shape[-2] != K \
            or wp.shape[-3] != -(-n // PANEL):
        raise ValueError(f"{what}: expected packed float32 [..., {-(-n // PANEL)}, {K}, {PANEL}], got "
                         f"{wp.dtype}{list(wp.shape)}")


def packed_matmul(x, w_packed, n: int, layer=None):
    """x [..., K] float32 @ W [K, n] (given as pack_panels(W) [P, K, 48]) -> [..., n] float32. With
    `layer` (an int32 scalar, e.g. a scan's index), w_packed is a stack [L, P, K, 48] and W is its
    matrix `layer`, read in place (no copy of the layer's slice); out of [0, L) is a run-time error."""
    _require()
    if x.dtype != jnp.float32:
        raise TypeError(f"packed_matmul is float32 only, got {x.dtype}")
    K = x.shape[-1]
    _check_packed(w_packed, K, n, "packed_matmul")
    if w_packed.ndim != (3 if layer is None else 4):
        raise ValueError(f"packed_matmul takes one packed matrix [P, K, {PANEL}] (or a stack [L, P, K, {PANEL}] "
                         f"with a layer), got {w_packed.shape} and layer={layer!r}")
    x2 = x.reshape(-1, K)
    y = jax.ffi.ffi_call("preft_packed_matmul", jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))(
        x2, w_packed, jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()))
    return y.reshape(*x.shape[:-1], n)


def packed_matmul_reference(x, w_packed, n: int, layer=None):
    """The same contract in plain jnp: unpack, then a float32 matmul at highest precision."""
    if layer is not None:
        w_packed = jax.lax.dynamic_index_in_dim(w_packed, jnp.asarray(layer, jnp.int32), 0, keepdims=False)
    P, K, _ = w_packed.shape
    w = jnp.swapaxes(w_packed, 0, 1).reshape(K, P * PANEL)[:, :n]
    return jnp.einsum("...k,kn->...n", x, w, precision=jax.lax.Precision.HIGHEST)


def pack_decoder(p: dict) -> dict:
    """Stacked layer weights (preft_jax layout: wq [L, d, q_dim], ..., w_down [L, ffn, d], norms [L, d],
    optional bq/bk/bv [L, n]) -> the packed `weights` of decode_step."""
    L = p["wq"].shape[0]
    qkv = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=-1).astype(jnp.float32)
    bias = [p.get(b, jnp.zeros((L, p[w].shape[-1]), jnp.float32)) for b, w in (("bq", "wq"), ("bk", "wk"), ("bv", "wv"))]
    return {"attn_norm": jnp.asarray(p["attn_norm"], jnp.float32), "mlp_norm": jnp.asarray(p["mlp_norm"], jnp.float32),
            "w_qkv": pack_panels(qkv), "b_qkv": jnp.concatenate(bias, axis=-1).astype(jnp.float32),
            "w_o": pack_panels(p["wo"]), "w_gu": pack_panels(jnp.concatenate([p["w_gate"], p["w_up"]], axis=-1)),
            "w_down": pack_panels(p["w_down"])}


def decode_step(h, block_tables, context_lens, chunk_lens, write_index, inv_freq, weights: dict, final_norm,
                lm_head, vocab_size: int, k_pool, v_pool, eps: float):
    """See the module docstring. h [M, d] float32 (the rows' embedded tokens); block_tables int32
    [M, nb]; context_lens, chunk_lens, write_index int32 [M]; inv_freq [head_dim // 2]; final_norm
    [d]; lm_head pack_panels(W [d, V]) with V = vocab_size. Returns (logits [M, V] float32, greedy int32 [M], k_pool,
    v_pool); greedy[r] is the first maximal logit of row r (a NaN counts as the maximum, as jnp.argmax)."""
    _require()
    missing = set(DECODER_WEIGHTS) - set(weights)
    if missing:
        raise ValueError(f"decode_step: missing packed weights {sorted(missing)}")
    if h.dtype != jnp.float32 or k_pool.dtype != jnp.float32 or v_pool.dtype != jnp.float32:
        raise TypeError(f"decode_step is float32 only, got h {h.dtype}, pools {k_pool.dtype}/{v_pool.dtype}")
    _check_packed(lm_head, h.shape[-1], vocab_size, "decode_step lm_head")
    M = h.shape[0]
    i32 = lambda a: jnp.asarray(a, jnp.int32)                                   # noqa: E731
    out = (jax.ShapeDtypeStruct((M, vocab_size), jnp.float32), jax.ShapeDtypeStruct((M,), jnp.int32),
           jax.ShapeDtypeStruct(k_pool.shape, jnp.float32), jax.ShapeDtypeStruct(v_pool.shape, jnp.float32))
    call = jax.ffi.ffi_call("preft_decode_step", out, input_output_aliases={15: 2, 16: 3})
    return call(
        h, i32(block_tables), i32(context_lens).reshape(-1), i32(chunk_lens).reshape(-1),
        i32(write_index).reshape(-1), jnp.asarray(inv_freq, jnp.float32), *(weights[k] for k in DECODER_WEIGHTS),
        jnp.asarray(final_norm, jnp.float32), lm_head, k_pool, v_pool, eps=np.float32(eps))
