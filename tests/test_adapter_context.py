"""AdapterContext: every backend x layout equals a float64 numpy reference (forward, f32 and bf16) and the
jnp gather (gradients); random group sizes incl. empty slots; slot isolation under NaN/Inf weights;
backend resolution and the Pallas -> xla fallback."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.adapters import apply, context
from preft_jax.adapters.context import AdapterContext, pallas_lowers_on, resolve_backend

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

N, T, D_IN, D_OUT, R = 6, 40, 32, 24, 4
CASES = [("jnp", "gather"), ("jnp", "grouped"), ("xla", "gather"), ("xla", "grouped"),
         ("pallas", "gather"), ("pallas", "grouped")]
IDS = [f"{b}-{m}" for b, m in CASES]


def _slots(seed, t=T, used=(0, 1, 3, 5)):
    """Random slot per token from `used` (slots 2 and 4 empty), not sorted."""
    return np.random.default_rng(seed).choice(np.asarray(used), t).astype(np.int32)


def _lora_weights(seed, n=N, dtype=np.float32):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((n, D_IN, R)).astype(dtype) * 0.5
    B = rng.standard_normal((n, R, D_OUT)).astype(dtype) * 0.5
    return A, B


def _reft_weights(seed, n=N, d=D_IN):
    rng = np.random.default_rng(seed)
    Rm = rng.standard_normal((n, R, d)).astype(np.float32) * 0.3
    W = rng.standard_normal((n, R, d)).astype(np.float32) * 0.3
    b = rng.standard_normal((n, R)).astype(np.float32)
    sub = (np.arange(n) % 2).astype(np.float32)            # LoReFT and DiReFT slots mixed
    return Rm, W, b, sub


def _lora_ref(x, A, B, slots):
    x, A, B = (np.asarray(a, np.float64) for a in (x, A, B))
    return np.stack([x[t] @ A[g] @ B[g] for t, g in enumerate(slots)])


def _reft_ref(h, Rm, W, b, sub, slots):
    h, Rm, W, b, sub = (np.asarray(a, np.float64) for a in (h, Rm, W, b, sub))
    return np.stack([h[t] + Rm[g].T @ (W[g] @ h[t] + b[g] - sub[g] * Rm[g] @ h[t]) for t, g in enumerate(slots)])


def _ctx(slots, backend, mode, n=N):
    return AdapterContext.build(jnp.asarray(slots)[None], n, backend, mode)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend,mode", CASES, ids=IDS)
def test_lora_matches_float64_reference(backend, mode, dtype):
    slots = _slots(0)
    A, B = _lora_weights(1)
    x = np.random.default_rng(2).standard_normal((T, D_IN)).astype(np.float32)
    for n in (N, 3):
        s = np.minimum(slots, n - 1)
        got = _ctx(s, backend, mode, n).lora(jnp.asarray(x, dtype), jnp.asarray(A[:n], dtype), jnp.asarray(B[:n], dtype))
        assert got.dtype == jnp.dtype(dtype) and got.shape == (T, D_OUT)
        want = _lora_ref(np.asarray(jnp.asarray(x, dtype), np.float32), np.asarray(jnp.asarray(A[:n], dtype), np.float32),
                         np.asarray(jnp.asarray(B[:n], dtype), np.float32), s)
        tol = 1e-5 if dtype == "float32" else 2e-2       # bf16: the rounded shrink + bf16 output
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("n", [context.MASKED_MAX_SLOTS, context.MASKED_MAX_SLOTS + 1])
def test_jnp_chunks_masked_and_gather_sides_of_the_bank_size_switch(n):
    """jnp chunks: up to MASKED_MAX_SLOTS slots the masked dense product, above it the gather; both
    equal the float64 reference (tokens spread over many slots, some empty)."""
    rng = np.random.default_rng(20 + n)
    slots = rng.choice(np.arange(0, n, 3), T).astype(np.int32)
    A, B = _lora_weights(21, n)
    x = rng.standard_normal((T, D_IN)).astype(np.float32)
    got = _ctx(slots, "jnp", "grouped", n).lora(jnp.asarray(x), jnp.asarray(A), jnp.asarray(B))
    want = _lora_ref(x, A, B, slots)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend,mode", CASES, ids=IDS)
def test_reft_matches_float64_reference(backend, mode, dtype):
    slots = _slots(3)
    Rm, W, b, sub = _reft_weights(4)
    h = np.random.default_rng(5).standard_normal((T, D_IN)).astype(np.float32)
    args = [jnp.asarray(a, dtype) for a in (h, Rm, W, b)] + [jnp.asarray(sub)]
    got = _ctx(slots, backend, mode).reft(*args)
    assert got.dtype == jnp.dtype(dtype)
    want = _reft_ref(*(np.asarray(a, np.float32) for a in args), slots)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("backend,mode", CASES, ids=IDS)
def test_gradients_match_gather(backend, mode):
    """d/d(x, A, B) and d/d(h, R, W, b) of a weighted sum equal those of the plain per-token gather."""
    slots = jnp.asarray(_slots(6))
    A, B = (jnp.asarray(a) for a in _lora_weights(7))
    Rm, W, b, sub = (jnp.asarray(a) for a in _reft_weights(8))
    x = jnp.asarray(np.random.default_rng(9).standard_normal((T, D_IN)), jnp.float32)
    wy = jnp.asarray(np.random.default_rng(10).standard_normal((T, D_OUT)), jnp.float32)
    wh = jnp.asarray(np.random.default_rng(11).standard_normal((T, D_IN)), jnp.float32)
    ctx = _ctx(slots, backend, mode)

    def loss(fl, fr, x, A, B, Rm, W, b):
        return jnp.sum(fl(x, A, B) * wy) + jnp.sum(fr(x, Rm, W, b, sub) * wh)

    args = (x, A, B, Rm, W, b)
    got = jax.jit(jax.grad(lambda *a: loss(ctx.lora, ctx.reft, *a), argnums=tuple(range(6))))(*args)
    want = jax.grad(lambda *a: loss(lambda x, A, B: apply.lora_gather(x, A, B, slots),
                                    lambda h, Rm, W, b, s: apply.reft_gather(h, Rm, W, b, s, slots), *a),
                    argnums=tuple(range(6)))(*args)
    for name, g, w in zip(("x", "A", "B", "R", "W", "b"), got, want):
        w = np.asarray(w)
        assert np.abs(w).max() > 0, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg=name)
    assert np.all(np.asarray(got[1])[[2, 4]] == 0)        # empty slots get no gradient


@pytest.mark.parametrize("backend,mode", CASES, ids=IDS)
def test_bad_slot_cannot_reach_other_rows(backend, mode):
    """NaN/Inf weights in slot 2 leave every row of another slot bitwise unchanged (LoRA and ReFT)."""
    slots = _slots(12, used=(0, 1, 2, 3))
    A, B = _lora_weights(13)
    Rm, W, b, sub = _reft_weights(14)
    x = jnp.asarray(np.random.default_rng(15).standard_normal((T, D_IN)), jnp.float32)
    bad = lambda w, v: np.concatenate([w[:2], np.full_like(w[2:3], v), w[3:]])
    for n in (N, 4):
        s = np.minimum(slots, n - 1)
        ctx, other = _ctx(s, backend, mode, n), s != 2
        clean_l = np.asarray(ctx.lora(x, jnp.asarray(A[:n]), jnp.asarray(B[:n])))
        dirty_l = np.asarray(ctx.lora(x, jnp.asarray(bad(A[:n], np.nan)), jnp.asarray(bad(B[:n], np.inf))))
        np.testing.assert_array_equal(dirty_l[other], clean_l[other])
        assert not np.isfinite(dirty_l[~other]).any()
        rargs = [jnp.asarray(a[:n]) for a in (Rm, W, b, sub)]
        clean_r = np.asarray(ctx.reft(x, *rargs))
        rargs[0] = jnp.asarray(bad(Rm[:n], np.inf))
        rargs[2] = jnp.asarray(bad(b[:n], np.nan))
        dirty_r = np.asarray(ctx.reft(x, *rargs))
        np.testing.assert_array_equal(dirty_r[other], clean_r[other])
        assert not np.isfinite(dirty_r[~other]).all()


def test_layout_built_once_and_mode_inference():
    s2 = jnp.asarray([[1, 0, 2], [2, 2, 0]])
    ctx = AdapterContext.build(s2, 3, "xla")
    assert ctx.mode == "grouped" and ctx.num_tokens == 6
    assert np.asarray(ctx.group_sizes).tolist() == [2, 1, 3]
    assert np.asarray(ctx.slots)[np.asarray(ctx.order)].tolist() == [0, 0, 1, 2, 2, 2]
    assert np.asarray(ctx.order)[np.asarray(ctx.inverse)].tolist() == list(range(6))
    assert AdapterContext.build(s2[:, :1], 3, "xla").mode == "gather"
    assert AdapterContext.build(s2, 3, "jnp").order is None           # jnp needs no layout
    leaves = jax.tree.leaves(ctx)                                       # a pytree: backend/mode/n static
    assert all(isinstance(x, jax.Array) for x in leaves)
    with pytest.raises(ValueError, match="has 4 tokens"):
        ctx.lora(jnp.zeros((4, 8)), jnp.zeros((3, 8, 2)), jnp.zeros((3, 2, 8)))
    with pytest.raises(ValueError, match="built for 3"):
        ctx.lora(jnp.zeros((6, 8)), jnp.zeros((4, 8, 2)), jnp.zeros((4, 2, 8)))
    with pytest.raises(ValueError, match="float16 is not supported; supported: float32, bfloat16"):
        ctx.lora(jnp.zeros((6, 8), jnp.float16), jnp.zeros((3, 8, 2), jnp.float16), jnp.zeros((3, 2, 8), jnp.float16))
    with pytest.raises(ValueError, match="mode must be one of"):
        AdapterContext.build(s2, 3, "xla", "dense")


def test_backend_resolution():
    with pytest.raises(ValueError, match=r"one of \('auto', 'jnp', 'xla', 'pallas'\)"):
        resolve_backend("cuda")
    assert resolve_backend("auto", "cpu") == "jnp"
    assert resolve_backend("pallas", "cpu") == "pallas"            # interpret mode
    assert pallas_lowers_on("tpu")                                  # Mosaic TPU lowering, probed on this CPU
    assert resolve_backend("auto", "tpu") == "pallas"
    assert pallas_lowers_on("gpu")                                  # the Triton variants lower for cuda
    assert resolve_backend("auto", "gpu") == "pallas"


def test_pallas_tiling_error_falls_back_to_xla_once(monkeypatch):
    import pallas_kernels
    def refuse(*a, **k):
        raise pallas_kernels.TilingError("lora_sgmv", "tpu", "block_tokens 12 does not tile", "use a multiple of 8")

    monkeypatch.setattr(pallas_kernels, "lora_sgmv", refuse)
    monkeypatch.setattr(pallas_kernels, "reft_apply", refuse)
    monkeypatch.setattr(context, "_warned", set())
    slots = _slots(16)
    A, B = (jnp.asarray(a) for a in _lora_weights(17))
    Rm, W, b, sub = (jnp.asarray(a) for a in _reft_weights(18))
    x = jnp.asarray(np.random.default_rng(19).standard_normal((T, D_IN)), jnp.float32)
    ctx = _ctx(slots, "pallas", "grouped")
    with pytest.warns(RuntimeWarning, match="cannot tile"):
        got = ctx.lora(x, A, B)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_ctx(slots, "xla", "grouped").lora(x, A, B)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx.lora(x, A, B)                                          # same shapes: no second warning
    with pytest.warns(RuntimeWarning, match="reft_apply"):
        got = ctx.reft(x, Rm, W, b, sub)
    np.testing.assert_allclose(np.asarray(got), _reft_ref(x, Rm, W, b, sub, slots), rtol=1e-5, atol=1e-5)


# ---- rows layout (chunks whose rows each hold one adapter: the engines' prefill, training) ------
ROWS, COLS = 5, 8


def _rows_weights(seed, n):
    """LoRA weights with slot 0 the base (zeros), as in every bank."""
    A, B = _lora_weights(seed, n)
    A[0], B[0] = 0, 0
    return A, B


def _row_case(seed, n):
    """Row slots (row 1 a base request), and per token the row's slot or 0 (a first/last-k window)."""
    rng = np.random.default_rng(seed)
    row_slots = rng.integers(1, n, ROWS).astype(np.int32)
    row_slots[1] = 0
    covered = rng.random((ROWS, COLS)) < 0.7
    return row_slots, np.where(covered, row_slots[:, None], 0).astype(np.int32)


def test_rows_mode_inference():
    row_slots, tok = _row_case(30, 9)
    build = lambda n, backend="jnp", t=tok: AdapterContext.build(jnp.asarray(np.minimum(t, n - 1)), n, backend,
                                                                 row_slots=np.minimum(row_slots, n - 1))
    assert build(context.ROWS_MASKED_MAX_SLOTS + 1).mode == "rows"
    assert build(context.ROWS_MASKED_MAX_SLOTS).mode == "grouped"             # small banks: the masked product
    assert build(9, "xla").mode == "grouped"                           # other backends group by slot
    assert build(9, t=tok[:, :1]).mode == "gather"                     # decode
    assert AdapterContext.build(jnp.asarray(tok), 9, "jnp").mode == "grouped"   # no row_slots: no rows layout
    with pytest.raises(ValueError, match="'rows' is the jnp backend's layout"):
        AdapterContext.build(jnp.asarray(tok), 9, "xla", "rows", row_slots)
    with pytest.raises(ValueError, match=r"needs token_slots \[B, T\] and row_slots \[B\]"):
        AdapterContext.build(jnp.asarray(tok), 9, "jnp", "rows", row_slots[:3])
    with pytest.raises(ValueError, match=r"needs token_slots \[B, T\] and row_slots \[B\]"):
        AdapterContext.build(jnp.asarray(tok), 9, "jnp", "rows")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [context.ROWS_MASKED_MAX_SLOTS + 1, 40])
def test_rows_lora_matches_float64_reference(n, dtype):
    row_slots, tok = _row_case(31 + n, n)
    A, B = _rows_weights(32, n)
    x = np.random.default_rng(33).standard_normal((ROWS, COLS, D_IN)).astype(np.float32)
    ctx = AdapterContext.build(jnp.asarray(tok), n, "jnp", row_slots=row_slots)
    assert ctx.mode == "rows"
    xd, Ad, Bd = (jnp.asarray(a, dtype) for a in (x, A, B))
    got = ctx.lora(xd, Ad, Bd)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (ROWS, COLS, D_OUT)
    want = _lora_ref(*(np.asarray(a, np.float32) for a in (xd.reshape(-1, D_IN), Ad, Bd)), tok.reshape(-1))
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32).reshape(-1, D_OUT), want, rtol=tol,
                               atol=tol * np.abs(want).max())
    assert np.all(np.asarray(got, np.float32).reshape(-1, D_OUT)[tok.reshape(-1) == 0] == 0)


def test_rows_gradients_match_gather():
    n = 9
    row_slots, tok = _row_case(34, n)
    slots = jnp.asarray(tok.reshape(-1))
    A, B = (jnp.asarray(a) for a in _rows_weights(35, n))
    x = jnp.asarray(np.random.default_rng(36).standard_normal((ROWS * COLS, D_IN)), jnp.float32)
    wy = jnp.asarray(np.random.default_rng(37).standard_normal((ROWS * COLS, D_OUT)), jnp.float32)
    ctx = AdapterContext.build(jnp.asarray(tok), n, "jnp", row_slots=row_slots)
    got = jax.jit(jax.grad(lambda x, A, B: jnp.sum(ctx.lora(x, A, B) * wy), argnums=(0, 1, 2)))(x, A, B)
    want = jax.grad(lambda x, A, B: jnp.sum(apply.lora_gather(x, A, B, slots) * wy), argnums=(0, 1, 2))(x, A, B)
    for name, g, w in zip(("x", "A", "B"), got, want):
        w = np.asarray(w)
        assert np.abs(w).max() > 0, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg=name)
    unused = np.setdiff1d(np.arange(n), row_slots)
    assert unused.size and np.all(np.asarray(got[1])[unused] == 0)


def test_rows_bad_slot_cannot_reach_other_rows_and_a_foreign_slot_is_loud():
    n = 9
    row_slots, tok = _row_case(38, n)
    row_slots[0] = row_slots[3] = 2
    tok = np.where(tok > 0, row_slots[:, None], 0).astype(np.int32)
    A, B = _rows_weights(39, n)
    x = jnp.asarray(np.random.default_rng(40).standard_normal((ROWS * COLS, D_IN)), jnp.float32)
    ctx = AdapterContext.build(jnp.asarray(tok), n, "jnp", row_slots=row_slots)
    clean = np.asarray(ctx.lora(x, jnp.asarray(A), jnp.asarray(B)))
    A2, B2 = A.copy(), B.copy()
    A2[2], B2[2] = np.nan, np.inf
    dirty = np.asarray(ctx.lora(x, jnp.asarray(A2), jnp.asarray(B2)))
    flat = tok.reshape(-1)
    np.testing.assert_array_equal(dirty[flat != 2], clean[flat != 2])   # other rows, and slot 2's base tokens
    assert not np.isfinite(dirty[flat == 2]).any()
    foreign = tok.copy()
    foreign[4, 0] = 1 if row_slots[4] != 1 else 3                      # breaks the one-adapter-per-row contract
    out = np.asarray(AdapterContext.build(jnp.asarray(foreign), n, "jnp", row_slots=row_slots).lora(
        x, jnp.asarray(A), jnp.asarray(B)))
    assert np.isnan(out[4 * COLS]).all()
    np.testing.assert_array_equal(out[4 * COLS + 1:], clean[4 * COLS + 1:])
