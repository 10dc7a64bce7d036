"""Sharding rules, divisibility fallback, and sharded train steps on an 8-device fake CPU mesh.

The multi-device checks run in a subprocess: XLA_FLAGS must be set before jax is imported, and
the other test modules import jax in this pytest process.
"""
import textwrap

import jax
import numpy as np
import pytest
from fake_devices import run_on_fake_devices
from jax.sharding import PartitionSpec as P

from preft_jax import sharding as shd
from preft_jax.config import tiny_config



class FakeMesh:
    """logical_spec / fit_spec only read `mesh.shape`."""

    def __init__(self, data, fsdp, tensor):
        self.shape = {"data": data, "fsdp": fsdp, "tensor": tensor}


def _specs(tree, mesh, cfg):
    return {k: v for k, v in zip(shd.declared_axes(tree), jax.tree.leaves(
        shd.tree_specs(tree, mesh, cfg), is_leaf=lambda x: isinstance(x, P)))}


def test_rules_table():
    """Specs follow from the axes declared where each array is created and the one RULES table."""
    from flax import nnx
    from preft_jax.adapters.bank import empty_bank
    from preft_jax.adapters.config import LoraConfig, ReftConfig
    from preft_jax.adapters.trainable import init_adapter
    from preft_jax.kv_cache import KVCache
    from preft_jax.model import Llama
    from preft_jax.paged_kv import PagedKVCache
    m, cfg = FakeMesh(2, 2, 2), tiny_config()
    state = nnx.state(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    s = dict(zip(shd.declared_axes(state), jax.tree.leaves(shd.tree_specs(state, m, cfg),
                                                           is_leaf=lambda x: isinstance(x, P))))
    assert s["layers/wq"] == P(None, "fsdp", "tensor")
    assert s["layers/wk"] == P(None, "fsdp", "tensor")
    assert s["layers/w_up"] == P(None, "fsdp", "tensor")
    assert s["layers/wo"] == P(None, "tensor", "fsdp")
    assert s["layers/w_down"] == P(None, "tensor", "fsdp")
    assert s["embed"] == P("tensor", "fsdp")
    assert s["layers/attn_norm"] == P()
    assert s["final_norm"] == P()
    key = jax.random.key(0)
    lora = jax.eval_shape(lambda: init_adapter(cfg, LoraConfig(rank=4, alpha=8.0, targets=("q", "o", "down")), key))
    s = _specs(lora, m, cfg)
    # the rank takes the mesh axes the projection's dimension leaves: every adapter array is split
    # over tensor x fsdp (A [embed, rank] -> (fsdp, tensor), B [rank, q_heads] -> (fsdp, tensor), ...)
    assert s["A/q"] == P(None, "fsdp", "tensor") and s["B/q"] == P(None, "fsdp", "tensor")
    assert s["A/down"] == P(None, "tensor", "fsdp") and s["B/o"] == P(None, "tensor", "fsdp")
    s = _specs(jax.eval_shape(lambda: init_adapter(cfg, ReftConfig(rank=4, layers=(0, 2)), key)), m, cfg)
    assert s["R"] == P(None, "tensor", "fsdp") and s["b"] == P(None, ("tensor", "fsdp"))
    s = _specs(jax.eval_shape(lambda: empty_bank(cfg, 3, ("v", "o"), 4, 2)), m, cfg)
    assert s["lora_A/v"] == P(None, None, "fsdp", "tensor") and s["lora_B/v"] == P(None, None, "fsdp", "tensor")
    assert s["lora_A/o"] == P(None, None, "tensor", "fsdp") and s["reft_R"] == P(None, None, "tensor", "fsdp")
    assert s["policy/kind"] == P() and s["reft_subtract"] == P()
    s = _specs(jax.eval_shape(lambda: KVCache.create(cfg, 8, 32)), m, cfg)
    assert s["k"] == P(None, ("data", "fsdp"), None, "tensor")
    s = _specs(jax.eval_shape(lambda: PagedKVCache.create(cfg, 9, 4)), m, cfg)
    assert s["v"] == P(None, "tensor")
    assert shd.batch_spec((8, 24), m) == P(("data", "fsdp"))
    assert shd.logical_spec(("batch", "seq", "q_heads", "head_dim"), (8, 5, 4, 16), m, shd.axis_units(cfg)) \
        == P(("data", "fsdp"), None, "tensor")
    # mesh axes of size 1 are left out
    assert shd.logical_spec(("layers", "embed", "mlp"), (3, 64, 128), FakeMesh(1, 1, 2)) == P(None, None, "tensor")


def test_undeclared_arrays_are_errors():
    m = FakeMesh(1, 1, 2)
    with pytest.raises(ValueError, match="layers/extra: no logical axes declared"):
        from flax import nnx
        from preft_jax.model import Llama
        model = nnx.eval_shape(lambda: Llama(tiny_config(), rngs=nnx.Rngs(0)))
        model.layers.extra = nnx.Param(jax.ShapeDtypeStruct((3, 4), np.float32))
        shd.tree_specs(nnx.state(model), m, tiny_config())
    with pytest.raises(ValueError, match="no rule"):
        shd.logical_spec(("layers", "nonsense"), (3, 4), m)
    with pytest.raises(ValueError, match="keys"):
        shd.tree_specs({"X": np.zeros(3)}, m)
    with pytest.raises(TypeError, match="no logical axes"):
        shd.tree_specs([np.zeros(3)], m)
    with pytest.raises(ValueError, match="whole heads"):            # head axes need the head counts
        shd.logical_spec(("layers", "embed", "q_heads"), (3, 64, 64), m)
    with pytest.raises(ValueError, match="logical axes"):          # rank mismatch
        shd.logical_spec(("layers", "embed"), (64, 64, 3), m)


def test_divisibility_fallback(caplog):
    m = FakeMesh(2, 4, 3)
    units = {"q_heads": 4, "kv_heads": 2}
    with caplog.at_level("WARNING", logger="preft_jax.sharding"):
        # 4 heads % 3 != 0 -> the head dim is replicated (warned); 250 % 3 != 0 for the vocab
        assert shd.logical_spec(("layers", "embed", "q_heads"), (3, 64, 64), m, units, "w") == P(None, "fsdp")
        assert shd.logical_spec(("vocab", "embed"), (250, 64), m, units, "emb") == P(None, "fsdp")
        assert shd.logical_spec(("layers", "mlp", "embed"), (3, 96, 30), m, units, "wd") == P(None, "tensor")
    assert "w: q_heads (4) is not divisible by mesh axes ('tensor',)" in caplog.text
    assert "emb: vocab (250)" in caplog.text and "wd: embed (30)" in caplog.text
    # whole heads: 6 heads x 16 = 96 is divisible by 4 but 6 heads are not -> replicated
    assert shd.logical_spec(("layers", "embed", "q_heads"), (3, 64, 96), FakeMesh(1, 1, 4), {"q_heads": 6}) \
        == P()
    # batch of 6 over data*fsdp = 8: longest dividing prefix ("data") is kept, silently
    assert shd.batch_spec((6, 10), m) == P("data")
    assert shd.batch_spec((5, 10), m) == P()
    assert shd.fit_spec((("data", "fsdp"), "nope"), (16, 4), m) == P(("data", "fsdp"))


def test_parse_mesh():
    assert shd.parse_mesh("data=2,tensor=4") == {"data": 2, "fsdp": 1, "tensor": 4}
    assert shd.parse_mesh(None) == {"data": 1, "fsdp": 1, "tensor": 1}
    for bad in ("data", "pipe=2", "tensor=0", "tensor=x", "data=1,data=2"):
        with pytest.raises(ValueError):
            shd.parse_mesh(bad)
    with pytest.raises(ValueError, match="must use every device"):
        shd.mesh_from_spec(f"tensor={len(jax.devices()) + 1}")
    assert shd.mesh_from_spec(f"data={len(jax.devices())}").shape["data"] == len(jax.devices())


def test_mesh_and_state_single_device():
    mesh = shd.make_mesh()
    assert mesh.axis_names == shd.AXES
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError):
        shd.make_mesh(2, 2, len(jax.devices()) + 1)
    from flax import nnx
    from preft_jax.model import Llama
    _, state = nnx.split(Llama(tiny_config(), rngs=nnx.Rngs(0)))
    placed = shd.shard_model_state(state, mesh, tiny_config())
    assert isinstance(jax.tree.leaves(placed)[0].sharding, jax.sharding.NamedSharding)
    names = {shd.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)}
    assert {"embed", "final_norm", "layers/wq", "layers/w_down"} <= names


SCRIPT = textwrap.dedent(r"""
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    assert len(jax.devices()) == 8, jax.devices()
    from preft_jax import sharding as shd
    from preft_jax.config import tiny_config
    from preft_jax.generation import ModelRunner, sequence_logits
    from preft_jax.model import Llama
    from reference_llama import random_params
    from train.data import pad_batch
    from train.config import AdapterSpec, MeshConfig, OptimizerConfig
    from train.sft import SFTConfig, SFTTrainer
    from train.grpo import GRPOConfig, GRPOTrainer

    cfg = tiny_config()
    runner = ModelRunner(Llama.from_params(cfg, random_params(cfg, 0)))
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 200, rng.integers(3, 9))] for _ in range(8)]
    responses = [[int(x) for x in rng.integers(3, 200, rng.integers(1, 6))] + [2] for _ in range(8)]
    batch = pad_batch(prompts, responses, length=16)
    out = {}
    for adapter in ("lora", "reft"):
        res = {}
        for mesh in ((1, 1, 1), (2, 2, 2)):
            tc = SFTConfig(adapter=AdapterSpec(kind=adapter, rank=4, mode="prefill"), steps=3,
                           optimizer=OptimizerConfig(lr=1e-2), mesh=MeshConfig(*mesh), logit_chunk=8)
            tr = SFTTrainer(cfg, runner.graphdef, runner.state, tc)
            ts = tr.init_state()
            losses = []
            for _ in range(2):
                ts, m = tr.step(ts, batch)
                losses.append(float(m["loss"]))
            res[mesh] = (losses, [np.asarray(x) for x in jax.tree.leaves(ts.params)], tr, ts)
        (l1, p1, _, _), (l8, p8, tr8, ts8) = res[(1, 1, 1)], res[(2, 2, 2)]
        out[adapter] = {"loss_1": l1, "loss_8": l8,
                        "param_max_diff": max(float(np.abs(a - b).max()) for a, b in zip(p1, p8)),
                        "param_max": max(float(np.abs(a).max()) for a in p1)}
        if adapter == "lora":
            out["wq_spec"] = str(tr8.base_state["layers"]["wq"].sharding.spec)
            out["embed_spec"] = str(tr8.base_state["embed"].sharding.spec)
            out["A_q_spec"] = str(ts8.params["A"]["q"].sharding.spec)
            out["B_q_spec"] = str(ts8.params["B"]["q"].sharding.spec)
            mu = ts8.opt_state[1][0].mu["A"]["q"]
            out["mu_A_q_spec"] = str(mu.sharding.spec)
            out["n_devices"] = len(ts8.params["A"]["q"].sharding.device_set)
            b8 = tr8.setup.put_batch({"tokens": batch.tokens})
            out["batch_spec"] = str(b8["tokens"].sharding.spec)
            lg8 = sequence_logits(runner.graphdef, tr8.base_state, b8["tokens"], jnp.asarray(batch.prompt_lengths))
            lg1 = sequence_logits(runner.graphdef, runner.state, jnp.asarray(batch.tokens),
                                  jnp.asarray(batch.prompt_lengths))
            out["logits_max_diff"] = float(jnp.abs(lg8 - lg1).max())

    # GRPO: one update on a synthetic rollout batch, unsharded vs sharded
    g = {}
    for mesh in ((1, 1, 1), (2, 2, 2)):
        gc = GRPOConfig(adapter=AdapterSpec(rank=4, mode="prefill"), group_size=4, prompts_per_step=2,
                        max_new_tokens=4, optimizer=OptimizerConfig(lr=1e-2), inner_steps=2, mesh=MeshConfig(*mesh))
        tr = GRPOTrainer(cfg, runner, gc, lambda ids, a: 0.0)
        rb = {"tokens": batch.tokens, "prompt_lengths": batch.prompt_lengths, "loss_mask": batch.loss_mask,
              "advantages": np.array([1, -1, 0.5, -0.5, 2, 0, -1, -1], np.float32)}
        ts, m = tr.update(tr.init_state(), rb)
        g[mesh] = (float(m["loss"]), [np.asarray(x) for x in jax.tree.leaves(ts.params)])
        if mesh == (2, 2, 2):   # rollouts on the sharded base state
            ro = tr.rollout(ts.params, prompts[:2], [0, 0], jax.random.key(0))
            out["grpo_rollouts"] = len(ro.completions)
    out["grpo_loss"] = [g[(1, 1, 1)][0], g[(2, 2, 2)][0]]
    out["grpo_param_max_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(g[(1, 1, 1)][1], g[(2, 2, 2)][1]))
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def eight_device_result():
    return run_on_fake_devices(SCRIPT, cheap_codegen=True)        # compared within the process, to tolerances


@pytest.mark.slow
def test_sharded_sft_step_matches_unsharded(eight_device_result):
    r = eight_device_result
    for adapter in ("lora", "reft"):
        np.testing.assert_allclose(r[adapter]["loss_8"], r[adapter]["loss_1"], rtol=1e-5)
        assert r[adapter]["param_max_diff"] <= 1e-4 * max(1.0, r[adapter]["param_max"]), r[adapter]
    assert r["logits_max_diff"] < 1e-4


@pytest.mark.slow
def test_sharded_placements(eight_device_result):
    r = eight_device_result
    assert r["wq_spec"] == str(P(None, "fsdp", "tensor"))
    assert r["embed_spec"] == str(P("tensor", "fsdp"))
    assert r["A_q_spec"] == str(P(None, "fsdp", "tensor"))     # the rank takes the axis embed leaves
    assert r["B_q_spec"] == str(P(None, "fsdp", "tensor"))
    assert r["mu_A_q_spec"] == r["A_q_spec"]         # Adam moments follow their params
    assert r["batch_spec"] == str(P(("data", "fsdp")))
    assert r["n_devices"] == 8


@pytest.mark.slow
def test_sharded_grpo_update_matches_unsharded(eight_device_result):
    r = eight_device_result
    # float32 sharded-reduction noise: measured relative differences 1.0e-5 and 1.2e-5 (two adapter layouts)
    np.testing.assert_allclose(r["grpo_loss"][1], r["grpo_loss"][0], rtol=5e-5, atol=1e-6)
    assert r["grpo_param_max_diff"] < 1e-4
    assert r["grpo_rollouts"] == 8
