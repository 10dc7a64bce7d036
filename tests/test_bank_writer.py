"""The one adapter -> bank slot writer (preft_jax/adapters/bank.py), through each of its callers
(`set_slot`, `build_bank`, the serving registry's pin, training's `adapter_bank`), against a plain
float64 recompute of what a slot must hold: A zero-padded to the bank's rank, B x scale (alpha / r,
or alpha / sqrt(r) with rsLoRA) zero-padded, a target the adapter lacks all zeros, ReFT R / W / b
zero-padded with LoReFT subtract 1 and DiReFT 0, the slot's position policy; other slots untouched."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from preft_jax.adapters.bank import BankLayout, build_bank, empty_bank, set_slot, slot_update
from preft_jax.adapters.config import LoraConfig, LoraWeights, PositionPolicy, ReftConfig, ReftWeights
from preft_jax.adapters.trainable import adapter_bank
from preft_jax.config import tiny_config
from serve.registry import AdapterRegistry

CFG = tiny_config()
TARGETS, LORA_RANK, REFT_RANK = ("k", "q", "v"), 4, 5
POLICY = PositionPolicy(first_k=3, last_k=2)


def _expected(weights, lora_rank=LORA_RANK, reft_rank=REFT_RANK, targets=TARGETS) -> dict:
    """float64 recompute of one slot's arrays (numpy, no library code)."""
    L, dims = CFG.n_layers, CFG.projection_dims()
    out = {}
    for t in targets:
        A = np.zeros((L, dims[t][0], lora_rank))
        B = np.zeros((L, lora_rank, dims[t][1]))
        if isinstance(weights, LoraWeights) and t in weights.config.targets:
            c = weights.config
            scale = c.alpha / (math.sqrt(c.rank) if c.use_rslora else c.rank)
            A[..., :c.rank] = np.asarray(weights.A[t], np.float64)
            B[:, :c.rank, :] = np.asarray(weights.B[t], np.float64) * scale
        out[f"A.{t}"], out[f"B.{t}"] = A, B
    if reft_rank:
        R, W, b, sub = np.zeros((L, reft_rank, CFG.d_model)), np.zeros((L, reft_rank, CFG.d_model)), \
            np.zeros((L, reft_rank)), 0.0
        if weights is not None and not isinstance(weights, LoraWeights):
            k = weights.config.rank
            R[:, :k], W[:, :k], b[:, :k] = (np.asarray(x, np.float64) for x in (weights.R, weights.W, weights.b))
            sub = 1.0 if weights.config.kind == "loreft" else 0.0
        out.update(R=R, W=W, b=b, sub=sub)
    out["policy"] = PositionPolicy() if weights is None else weights.config.policy
    return out


def _slot(bank, i) -> dict:
    out = {}
    for t in bank.lora_A:
        out[f"A.{t}"] = np.asarray(bank.lora_A[t][:, i], np.float64)
        out[f"B.{t}"] = np.asarray(bank.lora_B[t][:, i], np.float64)
    if bank.reft_R is not None:
        out.update(R=np.asarray(bank.reft_R[:, i], np.float64), W=np.asarray(bank.reft_W[:, i], np.float64),
                   b=np.asarray(bank.reft_b[:, i], np.float64), sub=float(bank.reft_subtract[i]))
    out["policy"] = bank.policy.slot_policy(i)
    return out


def _check(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    assert got.pop("policy") == want["policy"]
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


ADAPTERS = {
    "lora": random_lora(CFG, 1, rank=2, alpha=6.0, targets=("q", "v"), policy=POLICY),
    "rslora": (lambda w: dataclasses.replace(w, config=dataclasses.replace(w.config, use_rslora=True)))(
        random_lora(CFG, 2, rank=3, alpha=5.0, targets=("k",))),
    "loreft": random_reft(CFG, 3, rank=2, kind="loreft", policy=POLICY),
    "direft": random_reft(CFG, 4, rank=3, kind="direft"),
    "alora": random_lora(CFG, 5, rank=4, targets=("v",), policy=PositionPolicy.activated([7, 8])),
}


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_set_slot_and_build_bank_match_a_float64_recompute(name):
    w = ADAPTERS[name]
    bank = empty_bank(CFG, 4, TARGETS, LORA_RANK, REFT_RANK, max_invocation_tokens=3)
    other = random_lora(CFG, 9, rank=4, targets=("q",))
    bank = set_slot(set_slot(bank, 1, other), 3, w)
    _check(_slot(bank, 3), _expected(w))
    _check(_slot(bank, 1), _expected(other))              # untouched by the write into slot 3
    for i in (0, 2):
        _check(_slot(bank, i), _expected(None))
    _check(_slot(set_slot(bank, 3, None), 3), _expected(None))

    built = build_bank(CFG, [other, w], capacity=3)
    layout = BankLayout.fitting(CFG, [other, w])
    targets = tuple(t for t, _, _ in layout.lora)
    want = lambda x: _expected(x, layout.lora_rank, layout.reft_rank, targets)
    for i, x in enumerate([None, other, w, None]):
        _check(_slot(built, i), want(x))


def test_registry_pins_through_the_writer():
    reg = AdapterRegistry(CFG, 2, lora_targets=TARGETS, lora_rank=LORA_RANK, reft_rank=REFT_RANK)
    served = ADAPTERS                                       # the aLoRA one too (its invocation in its slot)
    for name, w in served.items():
        reg.load(name, w)
    for name, w in served.items():                         # 5 adapters through 2 slots: LRU rewrites
        ref = reg.acquire(name)
        assert reg.resolve(ref) is not None                # loaded at `load`: a host hit
        slot = reg.pin(ref)
        _check(_slot(reg.bank, slot), _expected(w))
        reg.unpin(ref)                                     # the scheduler's part, before release
        reg.release(ref)
    assert reg.stats.device_evictions == 3


def _train_case(kind):
    """(config, params, the same adapter as weights with the layer mask applied) for training's bank."""
    rng = np.random.default_rng(5)
    keep = np.isin(np.arange(CFG.n_layers), (0, 2)).astype(np.float32)
    if kind == "lora":
        acfg = LoraConfig(rank=3, alpha=5.0, targets=("q", "o"), layers=(0, 2), policy=PositionPolicy("all"))
        dims = CFG.projection_dims()
        params = {"A": {t: rng.standard_normal((CFG.n_layers, dims[t][0], 3)).astype(np.float32) for t in acfg.targets},
                  "B": {t: rng.standard_normal((CFG.n_layers, 3, dims[t][1])).astype(np.float32) for t in acfg.targets}}
        w = LoraWeights(acfg, {t: a * keep[:, None, None] for t, a in params["A"].items()},
                        {t: b * keep[:, None, None] for t, b in params["B"].items()})
        return acfg, params, w, (3, 0, ("o", "q"))
    acfg = ReftConfig(rank=2, layers=(0, 2), kind="direft", policy=POLICY)      # DiReFT: R used as is
    shape = (CFG.n_layers, 2, CFG.d_model)
    params = {"R": rng.standard_normal(shape).astype(np.float32), "W": rng.standard_normal(shape).astype(np.float32),
              "b": rng.standard_normal((CFG.n_layers, 2)).astype(np.float32)}
    w = ReftWeights(acfg, params["R"] * keep[:, None, None], params["W"] * keep[:, None, None],
                    params["b"] * keep[:, None])
    return acfg, params, w, (0, 2, ())


@pytest.mark.parametrize("kind", ["lora", "reft"])
def test_training_bank_is_the_writer_and_differentiable(kind):
    acfg, params, w, shape = _train_case(kind)
    params = jax.tree.map(jnp.asarray, params)
    bank = adapter_bank(CFG, acfg, params)
    _check(_slot(bank, 1), _expected(w, *shape))
    _check(_slot(bank, 0), _expected(None, *shape))
    # gradients reach the trainable params through the writer: d(sum of slot 1) / d(param) = mask (x scale)
    g = jax.grad(lambda p: sum(x.sum() for x in jax.tree.leaves(adapter_bank(CFG, acfg, p))
                               if x.dtype == jnp.float32))(params)
    keep = np.isin(np.arange(CFG.n_layers), (0, 2))
    for path, x in jax.tree_util.tree_leaves_with_path(g):
        x = np.asarray(x)
        scale = acfg.scale if kind == "lora" and path[0].key == "B" else 1.0
        np.testing.assert_allclose(x[keep], scale, rtol=1e-6)
        assert np.all(x[~keep] == 0)


def test_slot_update_refuses_what_does_not_fit():
    layout = BankLayout.of(empty_bank(CFG, 2, ("q",), 2, 0))
    with pytest.raises(ValueError, match=r"^the adapter bank has no LoRA slots for targets \['k'\] \(bank targets: \['q'\]\)$"):
        slot_update(layout, random_lora(CFG, 0, rank=2, targets=("k",)))
    with pytest.raises(ValueError, match=r"^LoRA rank 4 exceeds the bank's rank 2$"):
        slot_update(layout, random_lora(CFG, 0, rank=4, targets=("q",)))
    with pytest.raises(ValueError, match=r"^the adapter bank was built without ReFT slots$"):
        slot_update(layout, random_reft(CFG, 0))
    with pytest.raises(TypeError, match=r"^expected LoraWeights or ReftWeights, got dict$"):
        slot_update(layout, {})
