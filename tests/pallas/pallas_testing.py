"""Helpers for the Pallas kernel tests: random inputs and group layouts, float64 numpy references
(forward and analytic gradients), jitted value-and-grad, tolerance checks.

Tolerances are relative to the largest magnitude of the float64 reference:
  float32 inputs  |kernel - ref| <= 1e-4 * max|ref|
  bfloat16 inputs |kernel - ref| <= 3e-2 * max|ref|   (bf16 inputs, bf16 outputs, the rank-r
                  intermediate rounded to bf16 before the second matmul, f32 accumulation)
"""
import jax
import jax.numpy as jnp
import numpy as np

TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 3e-2}

# slot sizes per group case; every case has empty slots except "one_token_per_slot"
GROUP_CASES = {
    "random_with_empty": lambda rng: _random_sizes(rng, 7, 45),
    "one_slot_all_tokens": lambda rng: np.array([0, 0, 33, 0]),
    "one_token_per_slot": lambda rng: np.ones(12, np.int64),
}


def _random_sizes(rng, n, total):
    sizes = rng.multinomial(total, rng.dirichlet(np.ones(n)))
    sizes[rng.choice(n, size=2, replace=False)] = 0          # at least two empty slots
    sizes[0] += total - sizes.sum()
    return sizes


def group_idx(seed, case):
    """int32 [T] slot ids (shuffled) with the slot sizes of GROUP_CASES[case]."""
    rng = np.random.default_rng(seed)
    sizes = GROUP_CASES[case](rng)
    idx = np.repeat(np.arange(len(sizes)), sizes)
    return jnp.asarray(rng.permutation(idx), jnp.int32), len(sizes)


def rand(seed, shape, dtype=jnp.float32, scale=1.0):
    """Non-zero standard-normal array (exactly representable in dtype)."""
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(x, jnp.float32).astype(dtype)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def value_and_grads(fn, args, weights):
    """(output, grads wrt all args) of sum(fn(*args) * weights), jitted."""
    def loss(*a):
        y = fn(*a)
        return jnp.sum(y.astype(jnp.float32) * weights), y
    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                           has_aux=True))(*args)
    return y, g


def close(actual, expected, tol):
    actual, expected = f64(actual), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(np.abs(expected).max(initial=0.0), 1e-30)
    err = np.abs(actual - expected).max(initial=0.0)
    assert err <= tol * scale, f"max error {err:.3g} > {tol} * max|ref| {scale:.3g}"


def lora_np(x, A, B, idx, w):
    """float64 (y, dx, dA, dB) of loss = sum(y * w), y[t] = x[t] A[g] B[g]."""
    x, A, B, w = f64(x), f64(A), f64(B), f64(w)
    g = np.asarray(idx)
    xa = np.einsum("td,tdr->tr", x, A[g])
    y = np.einsum("tr,tro->to", xa, B[g])
    dxa = np.einsum("to,tro->tr", w, B[g])
    dx = np.einsum("tr,tdr->td", dxa, A[g])
    dA, dB = np.zeros_like(A), np.zeros_like(B)
    np.add.at(dA, g, x[:, :, None] * dxa[:, None, :])
    np.add.at(dB, g, xa[:, :, None] * w[:, None, :])
    return y, dx, dA, dB


def reft_np(h, R, W, b, s, idx, w):
    """float64 (out, dh, dR, dW, db) of loss = sum(out * w),
    out[t] = h[t] + R[g]^T (W[g] h[t] + b[g] - s[g] R[g] h[t])."""
    h, R, W, b, s, w = f64(h), f64(R), f64(W), f64(b), f64(s), f64(w)
    g = np.asarray(idx)
    M = W - s[:, None, None] * R
    u = np.einsum("trd,td->tr", M[g], h) + b[g]
    out = h + np.einsum("tr,trd->td", u, R[g])
    v = np.einsum("td,trd->tr", w, R[g])
    dh = w + np.einsum("tr,trd->td", v, M[g])
    dR, dM, db = np.zeros_like(R), np.zeros_like(R), np.zeros_like(b)
    np.add.at(dR, g, u[:, :, None] * w[:, None, :])
    np.add.at(dM, g, v[:, :, None] * h[:, None, :])
    np.add.at(db, g, v)
    return out, dh, dR - s[:, None, None] * dM, dM, db


def check_against_np(fn, args, weights, ref):
    """fn's output and gradients (wrt all args) equal the float64 reference; returns them."""
    y, grads = value_and_grads(fn, args, weights)
    tol = TOL[jnp.dtype(args[0].dtype)]
    assert y.dtype == args[0].dtype
    close(y, ref[0], tol)
    for gi, a, r in zip(grads, args, ref[1:]):
        assert gi.dtype == a.dtype and gi.shape == a.shape
        close(gi, r, tol)
    return y, grads
