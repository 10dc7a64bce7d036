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


@pytest.mark.parametrize("fallback", [False, True])
def test_top_p_below_float32_range_keeps_the_top_token(monkeypatch, fallback):
    """A top_p that SamplingParams accepts (a float64 in (0, 1]) but float32 holds as 0 (1e-40, 1e-300)
    keeps the top token, as any tiny nucleus does: the draw is the argmax (the float64 reference
    keeps one token), never the all-masked row's token 0. A batch mate is unaffected."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1.0, (3, 64)).astype(np.float32)
    logits[:, 0] = -5.0                                      # token 0 is never the argmax
    if fallback:
        monkeypatch.setattr(sampling, "CANDIDATES", 1)       # the full-sort path
    for p in (1e-40, 1e-300, 1e-7):
        assert np.flatnonzero(_reference_probs(logits[0], 1.0, p, 0) > 0).tolist() == [int(logits[0].argmax())]
        top_p = jnp.asarray([p, p, 1.0])
        f = jax.jit(lambda k: sample(jnp.asarray(logits), k, jnp.ones(3), top_p, jnp.zeros(3, jnp.int32)))
        draws = np.stack([np.asarray(f(jax.random.key(i))) for i in range(20)])
        assert np.all(draws[:, :2] == logits[:2].argmax(-1)), (p, draws[:3])
        assert len(set(draws[:, 2])) > 3                     # the plain row still samples


def test_greedy_batch_is_argmax_and_keys_matter():
    logits = jax.random.normal(jax.random.key(0), (5, 100))
    z = jnp.zeros(5)
    assert np.array_equal(sample(logits, jax.random.key(0), z, jnp.ones(5)), np.argmax(logits, -1))
    a = sample(logits, jax.random.key(1), jnp.ones(5), jnp.ones(5))
    b = sample(logits, jax.random.key(2), jnp.ones(5), jnp.ones(5))
    c = sample(logits, jax.random.key(1), jnp.ones(5), jnp.ones(5))
    assert np.array_equal(a, c) and not np.array_equal(a, b)


def test_per_row_keys_follow_the_filtered_softmax_and_ignore_batch_mates():
    """Rows keyed per request (row_keys): a row's draw depends on its key and token index only, and
    over many keys the draws still follow the float64 filtered softmax."""
    from preft_jax.sampling import row_keys, seed_key_data
    logits = np.random.default_rng(0).normal(0, 1.5, 12)
    t, p, k, B = 0.9, 0.9, 5, 4000
    kd = np.stack([seed_key_data(s) for s in range(B)])
    f = jax.jit(lambda lg, kd, c: sample(lg, row_keys(kd, c), jnp.full(B, t), jnp.full(B, p), jnp.full(B, k, jnp.int32)))
    out = np.asarray(f(jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (B, 12)), kd, np.zeros(B, np.int32)))
    want = _reference_probs(logits, t, p, k)
    got = np.bincount(out, minlength=12) / B
    assert np.all(got[want == 0] == 0) and np.abs(got - want).max() < 0.035
    # row 0 alone == row 0 among other rows (other logits, other keys, other settings)
    rng = np.random.default_rng(1)
    mates = rng.normal(0, 1, (5, 12)).astype(np.float32)
    mates[0] = logits
    kd5, ctr = np.stack([seed_key_data(7, i) for i in range(5)]), np.arange(5, dtype=np.int32) + 3
    temps, ps, ks = jnp.asarray([1.0, 0.0, 2.0, 0.5, 1.0]), jnp.asarray([0.9, 1, 1, 0.5, 1]), jnp.asarray([0, 0, 3, 0, 0])
    js = jax.jit(sample)          # compiled per shape: eager, each call retraces its lax.cond branches
    together = np.asarray(js(jnp.asarray(mates), row_keys(kd5, ctr), temps, ps, ks))
    for r in range(5):
        alone = js(jnp.asarray(mates[r:r + 1]), row_keys(kd5[r:r + 1], ctr[r:r + 1]), temps[r:r + 1],
                       ps[r:r + 1], ks[r:r + 1])
        assert int(alone[0]) == together[r]
    # another token index or another seed is another draw (over 64 draws, not all equal)
    a = [int(js(jnp.asarray(logits[None], jnp.float32), row_keys(seed_key_data(7)[None], np.asarray([i])),
                jnp.ones(1), jnp.ones(1))[0]) for i in range(64)]
    assert len(set(a)) > 1


def test_token_logprobs_match_float64_log_softmax():
    from preft_jax.sampling import MAX_TOP_LOGPROBS, token_logprobs
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (3, 50)).astype(np.float32)
    tokens = np.asarray([4, 17, 49])
    lp, vals, ids = (np.asarray(x) for x in token_logprobs(jnp.asarray(logits), jnp.asarray(tokens)))
    x = logits.astype(np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(3), tokens], atol=1e-5)
    order = np.argsort(-ref, axis=-1)[:, :MAX_TOP_LOGPROBS]
    np.testing.assert_array_equal(ids, order)
    np.testing.assert_allclose(vals, np.take_along_axis(ref, order, -1), atol=1e-5)
