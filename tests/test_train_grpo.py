"""GRPO: advantages, clipped surrogate and k3 KL against hand computations; rollouts through the
serving generate path; one update in each mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.adapters.trainable import adapter_bank
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params
from train.common import token_logprobs
from train.config import AdapterSpec, OptimizerConfig
from train.grpo import GRPOConfig, GRPOTrainer, group_advantages, grpo_objective, k3_kl

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))


def test_group_advantages_by_hand():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0]])
    got = np.asarray(group_advantages(r, eps=1e-4))
    for i, row in enumerate(r):
        mean = sum(row) / 4
        std = (sum((x - mean) ** 2 for x in row) / 4) ** 0.5
        for j, x in enumerate(row):
            assert got[i, j] == pytest.approx((x - mean) / (std + 1e-4), rel=1e-5, abs=1e-6)
    assert np.all(got[1] == 0)                        # no signal from a group with equal rewards
    np.testing.assert_allclose(got[0], [1, -1, -1, 1], rtol=1e-3)


def test_objective_by_hand():
    rng = np.random.default_rng(0)
    B, T = 4, 6
    old = rng.normal(-2, 0.5, (B, T))
    logp = old + rng.normal(0, 0.4, (B, T))           # ratios both inside and outside [0.8, 1.2]
    ref = old + rng.normal(0, 0.3, (B, T))
    adv = np.array([1.5, -0.7, 0.0, 2.0])
    mask = np.zeros((B, T))
    mask[0, 1:5] = 1
    mask[1, 2:6] = 1
    mask[2, 0:3] = 1                                  # row 3: no response tokens, excluded
    eps, beta = 0.2, 0.1
    loss, m = grpo_objective(*(jnp.asarray(x, jnp.float32) for x in (logp, old, ref, adv, mask)), eps, beta)
    per_seq, n_clip, n_tok, kl_sum = [], 0, 0, 0.0
    for b in range(B):
        toks = [t for t in range(T) if mask[b, t]]
        if not toks:
            continue
        s = 0.0
        for t in toks:
            ratio = np.exp(logp[b, t] - old[b, t])
            surr = min(ratio * adv[b], min(max(ratio, 1 - eps), 1 + eps) * adv[b])
            kl = np.exp(ref[b, t] - logp[b, t]) - (ref[b, t] - logp[b, t]) - 1
            s += -surr + beta * kl
            n_clip += abs(ratio - 1) > eps
            n_tok += 1
            kl_sum += kl
        per_seq.append(s / len(toks))
    assert 0 < n_clip < n_tok
    assert float(loss) == pytest.approx(np.mean(per_seq), rel=1e-5)
    assert float(m["kl"]) == pytest.approx(kl_sum / n_tok, rel=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(n_clip / n_tok, rel=1e-6)


def test_clipping_gradient_and_k3():
    """Outside the clip range in the advantage's direction the surrogate has no gradient."""
    old = jnp.zeros((1, 3))
    mask = jnp.ones((1, 3))
    ref = jnp.zeros((1, 3))
    f = lambda lp, a: grpo_objective(lp, old, ref, a, mask, 0.2, 0.0)[0]
    lp = jnp.log(jnp.array([[1.5, 1.0, 0.5]]))       # ratio 1.5 (clipped if A > 0), 1.0, 0.5 (clipped if A < 0)
    g_pos = np.asarray(jax.grad(f)(lp, jnp.array([1.0])))
    g_neg = np.asarray(jax.grad(f)(lp, jnp.array([-1.0])))
    assert g_pos[0, 0] == 0 and g_pos[0, 1] != 0 and g_pos[0, 2] != 0
    assert g_neg[0, 2] == 0 and g_neg[0, 0] != 0 and g_neg[0, 1] != 0
    # k3: zero at equality, positive otherwise, and an unbiased KL estimate under sampling
    assert float(k3_kl(jnp.float32(-1.0), jnp.float32(-1.0))) == 0.0
    assert float(k3_kl(jnp.float32(-1.0), jnp.float32(-2.0))) > 0
    p = np.array([0.6, 0.3, 0.1])
    q = np.array([0.2, 0.5, 0.3])
    est = sum(p[i] * float(k3_kl(jnp.log(p[i]), jnp.log(q[i]))) for i in range(3))
    assert est == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-5)


def _reward(ids, answer):
    return float(np.mean([t % 2 == 0 for t in ids])) if ids else 0.0


def _prompts(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 200, rng.integers(3, 9))] for _ in range(n)]


GC = dict(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6, optimizer=OptimizerConfig(lr=1e-2),
          temperature=1.0, kl_coef=0.05, inner_steps=2)


@pytest.fixture(scope="module")
def trainers(runner):
    """One trainer per mode, shared (their jitted functions compile once)."""
    return {m: GRPOTrainer(CFG, runner, GRPOConfig(adapter=AdapterSpec(rank=4, mode=m), **GC), _reward,
                           stop_token_ids=(2,))
            for m in ("prefill", "all")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_rollouts_and_one_update(runner, trainers, mode):
    tr = trainers[mode]
    ts = tr.init_state()
    prompts = _prompts()[:2]
    ro = tr.rollout(ts.params, prompts, [0, 0], jax.random.key(3))
    assert len(ro.prompts) == 8 and ro.rewards.shape == (2, 4)
    assert ro.prompts[:4] == [prompts[0]] * 4
    for c, r in zip(ro.completions, ro.responses):
        assert len(c) <= 6 and 2 not in c and r[:len(c)] == c and len(r) - len(c) in (0, 1)
    # the rollouts are ModelRunner.generate: same key -> same samples as ModelRunner.generate directly
    bank = adapter_bank(CFG, tr.adapter_config, ts.params)
    direct = runner.generate(ro.prompts, tr.sampling(), bank, [1] * 8, jax.random.key(3))
    assert [g.tokens for g in direct] == ro.completions

    batch = tr.rollout_batch(ro)
    np.testing.assert_allclose(batch["advantages"], np.asarray(group_advantages(ro.rewards)).reshape(-1), rtol=1e-6)
    old, ref = tr.score(ts.params, batch)
    # at the identity init the policy is the base model: old == ref, ratio 1, KL 0
    np.testing.assert_allclose(np.asarray(old), np.asarray(ref), atol=1e-5)
    lp = token_logprobs(runner.graphdef, runner.state, jnp.asarray(batch["tokens"]),
                        jnp.asarray(batch["prompt_lengths"]))
    np.testing.assert_allclose(np.asarray(ref) * batch["loss_mask"], np.asarray(lp) * batch["loss_mask"],
                               atol=1e-5)
    p0 = jax.tree.map(np.asarray, ts.params)
    ts2, m = tr.update(ts, batch)
    assert int(ts2.step) == 2 and np.isfinite(float(m["loss"]))
    if np.any(batch["advantages"] != 0):
        assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(p0),
                                                                       jax.tree.leaves(ts2.params)))
        assert float(m["kl"]) > 0                 # second inner step: the policy moved off the base


@pytest.mark.slow
def test_prefill_rollout_decodes_on_base(runner, trainers):
    """Prefill mode: rollouts = adapted prefill + base decode (what serving does); all-token decode
    uses the adapter, and gives other samples."""
    prompts = _prompts(2, seed=2)
    key = jax.random.key(5)
    outs = {}
    for mode, tr in trainers.items():
        params = jax.tree.map(lambda x: x + 0.5 * jax.random.normal(jax.random.key(1), x.shape),
                              tr.init_state().params)
        ro = tr.rollout(params, prompts, [0, 0], key)
        bank = adapter_bank(CFG, tr.adapter_config, params)
        rep = ro.prompts
        base_decode = runner.generate(rep, tr.sampling(), bank, [1] * 8, key, decode_with_adapters=False)
        outs[mode] = (ro.completions, [g.tokens for g in base_decode])
    assert outs["prefill"][0] == outs["prefill"][1]
    assert outs["all"][0] != outs["all"][1]


@pytest.mark.slow
def test_fit_logs_rewards(trainers):
    state, hist = trainers["prefill"].fit(_prompts(), [0] * 8)
    assert [h["step"] for h in hist] == [1, 2] and int(state.step) == 2 * GC["inner_steps"]
    assert all(0.0 <= h["reward_mean"] <= 1.0 and np.isfinite(h["loss"]) for h in hist)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_group_generate_equals_repeated_prompts(runner, trainers, mode):
    """generate(group=G) prefills each prompt once and repeats its cache rows: the same samples as
    generating the prompt list repeated G times (group-major)."""
    tr = trainers[mode]
    params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(7), x.shape), tr.init_state().params)
    bank = adapter_bank(CFG, tr.adapter_config, params)
    prompts = _prompts(3, seed=4)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=(2,))
    rep = [p for p in prompts for _ in range(4)]
    want = runner.generate(rep, sp, bank, [1] * 12, jax.random.key(11))
    got = runner.generate(prompts, sp, bank, [1] * 3, jax.random.key(11), group=4)
    assert [(g.tokens, g.finish_reason) for g in got] == [(g.tokens, g.finish_reason) for g in want]
    assert len({tuple(g.tokens) for g in got[:4]}) > 1          # the group's samples differ
    with pytest.raises(ValueError, match="group"):
        runner.generate(prompts, sp, bank, [1] * 3, group=0)


def test_logprobs_start_skips_only_prompt_entries(runner):
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(3, 200, (3, 20)), jnp.int32)
    plen = jnp.asarray([7, 9, 12], jnp.int32)
    full = np.asarray(token_logprobs(runner.graphdef, runner.state, tokens, plen, chunk=8))
    part = np.asarray(token_logprobs(runner.graphdef, runner.state, tokens, plen, chunk=8, start=6))
    np.testing.assert_allclose(part[:, 7:], full[:, 7:], rtol=1e-5, atol=1e-5)
    assert np.all(part[:, :7] == 0) and np.all(full[:, 1:7] != 0)
    with pytest.raises(ValueError, match="start"):
        token_logprobs(runner.graphdef, runner.state, tokens, plen, start=19)


@pytest.mark.slow
def test_one_inner_step_skips_old_pass_same_gradient(runner):
    """inner_steps=1: old = stop_gradient(logp) in the loss gives the loss and gradient of the
    explicit old-policy pass; the batch is trimmed to the step's longest sequence and the vocab
    projection starts at the shortest prompt."""
    tr = GRPOTrainer(CFG, runner, GRPOConfig(adapter=AdapterSpec(rank=4, mode="prefill"),
                                             **{**GC, "inner_steps": 1, "max_new_tokens": 20}), _reward,
                     stop_token_ids=(2,))
    prompts = _prompts()
    tr.bind_data(prompts, [0] * 8)
    assert tr.logit_start == min(len(p) for p in prompts) - 1
    ts = tr.init_state()
    params = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(jax.random.key(2), x.shape), ts.params)
    batch, _, info = tr.next_batch(ts, 0)
    ro = tr.last_rollouts
    longest = max(len(p) + len(r) for p, r in zip(ro.prompts, ro.responses))
    assert batch["tokens"].shape[1] == -(-longest // 16) * 16
    dev = tr.prepare(ts, tr.put_batch(batch))
    assert "old_logp" not in dev
    old, ref = tr.score(params, batch)
    np.testing.assert_allclose(np.asarray(dev["ref_logp"]), np.asarray(ref), atol=1e-6)
    batch_adv = dict(dev, advantages=jnp.asarray([1.0, -1.0] * 4))
    f_fast = lambda p: tr.loss(p, tr.base_state, batch_adv)[0]
    f_old = lambda p: tr.loss(p, tr.base_state, dict(batch_adv, old_logp=old))[0]
    assert float(f_fast(params)) == pytest.approx(float(f_old(params)), rel=1e-5, abs=1e-6)
    g1, g2 = jax.grad(f_fast)(params), jax.grad(f_old)(params)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        # float32 rounding scales with the leaf's largest entries (|g| ~ 200 here): a 0.13 entry of a
        # leaf differed by 1.5e-5 on an AMD EPYC without AVX-512
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6 * np.abs(b).max())
    assert any(np.any(np.asarray(a) != 0) for a in jax.tree.leaves(g1))


@pytest.mark.slow
def test_scored_response_ends_with_the_sampled_stop_id_and_rewards_are_checked(runner):
    """With several stop ids the scored response ends with the one that was sampled (the rollout's
    raw samples, drawn without stop ids from the same key, are the reference), and a reward
    function returning NaN / None / inf stops the rollout with an error naming it."""
    import dataclasses as dc

    from train.grpo import RewardError
    stops = (2,) + tuple(range(100, 250))                   # most samples stop early, on many different ids
    tr = GRPOTrainer(CFG, runner, GRPOConfig(adapter=AdapterSpec(rank=4), **GC), _reward, stop_token_ids=stops)
    ts = tr.init_state()
    prompts = _prompts()[:2]
    ro = tr.rollout(ts.params, prompts, [0, 0], jax.random.key(4))
    bank = adapter_bank(CFG, tr.adapter_config, ts.params)
    raw = runner.generate(ro.prompts, dc.replace(tr.sampling(), stop_token_ids=(-1,)), bank, [1] * 8,
                          jax.random.key(4))
    ended = []
    for c, r, g in zip(ro.completions, ro.responses, raw):
        assert r == g.tokens[:len(r)] and c == r[:len(c)]
        if len(r) > len(c):
            assert r[-1] in stops
            ended.append(r[-1])
    assert any(t != stops[0] for t in ended), ended        # the case the first stop id got wrong
    for bad in (float("nan"), None, float("inf")):
        tr.reward_fn = lambda ids, answer, bad=bad: bad
        with pytest.raises(RewardError, match=rf"returned {bad!r} for a completion of prompt 0 of this step; "
                                              r"a reward must be a finite number"):
            tr.rollout(ts.params, prompts, [0, 0], jax.random.key(4))
