"""Causal chunk attention (preft_jax.chunk_attention): the flash kernels (GPU Triton interpreted, TPU
Mosaic under force_tpu_interpret_mode) against a float64 numpy recompute, forward and gradients;
the model's training loss and its adapter gradient with a flash kernel against the XLA reference,
unsharded and in shard_map under a data x tensor mesh; cuda / tpu lowerings that hold the kernels
and no [T, T] score matrix; the choice and its errors."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fake_devices import run_on_fake_devices
from preft_jax import chunk_attention as ca
from preft_jax.config import tiny_config
from preft_jax.lowering import lower_for

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly


def attention64(q, k, v, do):
    """float64 causal GQA attention and its gradients: (out, dq, dk, dv) for the cotangent `do`."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    B, T, H, hd = q.shape
    KV = k.shape[2]
    G = H // KV
    kr, vr = np.repeat(k, G, 2), np.repeat(v, G, 2)
    s = np.einsum("bthd,bshd->bhts", q, kr) * hd ** -0.5
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshd->bthd", p, vr)
    dvr = np.einsum("bhts,bthd->bshd", p, do)
    dp = np.einsum("bthd,bshd->bhts", do, vr)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * hd ** -0.5
    dq = np.einsum("bhts,bshd->bthd", ds, kr)
    dkr = np.einsum("bhts,bthd->bshd", ds, q)
    per_kv = lambda x: x.reshape(B, T, KV, G, hd).sum(3)      # noqa: E731 - the group's heads share a KV head
    return out, dq, per_kv(dkr), per_kv(dvr)


def _errors(impl, T, dtype, H=4, KV=2, hd=32, B=2, seed=0):
    """Max abs error of `impl`'s output and gradients against float64 (the inputs as given), and the
    same for the XLA reference."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, hd)), dtype) for n in (H, KV, KV))
    do = jnp.asarray(rng.standard_normal((B, T, H, hd)), dtype)
    want = attention64(q, k, v, do)
    out = {}
    for name in (impl, "xla"):
        f = lambda q, k, v, name=name: ca.causal_attention(q, k, v, name)            # noqa: E731
        o, vjp = jax.vjp(jax.jit(f), q, k, v)
        got = (o,) + vjp(do)
        out[name] = [float(np.abs(np.asarray(g, np.float64) - w).max()) for g, w in zip(got, want)]
    return out[impl], out["xla"]


@pytest.mark.parametrize("T, dtype", [(48, jnp.float32), (200, jnp.float32), (128, jnp.bfloat16)])
def test_gpu_kernel_matches_float64(T, dtype):
    # 48: one block, padded to 64; 200: two 128-blocks, padded to 256; GQA (4 query heads, 2 KV heads)
    got, xla = _errors("flash:gpu", T, dtype)
    if dtype == jnp.float32:
        assert max(got) < 1e-5, got
    else:                                     # bfloat16 operands: as close as the XLA reference is
        assert max(got) < 0.05 and all(g <= 2 * x + 1e-3 for g, x in zip(got, xla)), (got, xla)


def test_tpu_kernel_matches_float64():
    from jax.experimental.pallas import tpu as pltpu
    with pltpu.force_tpu_interpret_mode():    # forward and backward traced under it
        got, _ = _errors("flash:tpu", 200, jnp.float32, hd=64)
    assert max(got) < 1e-5, got


def _sft_case(chunk_attention, rows: int = 3):
    from preft_jax.adapters.trainable import init_adapter
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from reference_llama import random_params
    from train.config import AdapterSpec
    from train.data import pad_batch
    from train.sft import batch_arrays
    cfg = tiny_config()
    runner = ModelRunner(Llama.from_params(cfg, random_params(cfg, seed=0), chunk_attention=chunk_attention))
    acfg = AdapterSpec(kind="lora", rank=4, mode="prefill", targets=("q", "k", "v", "o", "gate", "up", "down")).build(cfg)
    params = init_adapter(cfg, acfg, jax.random.key(1))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, cfg.vocab_size, n))) for n in (5, 30, 3, 12)[:rows]]
    responses = [list(map(int, rng.integers(3, cfg.vocab_size, n))) + [2] for n in (40, 2, 6, 10)[:rows]]
    arrays = {k: jnp.asarray(v) for k, v in batch_arrays(pad_batch(prompts, responses, pad_id=0, length=48)).items()}
    return cfg, acfg, runner, params, arrays


@pytest.mark.parametrize("remat", [False, True])
def test_sft_loss_and_adapter_gradient_match_the_reference(remat):
    # the prompts and responses leave 5-35 positions of padding; remat: the trainers' default
    from train.sft import sft_loss_terms
    results = {}
    for impl in ("xla", "flash:gpu"):
        cfg, acfg, runner, params, arrays = _sft_case(impl)
        assert runner.chunk_attention == impl

        def loss(p, runner=runner):
            nll, n = sft_loss_terms(cfg, acfg, runner.graphdef, runner.state, p, arrays, 16, remat=remat)
            return nll / n
        results[impl] = jax.jit(jax.value_and_grad(loss))(params)
    (lx, gx), (lf, gf) = results["xla"], results["flash:gpu"]
    assert abs(float(lx)) > 1 and abs(float(lf) - float(lx)) < 1e-5 * abs(float(lx))
    for a, b in zip(jax.tree.leaves(gx), jax.tree.leaves(gf)):
        scale = float(jnp.abs(a).max())
        assert scale > 1e-6 and float(jnp.abs(a - b).max()) < 1e-4 * scale


@pytest.mark.parametrize("kind, platform, call", [("gpu", "cuda", "__gpu$xla.gpu.triton"),
                                                  ("tpu", "tpu", "tpu_custom_call")])
def test_training_gradient_lowers_with_the_kernel_and_no_score_matrix(kind, platform, call):
    # the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128) at 1024 tokens
    q = jax.ShapeDtypeStruct((2, 1024, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    texts = {}
    for impl in (f"flash:{kind}", "xla"):
        f = jax.grad(lambda q, k, v, impl=impl: ca.causal_attention(q, k, v, impl).astype(jnp.float32).sum(),
                     argnums=(0, 1, 2))
        texts[impl] = lower_for(jax.jit(f), q, kv, kv, platform=platform).as_text()
    flash = texts[f"flash:{kind}"]
    assert len(re.findall(re.escape(call), flash)) >= 3          # forward, and the backward's kernels
    assert "1024x1024xf32" not in flash and "1024x1024xbf16" not in flash
    assert "1024x1024xf32" in texts["xla"] and call not in texts["xla"]


def test_model_training_step_lowers_for_cuda_with_the_kernel():
    # the SFT gradient of the tiny model (3 rows x 48 positions): the reference's [B, KV, G, T, T]
    # scores are there with "xla" and no [T, T] array at all with the kernel
    from train.sft import sft_loss
    scores = {}
    for impl in ("flash:gpu", "xla"):
        cfg, acfg, runner, params, arrays = _sft_case(impl)
        f = jax.jit(jax.grad(lambda p: sft_loss(cfg, acfg, runner.graphdef, runner.state, p, arrays, 16)))
        text = lower_for(f, params, platform="cuda").as_text()
        scores[impl] = (re.findall(r"tensor<[0-9x]*48x48x\w+>", text), "__gpu$xla.gpu.triton" in text)
    assert scores["flash:gpu"] == ([], True)
    assert "tensor<3x2x2x48x48xf32>" in scores["xla"][0] and not scores["xla"][1]


SHARDED = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from preft_jax import sharding as shd
from test_chunk_attention import _sft_case
from train.sft import sft_loss_terms
mesh = shd.make_mesh(data=2, tensor=2)
out = {}
for impl in ("xla", "flash:gpu"):
    cfg, acfg, runner, params, arrays = _sft_case(impl, rows=4)       # 4 rows: the batch splits over data
    if impl != "xla":
        runner = runner.with_mesh(mesh)

    def loss(p):                 # rematerialized layers, as the trainers run them
        nll, n = sft_loss_terms(cfg, acfg, runner.graphdef, runner.state, p, arrays, 16, remat=True)
        return nll / n
    f = jax.jit(jax.value_and_grad(loss))
    with runner.mesh_context():
        jaxpr = str(jax.make_jaxpr(f)(params))
        loss, grads = f(params)
    maps = [ln for ln in jaxpr.splitlines() if "shard_map" in ln or "in_specs" in ln]
    out[impl] = {"loss": float(loss), "grads": [np.asarray(g).tolist() for g in jax.tree.leaves(grads)],
                 "shard_map": bool(maps), "specs": "\n".join(maps)}
print("RESULT" + json.dumps(out))
"""


def test_sharded_flash_matches_the_unsharded_reference():
    res = run_on_fake_devices(SHARDED, n_devices=4, cheap_codegen=True)
    ref, got = res["xla"], res["flash:gpu"]
    assert got["shard_map"] and not ref["shard_map"]
    # the kernel's operands split over both axes: batch over data, heads over tensor
    assert "P('data', None, 'tensor')" in got["specs"], got["specs"][:2000]
    assert abs(got["loss"] - ref["loss"]) < 1e-5 * abs(ref["loss"])
    for a, b in zip(ref["grads"], got["grads"]):
        a, b = np.asarray(a), np.asarray(b)
        assert float(np.abs(a - b).max()) < 1e-4 * float(np.abs(a).max())


def test_resolve(monkeypatch):
    monkeypatch.delenv(ca.ENV, raising=False)
    assert ca.resolve(None, jnp.float32) == "xla"                            # auto on this CPU
    assert ca.resolve("auto", jnp.bfloat16, platform="gpu") == "flash:gpu"   # the kernel lowers for cuda here
    assert ca.resolve("auto", jnp.bfloat16, platform="tpu") == "flash:tpu"
    assert ca.resolve("auto", jnp.float32, platform="gpu") == "xla"          # float32 stays on the reference
    assert ca.resolve("flash", jnp.float32, platform="gpu") == "flash:gpu"   # unless asked for by name
    assert ca.resolve("flash:tpu", jnp.float32) == "flash:tpu"               # named: lowers for a TPU from here
    monkeypatch.setenv(ca.ENV, "flash:gpu")
    assert ca.resolve(None, jnp.float32) == "flash:gpu"
    monkeypatch.setenv(ca.ENV, "fast")
    with pytest.raises(ValueError, match=r"^PREFT_JAX_CHUNK_ATTENTION must be one of \('auto', 'xla', 'flash', "
                                         r"'flash:gpu', 'flash:tpu'\), got 'fast'$"):
        ca.resolve(None, jnp.float32)
    with pytest.raises(ValueError, match=r"^chunk_attention='flash' needs a GPU or a TPU \(this is 'cpu'\); use 'xla', "
                                         r"or name a kernel \('flash:gpu' runs in Pallas interpret mode off a GPU; "
                                         r"'flash:tpu' off a TPU only lowers for one, or runs under "
                                         r"force_tpu_interpret_mode\)$"):
        ca.resolve("flash", jnp.bfloat16)


def test_a_kernel_that_does_not_lower_falls_back_under_auto_and_is_an_error_by_name(monkeypatch, caplog):
    monkeypatch.setitem(ca._probed, "gpu", "RuntimeError: no Triton here")
    monkeypatch.setattr(ca, "_logged", set())
    with caplog.at_level("WARNING", logger="preft_jax.chunk_attention"):
        assert ca.resolve("auto", jnp.bfloat16, platform="gpu") == "xla"
    assert caplog.messages == ["chunk attention: the gpu flash kernel does not lower here (RuntimeError: no Triton "
                               "here); using xla"]
    for asked in ("flash:gpu", "flash"):
        with pytest.raises(ValueError, match=rf"^chunk_attention='{asked}': the gpu flash kernel does not lower here: "
                                             r"RuntimeError: no Triton here$"):
            ca.resolve(asked, jnp.bfloat16, platform="gpu")


def test_self_check_runs_the_kernel_against_the_reference(monkeypatch):
    assert ca.self_check("flash:gpu", jnp.float32, T=48, hd=32) == ""
    monkeypatch.setattr(ca, "_flash", lambda q, k, v, kind, scale: q)          # a kernel that computes wrong
    assert ca.self_check("flash:gpu", jnp.float32, T=48, hd=32).startswith("output differs from the xla "
                                                                            "reference by ")

    def broken(q, k, v, kind, scale):
        raise RuntimeError("Triton compilation failed\nmore")
    monkeypatch.setattr(ca, "_flash", broken)
    assert ca.self_check("flash:gpu", jnp.float32, T=48, hd=32) == "RuntimeError: Triton compilation failed"
