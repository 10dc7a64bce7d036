"""LoReFT on a subset of layers: the unused layers' all-zero R never reaches the QR, so every gradient
is finite, the unused layers' gradient is exactly zero, and the used layers' gradient is the one of an
independent formulation (QR of every layer's own R, unused layers given a random full-rank R)."""
import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.adapters.trainable import effective_reft, init_reft, orthonormal_rows
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from reference_llama import random_params
from train.config import AdapterSpec
from train.data import pad_batch
from train.sft import batch_arrays, sft_loss

CFG = tiny_config()
LAYERS = (0, 2)                                   # layer 1 unused


def _params(acfg, seed=0):
    p = init_reft(CFG, acfg, jax.random.key(seed))
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    keep = jnp.asarray([1.0 if i in LAYERS else 0.0 for i in range(CFG.n_layers)])
    return {"R": p["R"], "W": p["W"] + 0.3 * jax.random.normal(k1, p["W"].shape) * keep[:, None, None],
            "b": 0.3 * jax.random.normal(k2, p["b"].shape) * keep[:, None]}


def _edit_loss(effective):
    """A loss through R, W, b of every layer: sum over layers of a random probe of the ReFT edit."""
    h = jax.random.normal(jax.random.key(7), (5, CFG.d_model))

    def loss(params):
        R, W, b = effective(params)
        out = 0.0
        for layer in range(CFG.n_layers):
            e = (h @ W[layer].T + b[layer] - h @ R[layer].T) @ R[layer]
            out = out + jnp.sum(jnp.sin(e))
        return out
    return loss


def test_loreft_layer_subset_grads_finite_and_zero_on_unused_layers():
    acfg = AdapterSpec(kind="reft", rank=3, layers=LAYERS, reft_kind="loreft").build(CFG)
    params = _params(acfg)
    assert float(jnp.abs(params["R"][1]).max()) == 0.0                  # the unused layer's R is all zero
    grads = jax.grad(_edit_loss(lambda p: effective_reft(CFG, acfg, p)))(params)
    for name, g in grads.items():
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), name
        assert np.all(g[1] == 0.0), name                               # exactly zero, not just small
        assert np.abs(g[list(LAYERS)]).max() > 1e-4, name

    # reference: the old formulation (QR of every layer's own R, then the layer mask) is finite when
    # the unused layer holds any full-rank R; the used layers' gradient does not depend on it
    mask = jnp.asarray([1.0 if i in LAYERS else 0.0 for i in range(CFG.n_layers)])

    def old_effective(p):
        R = orthonormal_rows(p["R"]) * mask[:, None, None]
        return R, p["W"] * mask[:, None, None], p["b"] * mask[:, None]

    filler = params["R"].at[1].set(jax.random.normal(jax.random.key(3), params["R"][1].shape))
    ref = jax.grad(_edit_loss(old_effective))(dict(params, R=filler))
    for name in ("R", "W", "b"):
        np.testing.assert_allclose(np.asarray(grads[name])[list(LAYERS)], np.asarray(ref[name])[list(LAYERS)],
                                   rtol=1e-5, atol=1e-6)
    # and the old formulation at the real (all-zero) unused R is what produced NaN
    bad = jax.grad(_edit_loss(old_effective))(params)
    assert not np.all(np.isfinite(np.asarray(bad["R"])))


def test_loreft_layer_subset_sft_gradient_through_the_model():
    """The SFT loss through the whole model: finite grads, zero on the unused layer, no masking step."""
    runner = ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))
    acfg = AdapterSpec(kind="reft", rank=2, layers=LAYERS, mode="prefill").build(CFG)
    params = _params(acfg, seed=4)
    b = pad_batch([[5, 6, 7, 8], [9, 10, 11]], [[12, 13, 2], [14, 2]], length=16)
    arrays = {k: jnp.asarray(v) for k, v in batch_arrays(b).items()}
    grads = jax.jit(jax.grad(lambda p: sft_loss(CFG, acfg, runner.graphdef, runner.state, p, arrays)))(params)
    for name, g in grads.items():
        g = np.asarray(g)
        assert np.all(np.isfinite(g)) and np.all(g[1] == 0.0), name
        assert np.abs(g[list(LAYERS)]).max() > 1e-6, name
