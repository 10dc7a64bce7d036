"""Quantized base weights (preft_jax.quantize, qwix): int8 per-channel and int4 grouped quantization
against a float64 numpy recompute; the quantized model against the same model holding the
dequantized float weights (same numerics up to summation order), with adapters in float; sharded
placement of qvalues and scales on 8 fake devices; QLoRA training (gradients only for the adapter,
the loss falls); the engine and `serve generate --quantize`; GGUF Q8_0 / Q4_0 read straight into
QArrays vs the float round trip; the quantized decode step lowers for cuda and tpu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

qwix = pytest.importorskip("qwix")     # quantizing needs it; the float model does not (test_without_qwix.py)

from adapter_factory import random_lora, random_reft
from fake_devices import run_on_fake_devices
from preft_jax import native_decode
from preft_jax import quantize as qz
from preft_jax.adapters.bank import build_bank
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.loading.quantized import gguf_source, quantize_model_params
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from preft_jax.lowering import lower_for
from reference_llama import random_params

CFG = tiny_config()                 # d 64, ffn 128: int4 groups of 64 by default
seq_logits = jax.jit(sequence_logits, static_argnums=0)


# ---------------------------------------------------------------------- float64 references
def _groups(x, axis, group):
    """x with `axis` split into (n_groups, group) (group None: one group)."""
    group = x.shape[axis] if group is None else group
    return x.reshape(x.shape[:axis] + (x.shape[axis] // group, group) + x.shape[axis + 1:])


def _ref_quantize(w, qmax, axis, group=None):
    """Symmetric absmax quantization in float64 (qwix's documented numerics): scale = absmax / (qmax +
    0.5) over `axis` (whole, or in groups of `group`), q = round-half-even(w / scale) clipped to
    [-qmax - 1, qmax]. Returns (q, scale, zero point 0), broadcast to w's shape."""
    w = np.asarray(w, np.float64)
    g = _groups(w, axis, group)
    scale = np.broadcast_to(np.abs(g).max(axis=axis + 1, keepdims=True) / (qmax + 0.5), g.shape).reshape(w.shape)
    q = np.clip(np.round(w / scale), -qmax - 1, qmax)
    return q, scale, np.zeros_like(w)


def _ref_quantize_asymmetric(w, qmax, axis, group):
    """Asymmetric minmax quantization in float64: per group lo = min(min, 0), hi = max(max, 0),
    scale = (hi - lo) / (2 qmax + 1), integer zero point zp = round(-qmax - 1 - lo / scale),
    q = round(w / scale + zp) clipped to [-qmax - 1, qmax]; w ~ (q - zp) * scale."""
    w = np.asarray(w, np.float64)
    g = _groups(w, axis, group)
    lo = np.minimum(g.min(axis=axis + 1, keepdims=True), 0)
    hi = np.maximum(g.max(axis=axis + 1, keepdims=True), 0)
    scale = (hi - lo) / (2 * qmax + 1)
    zp = np.clip(np.round(-qmax - 1 - lo / scale), -qmax - 1, qmax)
    scale, zp = (np.broadcast_to(a, g.shape).reshape(w.shape) for a in (scale, zp))
    return np.clip(np.round(w / scale + zp), -qmax - 1, qmax), scale, zp


def _weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * rng.uniform(0.1, 3.0, shape[-1])     # per-channel ranges differ
    return (w + 0.01 * np.sign(w)).astype(np.float32)                    # non-zero everywhere


@pytest.mark.parametrize("mode,qmax,group", [("int8", 127, None), ("int4", 7, 32), ("int4", 7, 16)])
def test_quantize_weight_matches_float64_reference(mode, qmax, group):
    w = _weights((3, 96, 40), seed=qmax + (group or 0))
    w[0, :group or 96, 0] = np.abs(w[0, :group or 96, 0]) + 0.5          # a group of positive weights only
    q = qz.quantize_weight(w, mode, group)
    ref = _ref_quantize if mode == "int8" else _ref_quantize_asymmetric
    want_q, want_scale, want_zp = ref(w, qmax, 1, group)
    assert q.qvalue.dtype == qz.QTYPES[mode] and q.qvalue.shape == w.shape
    assert q.scale.shape == ((3, 1, 40) if group is None else (3, 96 // group, 40))
    assert (q.zero_point is None) == (mode == "int8")
    up = lambda a: np.repeat(np.asarray(a, np.float64), w.shape[1] // a.shape[1], 1)     # noqa: E731
    np.testing.assert_allclose(up(q.scale), want_scale, rtol=1e-6)
    zp = np.zeros_like(want_zp) if q.zero_point is None else up(q.zero_point)
    np.testing.assert_array_equal(zp, want_zp)
    got_q = np.asarray(q.qvalue, np.int32)
    # float32 arithmetic may land either side of an exact .5 tie (symmetric: the absmax element sits
    # at qmax + 0.5); elsewhere the integers are the float64 reference's
    tie = np.abs(np.abs(np.asarray(w, np.float64) / want_scale + want_zp) % 1 - 0.5) < 1e-4
    np.testing.assert_array_equal(got_q[~tie], want_q[~tie])
    assert np.all(np.abs(got_q - want_q) <= 1) and tie.mean() < 0.02        # ~ one absmax element per group
    deq = np.asarray(qz.dequantize(q), np.float64)
    np.testing.assert_allclose(deq, (got_q - want_zp) * want_scale, rtol=1e-6, atol=1e-6)
    # error: within half a step, except where the rounded zero point pushes a group's extreme past
    # the integer range (asymmetric: clipped, within one step)
    inside = np.abs(np.asarray(w, np.float64) / want_scale + want_zp) <= qmax + 0.5
    err = np.abs(deq - w) / want_scale
    assert err[inside].max() <= 0.5 + 1e-4 and err.max() <= 1 + 1e-4
    assert np.abs(deq - w).max() > 0                                     # it is lossy


def test_quantize_rows_and_scale_dtype():
    t = _weights((50, 64), seed=3)
    q = qz.quantize_rows(t, jnp.bfloat16)
    want_q, want_scale, _ = _ref_quantize(t, 127, axis=1)
    tie = np.abs(np.abs(np.asarray(t, np.float64) / want_scale) % 1 - 0.5) < 1e-4
    np.testing.assert_array_equal(np.asarray(q.qvalue, np.int32)[~tie], want_q[~tie])
    assert q.scale.shape == (50, 1) and q.scale.dtype == jnp.bfloat16      # computed in f32, stored in bf16
    np.testing.assert_allclose(np.asarray(q.scale, np.float64), want_scale[:, :1], rtol=2 ** -8)
    rows = np.array([[3, 0], [49, 3]])
    np.testing.assert_array_equal(np.asarray(qz.take(q, rows)), np.asarray(qz.dequantize(q))[rows])


def test_quant_config_errors():
    assert qz.QuantConfig.parse(None) is None and qz.QuantConfig.parse("none") is None
    assert qz.QuantConfig.parse("int4").group_for(CFG) == 64
    assert qz.QuantConfig.parse("int4").group_for(tiny_config(d_model=96, ffn_dim=192, head_dim=24)) == 32
    with pytest.raises(ValueError, match=r"no int4 group size in \(64, 32\) divides the projection input dimensions "
                                         r"\[80, 160\]; pass QuantConfig\(group_size=...\)"):
        qz.QuantConfig.parse("int4").group_for(tiny_config(d_model=80, ffn_dim=160, head_dim=20))
    assert qz.QuantConfig("int8").group_for(CFG) is None
    with pytest.raises(ValueError, match=r"quantize must be one of \('int8', 'int4'\), got 'int3'"):
        qz.QuantConfig("int3")
    with pytest.raises(ValueError, match="group_size is for int4"):
        qz.QuantConfig("int8", group_size=32)
    with pytest.raises(ValueError, match=r"int4 group_size 48 does not divide the projection input dimension\(s\) "
                                         r"\[64, 128\]"):
        qz.quantize_params(CFG, random_params(CFG), qz.QuantConfig("int4", group_size=48))


# ------------------------------------------------------------------------ model: quantized == dequantized
def _models(mode, dtype=jnp.float32, **kw):
    """(quantized model, the same model with the dequantized float weights, quantized params)."""
    qp = qz.quantize_params(CFG, random_params(CFG, seed=0), qz.QuantConfig(mode, **kw), dtype)
    return Llama.from_params(CFG, qp, dtype=dtype), Llama.from_params(CFG, qz.dequantize_params(qp), dtype=dtype), qp


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_equals_dequantized_float_model(mode):
    qm, fm, qp = _models(mode)
    assert qz.model_quantization(qm) == mode and qz.model_quantization(fm) is None
    for name in qz.PROJECTIONS + ("embed",):
        assert qz.is_quantized(qp[name]), name
    assert not qz.is_quantized(qp["attn_norm"])
    q, f = ModelRunner(qm), ModelRunner(fm)
    assert q.quantization == mode and f.quantization is None
    assert {x.dtype for x in jax.tree.leaves(q.state)} == {jnp.dtype(jnp.float32), jnp.dtype(qz.QTYPES[mode]),
                                                           jnp.dtype(jnp.int8)}      # embedding: int8 in both
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 12)), jnp.int32)
    plens = jnp.asarray([4, 12, 7], jnp.int32)
    # adapters stay float: a LoRA and a ReFT bank slot, prefill-only
    bank = build_bank(CFG, [random_lora(CFG, 1), random_reft(CFG, 2)])
    ids = jnp.asarray([1, 0, 2], jnp.int32)
    for b, i in ((None, None), (bank, ids)):
        lq = np.asarray(seq_logits(q.graphdef, q.state, tokens, plens, b, i))
        lf = np.asarray(seq_logits(f.graphdef, f.state, tokens, plens, b, i))
        np.testing.assert_allclose(lq, lf, rtol=1e-5, atol=1e-5 * np.abs(lf).max())
    float_model = ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))
    lo = np.asarray(seq_logits(float_model.graphdef, float_model.state, tokens, plens))
    assert np.abs(lo - np.asarray(seq_logits(q.graphdef, q.state, tokens, plens))).max() > 1e-3   # really quantized
    sp = SamplingParams(max_new_tokens=10, stop_token_ids=(-1,))
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 9)]
    assert ([g.tokens for g in q.generate(prompts, sp, bank=bank, adapter_ids=[1, 2])]
            == [g.tokens for g in f.generate(prompts, sp, bank=bank, adapter_ids=[1, 2])])


def test_bfloat16_scales_and_untied_head():
    cfg = tiny_config(tie_embeddings=False)
    qp = qz.quantize_params(cfg, random_params(cfg, seed=2), "int4", jnp.bfloat16)
    assert qp["lm_head"].scale.shape == (1, cfg.vocab_size) and qp["lm_head"].qvalue.dtype == jnp.int8
    qm = ModelRunner(Llama.from_params(cfg, qp, dtype=jnp.bfloat16))
    fm = ModelRunner(Llama.from_params(cfg, qz.dequantize_params(qp), dtype=jnp.bfloat16))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    plens = jnp.asarray([3, 9], jnp.int32)
    lq = np.asarray(seq_logits(qm.graphdef, qm.state, tokens, plens))
    lf = np.asarray(seq_logits(fm.graphdef, fm.state, tokens, plens))
    np.testing.assert_allclose(lq, lf, rtol=1e-2, atol=1e-2 * np.abs(lf).max())


def test_embeddings_can_stay_float():
    qp = qz.quantize_params(CFG, random_params(CFG), qz.QuantConfig("int8", embeddings=False))
    assert not qz.is_quantized(qp["embed"]) and qz.is_quantized(qp["w_down"])


# ------------------------------------------------------------------------------- the engine and CLIs
@pytest.mark.slow
def test_engine_quantized_runs_on_xla_with_a_reason():
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    qm, fm, _ = _models("int8")
    assert native_decode.unsupported_reason(CFG, jnp.float32, quantization="int8") == (
        "the base weights are quantized (int8); the native step packs and reads float32 weights")
    kw = dict(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    with pytest.raises(ValueError, match=r"cpu_decode='native' is unavailable: the base weights are quantized "
                                         r"\(int8\)"):
        Engine(ModelRunner(qm), AdapterRegistry(CFG, 0), EngineConfig(cpu_decode="native", **kw))
    outs = []
    for model, cpu_decode in ((qm, "auto"), (fm, "xla")):
        reg = AdapterRegistry(CFG, 2, lora_rank=4, reft_rank=4)
        reg.load("a", random_lora(CFG, 1))
        eng = Engine(ModelRunner(model), reg, EngineConfig(cpu_decode=cpu_decode, block_size=4, **kw))
        assert eng.step_runner.native is None
        rng = np.random.default_rng(5)
        reqs = [eng.submit(rng.integers(0, CFG.vocab_size, n).tolist(), a, SamplingParams(max_new_tokens=8,
                                                                                          stop_token_ids=(-1,)))
                for n, a in ((6, "a"), (11, None), (4, "a"))]
        while not all(r.finished for r in reqs):
            eng.step()
        outs.append([list(r.tokens) for r in reqs])
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_serve_generate_quantize_flag():
    from test_serve_cli import run_cli
    for mode in ("int8", "int4"):
        r = run_cli("generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "6", "--quantize", mode,
                    "--no-cache", "--quiet")
        assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("generate", "--model", "tiny", "--prompt", "hello", "--quantize", "int3")
    assert r.returncode == 2 and "argument --quantize: invalid choice: 'int3'" in r.stderr


@pytest.mark.real_model
@pytest.mark.slow
def test_serve_generate_quantize_int8_real_model(default_gguf_path):
    from test_serve_cli import run_cli
    r = run_cli("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12", "--quantize", "int8",
                "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout


def test_train_quantize_flag():
    from train import cli
    from train.config import ModelOptions
    from train.grpo import _parse as grpo_parse
    from train.sft import _parse
    assert cli.model_options(_parse(["--quantize", "int4"])) == ModelOptions(quantize="int4")
    assert cli.model_options(grpo_parse(["--quantize", "int8"])).quantize == "int8"
    assert cli.model_options(_parse([])).quantize is None
    with pytest.raises(SystemExit):
        _parse(["--quantize", "fp8"])
    with pytest.raises(ValueError, match=r"quantize must be one of \('int8', 'int4'\) or None, got 'nf4'"):
        ModelOptions(quantize="nf4")


# ------------------------------------------------------------------------------------------ QLoRA
@pytest.mark.slow
def test_qlora_trains_only_the_adapter():
    from train.config import AdapterSpec, OptimizerConfig
    from train.data import Tokenized
    from train.sft import SFTConfig, SFTTrainer, batch_arrays
    from train.data import pad_batch
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 40, rng.integers(3, 8))] for _ in range(32)]
    data = Tokenized(prompts, [[p[0] + 50, p[0] + 100, 2] for p in prompts], [0] * 32)
    tc = SFTConfig(adapter=AdapterSpec(kind="lora", rank=4), steps=15, batch_size=16, log_every=0, seq_len=16,
                   optimizer=OptimizerConfig(lr=2e-2, warmup_steps=2))
    qm, _, _ = _models("int4")
    runner = ModelRunner(qm)
    tr = SFTTrainer(CFG, runner.graphdef, runner.state, tc)
    before = [np.asarray(x) for x in jax.tree.leaves(tr.base_state)]
    # the gradient tree is exactly the adapter params; the frozen base has integer weights (no gradient)
    state = tr.init_state()
    batch = {k: jnp.asarray(v) for k, v in batch_arrays(pad_batch(prompts[:4], data.responses[:4], 0, 16)).items()}
    grads = jax.grad(lambda p: tr.loss(p, tr.base_state, batch)[0])(state.params)
    assert jax.tree.structure(grads) == jax.tree.structure(state.params)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
        jax.grad(lambda s: tr.loss(state.params, s, batch)[0])(tr.base_state)
    state, hist = tr.fit(data)
    losses = [h["loss"] for h in hist]
    assert losses[-1] < 0.3 * losses[0], losses
    after = jax.tree.leaves(tr.base_state)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, after))     # the base never moves
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


# ----------------------------------------------------------------------------------------- sharding
SHARDED_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from preft_jax import quantize as qz, sharding as shd
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from reference_llama import random_params
cfg = tiny_config(d_model=128, n_heads=8, n_kv_heads=4, head_dim=16, ffn_dim=256, vocab_size=512)
mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
f = jax.jit(sequence_logits, static_argnums=0)
tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 10)), jnp.int32)
plens = jnp.asarray([3, 10, 5, 7], jnp.int32)
out = {}
for name, qc in (("int8", qz.QuantConfig("int8")), ("int4g16", qz.QuantConfig("int4", group_size=16)),
                 ("int4g32", qz.QuantConfig("int4", group_size=32))):
    qp = qz.quantize_params(cfg, random_params(cfg, seed=0), qc)
    single = ModelRunner(Llama.from_params(cfg, qp))
    sharded = ModelRunner(Llama.from_params(cfg, qp), mesh=mesh)
    specs = {}
    for path, x in jax.tree_util.tree_flatten_with_path(sharded.state)[0]:
        p = shd.path_name(path)
        if p.split("/")[-1] in ("qvalue", "scale", "zero_point"):
            specs[p] = [str(x.sharding.spec), str(x.dtype), len(x.sharding.device_set)]
    want = np.asarray(f(single.graphdef, single.state, tokens, plens))
    with sharded.mesh_context():
        got = np.asarray(f(sharded.graphdef, sharded.state, tokens, plens))
    out[name] = {"specs": specs, "err": float(np.abs(got - want).max()), "scale": float(np.abs(want).max())}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_sharded_quantized_weights_on_8_fake_devices():
    r = run_on_fake_devices(SHARDED_SCRIPT, 8, cheap_codegen=True)
    for name, res in r.items():
        assert res["err"] <= 1e-4 * res["scale"], (name, res["err"])     # sharded == single-device
        assert all(v[2] == 8 for v in res["specs"].values())
    s8, s16, s32 = r["int8"]["specs"], r["int4g16"]["specs"], r["int4g32"]["specs"]
    # qvalues keep the weight's axes (embed -> fsdp, heads / mlp / vocab -> tensor) and their int dtype
    assert s8["layers/wq/qvalue"][:2] == ["P(None, 'fsdp', 'tensor')", "int8"]
    assert s16["layers/wq/qvalue"][:2] == ["P(None, 'fsdp', 'tensor')", "int4"]
    assert s8["embed/qvalue"][0] == "P('tensor', 'fsdp')"
    # per-channel scales follow the output axis only
    assert s8["layers/wq/scale"][:2] == ["P(None, None, 'tensor')", "float32"]
    assert s8["layers/wo/scale"][0] == "P(None, None, 'fsdp')"
    assert s8["embed/scale"][0] == "P('tensor',)"
    # grouped scales follow the input axis too: d_model groups over fsdp, ffn groups over tensor,
    # query-head groups over tensor when every head holds whole groups (head_dim 16, group 16) ...
    assert s16["layers/wq/scale"][0] == "P(None, 'fsdp', 'tensor')"
    assert s16["layers/w_down/scale"][0] == "P(None, 'tensor', 'fsdp')"
    assert s16["layers/wo/scale"][0] == "P(None, 'tensor', 'fsdp')"
    assert s16["layers/wq/zero_point"][:2] == ["P(None, 'fsdp', 'tensor')", "int4"]     # int4: asymmetric
    # ... and replicated over it when groups span heads (group 32 > head_dim 16)
    assert s32["layers/wo/scale"][0] == "P(None, None, 'fsdp')"
    assert s32["layers/wo/qvalue"][0] == "P(None, 'tensor', 'fsdp')"


# --------------------------------------------------------------------------------------- GGUF direct
@pytest.mark.parametrize("qtype,mode", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_gguf_blocks_load_straight_into_qarrays(tmp_path, qtype, mode):
    from tiny_gguf import write_tiny_gguf
    from preft_jax.loading.gguf_loader import load_gguf
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(path, seed=3, qtype=qtype)
    cfg, params, _ = load_gguf(path)                      # the float round trip (gguf's dequantization)
    direct = quantize_model_params(cfg, params, mode, path=path)
    requant = qz.quantize_params(cfg, params, qz.QuantConfig(mode, group_size=32 if mode == "int4" else None))
    for name in qz.PROJECTIONS + ("embed",):
        q = direct[name]
        assert q.qvalue.dtype == (jnp.int8 if name == "embed" else qz.QTYPES[mode]), name
        if name == "embed":                               # blocks of 32 along the input (contraction) axis
            assert q.scale.shape == (cfg.vocab_size, cfg.d_model // 32)
        else:
            assert q.scale.shape == (cfg.n_layers, q.qvalue.shape[1] // 32, q.qvalue.shape[2]), name
        # direct: the file's exact values, no requantization error
        np.testing.assert_array_equal(np.asarray(qz.dequantize(q)), params[name], err_msg=name)
    # the layouts agree: qwix requantizing the float round trip with the file's blocks (and ggml's
    # Q8_0 bound, absmax / 127) gives back the very integers and scales
    if qtype == "Q8_0":
        for name in qz.PROJECTIONS:
            w = jnp.asarray(params[name])
            again = qwix.quantize(w, jnp.int8, channelwise_axes=(0, 2), tiled_axes={1: 32},
                                  calibration_method=f"absmax,{127.5 / 127}")
            np.testing.assert_array_equal(np.asarray(again.qvalue), np.asarray(direct[name].qvalue), err_msg=name)
            np.testing.assert_allclose(np.asarray(again.scale), np.asarray(direct[name].scale), rtol=1e-6)
    else:   # Q4_0's scale may be negative (ggml maps the largest-magnitude value to -8): no absmax twin
        assert any(float(direct[n].scale.min()) < 0 for n in qz.PROJECTIONS)
    # so the direct model computes what the float model computes; qwix's own requantization does not
    f = ModelRunner(Llama.from_params(cfg, params))
    d = ModelRunner(Llama.from_params(cfg, direct))
    r = ModelRunner(Llama.from_params(cfg, requant))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    plens = jnp.asarray([4, 9], jnp.int32)
    lf, ld, lr = (np.asarray(seq_logits(m.graphdef, m.state, tokens, plens)) for m in (f, d, r))
    np.testing.assert_allclose(ld, lf, rtol=1e-5, atol=1e-5 * np.abs(lf).max())
    assert np.abs(lr - lf).max() > 1e-4


def test_gguf_other_types_are_requantized(tmp_path):
    """A Q8_0 file in int4 mode: projections requantized to int4 (groups of the config), the
    embedding (Q8_0) still read as it is."""
    from tiny_gguf import write_tiny_gguf
    from preft_jax.loading.gguf_loader import load_gguf
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=4)
    cfg, params, _ = load_gguf(path)
    qp = quantize_model_params(cfg, params, "int4", path=path)
    assert qz.QuantConfig("int4").group_for(cfg) == 32                      # ffn 96: groups of 32
    assert qp["wq"].qvalue.dtype == jnp.int4 and qp["wq"].scale.shape[1] == cfg.d_model // 32
    assert not np.array_equal(np.asarray(qz.dequantize(qp["wq"])), params["wq"])   # requantized: lossy
    assert qp["embed"].scale.shape == (cfg.vocab_size, cfg.d_model // 32)
    np.testing.assert_array_equal(np.asarray(qz.dequantize(qp["embed"])), params["embed"])
    assert gguf_source(tmp_path) is None


# --------------------------------------------------------------------------------------- lowering
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_decode_step_lowers(platform, mode):
    """The engine's paged decode step (base and adapted) with quantized weights lowers for the
    accelerators from abstract arguments; the weights enter the program as int8 / int4."""
    from preft_jax.paged_kv import PagedBatch, PagedKVCache
    from preft_jax.paged_step import paged_step
    cfg = tiny_config(d_model=256, n_heads=2, n_kv_heads=1, head_dim=128, ffn_dim=512, vocab_size=1024, n_layers=2)
    qp = qz.quantize_params(cfg, random_params(cfg, seed=0), mode)
    runner = ModelRunner(Llama.from_params(cfg, qp))
    R, nb, bs = 8, 4, 16
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)          # noqa: E731
    state = jax.tree.map(spec, runner.state)
    cache = jax.tree.map(spec, PagedKVCache.create(cfg, 64, bs))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)               # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)             # noqa: E731
    batch = PagedBatch(i32(R, nb), i32(R), i32(R), i32(R, 1))
    bank = jax.tree.map(spec, build_bank(cfg, [random_lora(cfg, 1)]))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    for b, ids in ((None, None), (bank, i32(R))):
        text = lower_for(paged_step, runner.graphdef, state, i32(R, 1), batch, cache, b, ids, i32(R), f32(R),
                         f32(R), i32(R), key, platform=platform).as_text()
        assert ("xi4>" if mode == "int4" else "xi8>") in text
