"""Sharded serving on 8 fake CPU devices: the paged engine (and ModelRunner.generate) on a mesh gives
the same greedy tokens as unsharded, with mixed adapters in both modes, and every array sits where
its declared logical axes and the one rules table say (weights, donated KV pool after steps, bank
after slot writes). SmolLM2-135M at tensor=2: its 9 query and 3 KV heads do not split over 2
devices, so attention weights / KV cache are replicated (warned) while the MLP and vocab split.

Runs in subprocesses: XLA_FLAGS must be set before jax is imported.
"""
import textwrap

import pytest
from fake_devices import run_on_fake_devices
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.slow      # whole module (one 8-fake-device subprocess); README "Tests"


COMMON = textwrap.dedent(r"""
    import json, logging, io
    import jax, numpy as np
    assert len(jax.devices()) == 8, jax.devices()
    from adapter_factory import random_lora, random_reft
    from preft_jax import sharding as shd
    from preft_jax.sampling import SamplingParams
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    logs = io.StringIO()
    logging.getLogger("preft_jax.sharding").addHandler(logging.StreamHandler(logs))
    NO_STOP = (-1,)

    def specs(eng):
        st, bank = eng.runner.state, eng.registry.bank
        placed = {"wq": st["layers"]["wq"].sharding.spec, "wk": st["layers"]["wk"].sharding.spec,
                  "w_up": st["layers"]["w_up"].sharding.spec, "w_down": st["layers"]["w_down"].sharding.spec,
                  "embed": st["embed"].sharding.spec, "cache_k": eng.step_runner.cache.k.sharding.spec,
                  "lora_B_q": bank.lora_B["q"].sharding.spec, "lora_A_o": bank.lora_A["o"].sharding.spec,
                  "lora_B_up": bank.lora_B["up"].sharding.spec, "reft_R": bank.reft_R.sharding.spec}
        cfg, mesh = eng.runner.cfg, eng.mesh
        declared = shd.model_state_shardings(st, mesh, cfg)
        same = all(a.sharding == b for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(declared)))
        same &= all(a.sharding == b for a, b in zip(jax.tree.leaves(eng.step_runner.cache),
                                                      jax.tree.leaves(shd.cache_shardings(eng.step_runner.cache, mesh, cfg))))
        same &= all(a.sharding == b for a, b in zip(jax.tree.leaves(bank),
                                                      jax.tree.leaves(shd.bank_shardings(bank, mesh, cfg))))
        return {k: str(v) for k, v in placed.items()}, bool(same)

    def engine(runner, cfg, adapters, mode, mesh, capacity=2, **kw):
        reg = AdapterRegistry(cfg, capacity, lora_rank=4, reft_rank=4)      # default: 2 device slots for 3 adapters
        for n, w in adapters.items():
            reg.load(n, w)
        c = dict(max_num_seqs=4, max_model_len=16, max_prefill_seqs=2, max_num_batched_tokens=12, block_size=4,
                 mode=mode, num_scheduler_steps=2, min_chunk=8)
        c.update(kw)
        return Engine(runner, reg, EngineConfig(**c), mesh=mesh)
""")

TINY = COMMON + textwrap.dedent(r"""
    from preft_jax.adapters.bank import build_bank
    from preft_jax.config import tiny_config
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from reference_llama import random_params

    cfg = tiny_config(n_heads=8, n_kv_heads=4, head_dim=8)          # heads divide tensor=2 and 4
    runner = ModelRunner(Llama.from_params(cfg, random_params(cfg, 0)))
    adapters = {"a": random_lora(cfg, 1), "b": random_reft(cfg, 2), "c": random_lora(cfg, 3, targets=("q", "up"))}
    rng = np.random.default_rng(0)
    names = [None, "a", "b", "c", "a"]
    reqs = [(rng.integers(0, cfg.vocab_size, int(rng.integers(3, 11))).tolist(), names[i],
             SamplingParams(max_new_tokens=int(rng.integers(3, 6)), stop_token_ids=NO_STOP)) for i in range(5)]
    meshes = {"tensor2": shd.make_mesh(1, 1, 2), "data2_tensor4": shd.make_mesh(2, 1, 4)}
    out = {}
    for mode in ("prefill", "all"):
        base = [r.tokens for r in engine(runner, cfg, adapters, mode, None).generate(reqs)]
        out[mode] = {"base": base}
        for label, mesh in meshes.items():
            eng = engine(runner, cfg, adapters, mode, mesh)
            out[mode][label] = [r.tokens for r in eng.generate(reqs)]
            out[mode][label + "_specs"], out[mode][label + "_declared"] = specs(eng)
    # 7-slot engines: prompt LoRA takes the jnp rows layout (banks of more than 4 slots)
    out["rows"] = {label: [r.tokens for r in engine(runner, cfg, adapters, "prefill", mesh, capacity=6).generate(reqs)]
                   for label, mesh in (("base", None), ("tensor2", meshes["tensor2"]))}
    # ModelRunner.generate (preallocated KVCache path) with a bank, tensor=4 x data=2
    bank = build_bank(cfg, list(adapters.values()))
    prompts = [r[0] for r in reqs[:3]]
    sp = SamplingParams(max_new_tokens=4, stop_token_ids=NO_STOP)
    g1 = runner.generate(prompts, sp, bank=bank, adapter_ids=[0, 1, 3])
    r8 = ModelRunner(Llama.from_params(cfg, random_params(cfg, 0)), mesh=meshes["data2_tensor4"])
    g8 = r8.generate(prompts, sp, bank=bank, adapter_ids=[0, 1, 3])
    out["runner"] = [[g.tokens for g in g1], [g.tokens for g in g8]]
    out["adapters_matter"] = [r.tokens for r in engine(runner, cfg, {}, "prefill", None).generate(
        [(p, None, s) for p, _, s in reqs])]
    out["logs"] = logs.getvalue()
    print("RESULT" + json.dumps(out))
""")

SMOLLM = COMMON + textwrap.dedent(r"""
    from preft_jax.generation import ModelRunner
    from preft_jax.loading.default_model import default_model_path
    from preft_jax.loading.gguf_loader import load_gguf
    from preft_jax.model import Llama

    cfg, params, tok = load_gguf(str(default_model_path()))
    runner = ModelRunner(Llama.from_params(cfg, params))
    adapters = {"a": random_lora(cfg, 1, scale=0.05), "b": random_reft(cfg, 2, layers=(3, 10), scale=0.2),
                "c": random_lora(cfg, 3, scale=0.05)}
    sp = SamplingParams(max_new_tokens=4, stop_token_ids=NO_STOP)
    reqs = [(tok.encode_chat([{"role": "user", "content": q}]), name, sp)
            for q, name in (("What is the capital of France?", None), ("Name a color.", "a"), ("Count to three.", "b"))]
    out = {"heads": [cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size]}
    kw = dict(max_model_len=64, max_num_batched_tokens=64)
    out["base"] = [r.tokens for r in engine(runner, cfg, adapters, "prefill", None, **kw).generate(reqs)]
    eng = engine(runner, cfg, adapters, "prefill", shd.make_mesh(1, 1, 2, jax.devices()[:2]), **kw)
    out["tensor2"] = [r.tokens for r in eng.generate(reqs)]
    out["specs"], out["declared"] = specs(eng)
    out["logs"] = logs.getvalue()
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def tiny():
    return run_on_fake_devices(TINY, cheap_codegen=True)          # tokens compared within the process


@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_sharded_engine_tokens_equal_unsharded(tiny, mode):
    r = tiny[mode]
    assert r["tensor2"] == r["base"]
    assert r["data2_tensor4"] == r["base"]
    assert r["base"] != tiny["adapters_matter"]          # the adapters change the tokens (not a no-op check)
    assert all(len(t) >= 3 for t in r["base"])


def test_sharded_rows_layout_equals_unsharded_and_the_masked_product(tiny):
    r = tiny["rows"]
    assert r["tensor2"] == r["base"] == tiny["prefill"]["base"]     # 7 slots (rows) vs 3 slots (masked)


def test_sharded_runner_generate_equals_unsharded(tiny):
    assert tiny["runner"][1] == tiny["runner"][0]


def test_sharded_engine_placements(tiny):
    for mode in ("prefill", "all"):
        for label in ("tensor2", "data2_tensor4"):
            s = tiny[mode][label + "_specs"]
            assert tiny[mode][label + "_declared"], (mode, label)   # every weight / pool / bank array as declared
            assert s["wq"] == s["wk"] == s["w_up"] == str(P(None, None, 'tensor')), s
            assert s["w_down"] == str(P(None, 'tensor'))
            assert s["embed"] == str(P('tensor',))
            assert s["cache_k"] == str(P(None, 'tensor'))            # [L, KV, blocks, bs, hd], after steps
            assert s["lora_B_q"] == s["lora_B_up"] == str(P(None, None, None, 'tensor'))
            assert s["lora_A_o"] == str(P(None, None, 'tensor'))
            assert s["reft_R"] == str(P(None, None, 'tensor'))         # [L, N, rank, embed]: the rank splits
    assert "not divisible" not in tiny["logs"]


@pytest.fixture(scope="module")
def smollm(default_gguf_path):
    return run_on_fake_devices(SMOLLM)


@pytest.mark.real_model
def test_smollm2_tensor2_replicates_indivisible_heads(smollm):
    r = smollm
    assert r["heads"] == [9, 3, 1536, 49152]
    assert r["tensor2"] == r["base"], r
    s = r["specs"]
    assert r["declared"]
    assert s["wq"] == s["wk"] == str(P())                             # 9 q / 3 kv heads: replicated
    assert s["lora_B_q"] == str(P(None, None, 'tensor'))              # its rank takes the axis the heads leave
    assert s["cache_k"] == str(P())
    assert s["w_up"] == str(P(None, None, 'tensor'))                  # ffn 1536 split
    assert s["w_down"] == str(P(None, 'tensor'))
    assert s["embed"] == str(P('tensor',))                            # vocab 49152 split
    assert s["lora_B_up"] == str(P(None, None, None, 'tensor'))
    assert "q_heads (9) is not divisible by mesh axes ('tensor',)" in r["logs"]
    assert "kv_heads (3) is not divisible" in r["logs"]
