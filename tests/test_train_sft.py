"""SFT trainer: the loss is the inference computation (teacher-forced adapted prompt + base response
== adapted prefill then base decode through the KV cache), masking, gradients, learning."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.adapters.policy import token_adapter_index
from preft_jax.adapters.trainable import adapter_bank, init_adapter
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.kv_cache import KVCache
from preft_jax.model import Llama
from reference_llama import random_params
from train.common import token_logprobs
from train.config import AdapterSpec, OptimizerConfig
from train.data import Tokenized, pad_batch
from train.sft import SFTConfig, SFTTrainer, _parse, batch_arrays, sft_loss as _sft_loss

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
# jitted once per shape (eager calls would re-trace the layer scan every time)
sft_loss = jax.jit(_sft_loss, static_argnums=(0, 1, 2, 6))
sequence_logits = jax.jit(sequence_logits, static_argnums=0)
token_logprobs = jax.jit(token_logprobs, static_argnums=(0, 6, 7))


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))


def _random_adapter(kind, mode, seed=1, rank=4):
    """Trainable params made non-trivial (LoRA B != 0; ReFT W != R, b != 0)."""
    acfg = AdapterSpec(kind=kind, rank=rank, mode=mode, targets=("q", "k", "v", "o", "gate", "up", "down"),
                       layers=None if kind == "lora" else (0, 2)).build(CFG)
    params = init_adapter(CFG, acfg, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    leaves = [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return acfg, jax.tree.unflatten(tree, leaves)


def _batch(seed=0, B=3, pad_id=0):
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(3, CFG.vocab_size, n))) for n in (5, 9, 3)[:B]]
    responses = [list(map(int, rng.integers(3, CFG.vocab_size, n))) + [2] for n in (4, 2, 6)[:B]]
    return prompts, responses, pad_batch(prompts, responses, pad_id=pad_id, length=24)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("kind", ["lora", "reft"])
@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_loss_equals_explicit_response_loop(runner, kind, mode):
    acfg, params = _random_adapter(kind, mode)
    prompts, responses, b = _batch()
    arrays = {k: jnp.asarray(v) for k, v in batch_arrays(b).items()}
    loss = float(sft_loss(CFG, acfg, runner.graphdef, runner.state, params, arrays, 5))  # chunked path
    bank = adapter_bank(CFG, acfg, params)
    logits = sequence_logits(runner.graphdef, runner.state, jnp.asarray(b.tokens), jnp.asarray(b.prompt_lengths),
                             bank, jnp.ones(3, jnp.int32))
    lp = _log_softmax(logits)
    nll, n = 0.0, 0
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = p + r
        for t in range(len(p), len(seq)):          # every response token (end-of-turn included), nothing else
            nll -= lp[i, t - 1, seq[t]]
            n += 1
    assert n == int(b.loss_mask.sum())
    np.testing.assert_allclose(loss, nll / n, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["lora", "reft"])
@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_teacher_forcing_equals_prefill_then_decode(runner, kind, mode):
    """Training == inference: adapted prefill of the prompt into the KV cache, then the response
    decoded token by token (base weights in prefill mode, adapter in all-token mode)."""
    acfg, params = _random_adapter(kind, mode, seed=3)
    prompts, responses, b = _batch(seed=1)
    bank = adapter_bank(CFG, acfg, params)
    ids = jnp.ones(3, jnp.int32)
    tokens, plen = jnp.asarray(b.tokens), jnp.asarray(b.prompt_lengths)
    tf_logits = np.asarray(sequence_logits(runner.graphdef, runner.state, tokens, plen, bank, ids))
    tf_lp = np.asarray(token_logprobs(runner.graphdef, runner.state, tokens, plen, bank, ids, chunk=7))

    Tp = max(len(p) for p in prompts)
    ptoks = np.zeros((3, Tp), np.int32)
    for i, p in enumerate(prompts):
        ptoks[i, :len(p)] = p
    cache = KVCache.create(CFG, 3, 32)
    last, cache = runner.prefill(jnp.asarray(ptoks), plen, jnp.arange(3, dtype=jnp.int32), cache, bank, ids)
    inf_logits = [np.asarray(last)]                       # predicts response token 0
    dbank, dids = (None, None) if mode == "prefill" else (bank, ids)
    for j in range(max(len(r) for r in responses) - 1):
        tok = np.array([r[j] if j < len(r) else 0 for r in responses], np.int32)
        lg, cache = runner.decode(jnp.asarray(tok), plen + j, cache, dbank, dids, plen)
        inf_logits.append(np.asarray(lg))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        for j in range(len(r)):
            t = len(p) + j                                   # response token t predicted at t - 1
            np.testing.assert_allclose(tf_logits[i, t - 1], inf_logits[j][i], rtol=2e-4, atol=2e-4)
            np.testing.assert_allclose(tf_lp[i, t], _log_softmax(inf_logits[j][i])[r[j]], rtol=2e-4, atol=2e-4)


def test_prefill_mode_adapter_index_and_gradient(runner):
    acfg = AdapterSpec(kind="lora", rank=4, mode="prefill").build(CFG)
    params = init_adapter(CFG, acfg, jax.random.key(0))        # identity init: B = 0
    prompts, responses, b = _batch()
    bank = adapter_bank(CFG, acfg, params)
    T = b.tokens.shape[1]
    idx = np.asarray(token_adapter_index(bank, jnp.ones(3, jnp.int32), jnp.broadcast_to(jnp.arange(T), (3, T)),
                                         jnp.asarray(b.prompt_lengths)))
    for i, p in enumerate(prompts):
        assert np.all(idx[i, :len(p)] == 1)                   # prompt tokens (the last one included) adapted
        assert np.all(idx[i, len(p):] == 0)                   # response + padding on base weights
    assert np.all(b.loss_mask[idx == 1] == 0)                 # no scored token runs the adapter itself
    all_bank = adapter_bank(CFG, dataclasses.replace(acfg, policy=AdapterSpec(rank=4, mode="all").build(CFG).policy),
                            params)
    assert np.all(np.asarray(token_adapter_index(all_bank, jnp.ones(3, jnp.int32),
                                                 jnp.broadcast_to(jnp.arange(T), (3, T)),
                                                 jnp.asarray(b.prompt_lengths))) == 1)
    arrays = {k: jnp.asarray(v) for k, v in batch_arrays(b).items()}
    grads = jax.jit(jax.grad(lambda q: _sft_loss(CFG, acfg, runner.graphdef, runner.state, q, arrays)))(params)
    # the loss is on base-weight response tokens only; the gradient reaches the adapter through
    # attention to the adapted prompt keys/values
    for t in acfg.targets:
        assert float(jnp.abs(grads["B"][t]).max()) > 1e-6, t


def test_padding_does_not_change_loss(runner):
    acfg, params = _random_adapter("lora", "prefill")
    prompts, responses, b = _batch()
    ref = float(sft_loss(CFG, acfg, runner.graphdef, runner.state, params, batch_arrays(b)))
    # other pad ids, and more padding
    for pad_id, length in ((7, 24), (0, 40), (123, 17)):
        b2 = pad_batch(prompts, responses, pad_id=pad_id, length=length)
        got = float(sft_loss(CFG, acfg, runner.graphdef, runner.state, params, batch_arrays(b2)))
        np.testing.assert_allclose(got, ref, rtol=1e-5)
    # the mask covers exactly the response tokens
    for i, (p, r) in enumerate(zip(prompts, responses)):
        expect = np.zeros(24)
        expect[len(p):len(p) + len(r)] = 1
        np.testing.assert_array_equal(b.loss_mask[i], expect)
    # a scored token changes the loss; a masked-out response row contributes nothing
    b3 = pad_batch(prompts, responses, length=24)
    b3.tokens[0, len(prompts[0]) + 1] = 99
    assert abs(float(sft_loss(CFG, acfg, runner.graphdef, runner.state, params, batch_arrays(b3))) - ref) > 1e-4
    b4 = pad_batch(prompts, responses, length=24)
    b4.loss_mask[2] = 0
    b5 = pad_batch(prompts[:2], responses[:2], length=24)
    np.testing.assert_allclose(float(sft_loss(CFG, acfg, runner.graphdef, runner.state, params, batch_arrays(b4))),
                               float(sft_loss(CFG, acfg, runner.graphdef, runner.state, params, batch_arrays(b5))),
                               rtol=1e-5)


@pytest.mark.parametrize("adapter,mode", [("lora", "prefill"), ("lora", "all"), ("reft", "prefill")])
def test_loss_decreases_on_learnable_task(runner, adapter, mode):
    """The response is a fixed function of the prompt's first token: learnable through attention."""
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 40, rng.integers(3, 8))] for _ in range(32)]
    responses = [[p[0] + 50, p[0] + 100, 2] for p in prompts]
    data = Tokenized(prompts, responses, [0] * 32)
    tc = SFTConfig(adapter=AdapterSpec(kind=adapter, rank=4, mode=mode), steps=25, batch_size=16,
                   optimizer=OptimizerConfig(lr=2e-2, warmup_steps=2), log_every=0, seq_len=16)
    trainer = SFTTrainer(CFG, runner.graphdef, runner.state, tc)
    state, hist = trainer.fit(data, data)
    first = np.mean([h["loss"] for h in hist[:2]])
    assert hist[-1]["eval_loss"] < 0.6 * first, (first, hist[-1]["eval_loss"])
    assert int(state.step) == 25


def test_train_step_only_touches_adapter_and_base_is_constant(runner):
    tc = SFTConfig(adapter=AdapterSpec(rank=2), steps=3, batch_size=3, optimizer=OptimizerConfig(lr=1e-2),
                   log_every=0)
    trainer = SFTTrainer(CFG, runner.graphdef, runner.state, tc)
    before = jax.tree.map(np.asarray, trainer.base_state)
    ts = trainer.init_state()
    p0 = jax.tree.map(np.asarray, ts.params)
    _, _, b = _batch()
    ts, m = trainer.step(ts, b)
    ts, m = trainer.step(ts, b)
    assert int(ts.step) == 2 and np.isfinite(float(m["loss"]))
    assert any(not np.array_equal(a, np.asarray(c)) for a, c in zip(jax.tree.leaves(p0), jax.tree.leaves(ts.params)))
    for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.base_state)):
        np.testing.assert_array_equal(a, np.asarray(c))
    assert set(ts.params) == {"A", "B"}


def test_config_and_cli():
    tc = SFTConfig(adapter=AdapterSpec(kind="reft", layers=(0, 2)), seq_len=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tc.adapter.rank = 3
    assert SFTConfig.from_json(tc.to_json()) == tc
    a = _parse(["--adapter", "reft", "--rank", "4", "--mode", "all", "--steps", "3"])
    assert (a.adapter, a.rank, a.mode, a.steps) == ("reft", 4, "all", 3)
    with pytest.raises(ValueError):
        AdapterSpec(rank=4, mode="decode")
    from train import cli
    from train.sft import config_from_args
    assert config_from_args(_parse([])).remat is True                   # the default: full
    for flag, want in (("off", False), ("full", True), ("save_projections", "save_projections")):
        assert config_from_args(_parse(["--remat", flag])).remat == want
    assert cli.model_options(_parse([])).attention is None
    assert cli.model_options(_parse(["--attention", "xla"])).attention == "xla"


def test_activated_config_invocation_flag_and_starts():
    from preft_jax.adapters.policy import MissingInvocationError, PositionPolicy
    from train import cli
    from train.grpo import GRPOConfig
    from train.sft import config_from_args

    class Tok:
        def encode(self, text):
            return [ord(c) for c in text]
    assert cli.invocation_ids(None) is None
    assert cli.invocation_ids("12,34") == (12, 34) and cli.invocation_ids(" [7] ") == (7,)
    assert cli.invocation_ids("2024", Tok()) == (50, 48, 50, 52)          # a bare number is text
    assert cli.invocation_ids("<check>", None) == (0,)                    # placeholder until the tokenizer loads
    a = _parse(["--mode", "activated", "--invocation", "3,4"])
    spec = config_from_args(a).adapter
    assert spec.invocation == (3, 4) and spec.build(CFG).policy == PositionPolicy.activated([3, 4])
    assert config_from_args(_parse(["--mode", "activated", "--invocation", "ab"]), Tok()).adapter.invocation == (97, 98)
    assert SFTConfig.from_json(SFTConfig(adapter=spec).to_json()).adapter == spec
    for kwargs, msg in ((dict(mode="activated"), "mode 'activated' needs an invocation sequence (--invocation TEXT or ids)"),
                        (dict(invocation=(1,)), "an invocation sequence belongs to mode 'activated', not 'prefill'"),
                        (dict(mode="activated", invocation=(1, -1)), "invocation_tokens must be token ids")):
        with pytest.raises(ValueError) as e:
            AdapterSpec(**kwargs)
        assert str(e.value).startswith(msg), str(e.value)
    with pytest.raises(ValueError) as e:
        AdapterSpec(mode="activated", invocation=(3, 999)).build(CFG)
    assert str(e.value) == "invocation token 999 is outside the model's vocabulary (0..255)"
    with pytest.raises(ValueError, match="GRPO trains prefill or all-token adapters; mode 'activated' .aLoRA. is "
                                         "trained by train.sft"):
        GRPOConfig(adapter=AdapterSpec(mode="activated", invocation=(3,)))
    b = pad_batch([[5, 3, 4, 6], [3, 4, 9, 3, 4]], [[7], [8, 8]], length=8)
    policy = PositionPolicy.activated([3, 4])
    assert batch_arrays(b, policy)["adapter_starts"].tolist() == [1, 3]
    assert "adapter_starts" not in batch_arrays(b)
    bad = pad_batch([[5, 3, 6]], [[3, 4]], length=8)                     # in the response only: not in the prompt
    with pytest.raises(MissingInvocationError, match=r"adapter being trained \(batch row 0\);"):
        batch_arrays(bad, policy)


def test_remat_policies_give_the_same_gradient_and_recompute_less(runner):
    # every policy is the same function; what differs is what the backward recomputes: "full" runs
    # every layer's projections again, "save_qkvo" the MLP's, "save_projections" none of the base ones
    from train.sft import sft_loss_terms
    acfg, params = _random_adapter("lora", "prefill")
    arrays = {k: jnp.asarray(v) for k, v in batch_arrays(_batch()[2]).items()}
    grads, dots = {}, {}
    for remat in (False, True, "save_qkvo", "save_projections"):
        def loss(p, remat=remat):
            nll, n = sft_loss_terms(CFG, acfg, runner.graphdef, runner.state, p, arrays, 8, remat=remat)
            return nll / n
        g = jax.grad(loss)
        dots[remat] = str(jax.make_jaxpr(g)(params)).count("dot_general")
        grads[remat] = jax.jit(g)(params)
    for remat in (True, "save_qkvo", "save_projections"):
        for a, b in zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads[remat])):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7 * float(jnp.abs(a).max()))
    # matmuls in the gradient's program (one layer body: a scan); measured 86 / 78 / 74 against 65 without
    # remat (the LoRA shrinks and the attention's two einsums are recomputed under every policy)
    assert dots[True] > dots["save_qkvo"] > dots["save_projections"] >= dots[False], dots
