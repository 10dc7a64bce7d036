"""The model with adapter_backend="pallas" (SGMV prefill, BGMV decode, ReFT kernel; interpret mode
on CPU) equals the jnp backend, forward and adapter gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.config import LoraConfig, PositionPolicy
from preft_jax.adapters.trainable import init_lora, lora_bank
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params

CFG = tiny_config(n_layers=2)
ALL = PositionPolicy(mode="all")


@pytest.fixture(scope="module")
def runners():
    params = random_params(CFG, seed=0)
    return (ModelRunner(Llama.from_params(CFG, params, adapter_backend="jnp")),
            ModelRunner(Llama.from_params(CFG, params, adapter_backend="pallas")))


def test_mixed_bank_generation_same_on_both_backends(runners):
    jnp_runner, pallas_runner = runners
    bank = build_bank(CFG, [random_lora(CFG, 1, rank=4, policy=ALL), random_lora(CFG, 2, rank=4, policy=ALL),
                            random_reft(CFG, 3, layers=(1,), policy=ALL)])
    prompts = [list(np.random.default_rng(s).integers(0, CFG.vocab_size, n)) for s, n in ((1, 5), (2, 3), (3, 6), (4, 2))]
    sp = SamplingParams(max_new_tokens=4, stop_token_ids=(-1,))
    ids = [1, 3, 2, 0]
    a = jnp_runner.generate(prompts, sp, bank=bank, adapter_ids=ids)
    b = pallas_runner.generate(prompts, sp, bank=bank, adapter_ids=ids)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    tokens = np.zeros((4, 8), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    la, lb = (np.asarray(sequence_logits(r.graphdef, r.state, jnp.asarray(tokens), jnp.asarray([5, 3, 6, 2]), bank,
                                         jnp.asarray(ids))) for r in runners)
    np.testing.assert_allclose(lb, la, rtol=1e-4, atol=1e-4 * np.abs(la).max())


def test_adapter_gradient_same_on_both_backends(runners):
    conf = LoraConfig(rank=4, alpha=8, targets=("q", "v", "down"))
    params = init_lora(CFG, conf, jax.random.key(0))
    params["B"] = {t: 0.1 * jax.random.normal(jax.random.key(i), b.shape) for i, (t, b) in enumerate(params["B"].items())}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 7)))

    def loss(p, runner):
        lg = sequence_logits(runner.graphdef, runner.state, tokens, jnp.asarray([4, 3]), lora_bank(CFG, conf, p),
                             jnp.asarray([1, 1]))
        return jnp.mean(jax.nn.log_softmax(lg)[..., 5])

    ga, gb = (jax.grad(loss)(params, r) for r in runners)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        assert np.abs(np.asarray(x)).max() > 0
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)
