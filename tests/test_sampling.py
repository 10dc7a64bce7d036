"""preft_jax.sampling.sample: every path (greedy, plain, top-k/top-p from the top candidates, the
full-sort fallback) draws from the filtered softmax computed independently in float64 numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax import sampling
from preft_jax.sampling import sample


def _reference_probs(logits, t, p, k):
    """float64: softmax(logits / t) on the top-k tokens and the top-p nucleus (ties with the last kept kept)."""
    x = np.asarray(logits, np.float64) / t
    order = np.argsort(-x, kind="stable")
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    cum_before = np.cumsum(probs[order]) - probs[order]
    keep = cum_before < p
    if k > 0:
        keep &= np.arange(len(x)) < k
    threshold = x[order][keep].min()
    kept = x >= threshold
    out = np.where(kept, probs, 0.0)
    return out / out.sum()


def _frequencies(logits, t, p, k, n=4000):
    B, V = n, logits.shape[0]
    f = jax.jit(sample)
    out = f(jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (B, V)), jax.random.key(3), jnp.full(B, t),
            jnp.full(B, p), jnp.full(B, k, jnp.int32))
    return np.bincount(np.asarray(out), minlength=V) / B


@pytest.mark.parametrize("t,p,k", [(1.0, 1.0, 0), (0.7, 1.0, 3), (1.3, 0.8, 0), (1.0, 0.6, 4), (2.0, 0.95, 0)])
def test_draws_follow_the_filtered_softmax(t, p, k):
    logits = np.random.default_rng(0).normal(0, 1.5, 12)
    want = _reference_probs(logits, t, p, k)
    got = _frequencies(logits, t, p, k)
    assert np.all(got[want == 0] == 0)                       # filtered tokens are never drawn
    assert np.abs(got - want).max() < 0.035                  # 4000 draws: ~4 sigma


def test_mixed_rows_and_the_sort_fallback(monkeypatch):
    rng = np.random.default_rng(1)
    V = 40
    logits = rng.normal(0, 0.3, (4, V)).astype(np.float32)   # flat: the 0.95 nucleus is ~36 tokens wide
    temp = jnp.asarray([0.0, 1.0, 1.0, 0.5])
    top_p = jnp.asarray([1.0, 0.95, 1.0, 1.0])
    top_k = jnp.asarray([0, 0, 0, 2], jnp.int32)
    monkeypatch.setattr(sampling, "CANDIDATES", 8)          # force the full-sort fallback for row 1
    f = jax.jit(lambda k: sample(jnp.asarray(logits), k, temp, top_p, top_k))
    draws = np.stack([np.asarray(f(jax.random.key(i))) for i in range(300)])
    assert np.all(draws[:, 0] == logits[0].argmax())         # greedy row untouched by the others
    for row, (t, p, k) in ((1, (1.0, 0.95, 0)), (3, (0.5, 1.0, 2))):
        allowed = np.flatnonzero(_reference_probs(logits[row], t, p, k) > 0)
        assert set(draws[:, row]) <= set(allowed)
    assert set(draws[:, 3]) == set(np.argsort(-logits[3])[:2])
    assert len(set(draws[:, 2])) > 10                        # plain sampling row explores the vocab


def test_greedy_batch_is_argmax_and_keys_matter():
    logits = jax.random.normal(jax.random.key(0), (5, 100))
    z = jnp.zeros(5)
    assert np.array_equal(sample(logits, jax.random.key(0), z, jnp.ones(5)), np.argmax(logits, -1))
    a = sample(logits, jax.random.key(1), jnp.ones(5), jnp.ones(5))
    b = sample(logits, jax.random.key(2), jnp.ones(5), jnp.ones(5))
    c = sample(logits, jax.random.key(1), jnp.ones(5), jnp.ones(5))
    assert np.array_equal(a, c) and not np.array_equal(a, b)
