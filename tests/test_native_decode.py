"""The native CPU decode step (pallas_kernels.cpu, preft_jax.native_decode) against independent
references: the packed matmul against float64 numpy on random shapes (column and row tails); the
decoder layers against a float64 recompute of whole sequences and against the XLA paged path on the
same pool (random block placement, padding rows, dropped writes, biases, untied heads); engine
outputs with cpu_decode native vs xla; bad indices are errors that leave the pool untouched; only a
base-weights decode call is native; the allow-list of ModelConfig fields."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu
from preft_jax import native_decode
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.paged_kv import PagedBatch, PagedKVCache
from preft_jax.paged_step import paged_logits, paged_step
from reference_llama import random_params, reference_logits

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"native CPU decode unavailable: "
                                                            f"{cpu.unavailable_reason()}")
CFG = tiny_config()
BIASED = tiny_config(qkv_bias=True, tie_embeddings=False, vocab_size=250, ffn_dim=100)
# wide enough that the step's GEMMs and attention split across threads (decode.cc ThreadsFor: one
# thread per 2 MFLOP): the other configs run every region on one thread
WIDE = tiny_config(d_model=256, n_heads=8, n_kv_heads=2, head_dim=32, ffn_dim=512, vocab_size=3000, n_layers=2,
                   max_seq_len=512)


@pytest.mark.parametrize("M,K,N", [(1, 7, 5), (5, 64, 48), (6, 50, 150), (7, 40, 100), (8, 33, 97), (13, 100, 200),
                                   (32, 64, 1000)])
def test_packed_matmul_matches_float64(M, K, N):
    rng = np.random.default_rng(M * 1000 + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    wp = cpu.pack_panels(w)
    assert wp.shape == (-(-N // 48), K, 48)
    got = np.asarray(jax.jit(lambda a, b: cpu.packed_matmul(a, b, N))(x, wp))
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(cpu.packed_matmul_reference(x, wp, N)), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


def test_packed_matmul_rejects_wrong_layouts():
    x = jnp.ones((4, 16), jnp.float32)
    with pytest.raises(ValueError, match="packed float32"):
        cpu.packed_matmul(x, jnp.ones((16, 48), jnp.float32)[None], 100)         # 100 columns need 3 panels
    with pytest.raises(TypeError, match="float32"):
        cpu.packed_matmul(x.astype(jnp.bfloat16), cpu.pack_panels(jnp.ones((16, 40))), 40)


def _model(cfg, seed=1):
    params = random_params(cfg, seed)
    if cfg.qkv_bias:
        rng = np.random.default_rng(seed)
        for b, n in (("bq", cfg.q_dim), ("bk", cfg.kv_dim), ("bv", cfg.kv_dim)):
            params[b] = (0.3 * rng.standard_normal((cfg.n_layers, n))).astype(np.float32)
    return Llama.from_params(cfg, params), params


def _random_step(cfg, rng, R=11, NB=30, BS=4, nb=6):
    """A decode step over a pool of random values: random tables, context lengths, one padding row,
    one dropped write; rows write into distinct fresh blocks that no row reads."""
    shape = (cfg.n_layers, cfg.n_kv_heads, NB, BS, cfg.head_dim)
    cache = PagedKVCache(jnp.asarray(rng.standard_normal(shape), jnp.float32),
                         jnp.asarray(rng.standard_normal(shape), jnp.float32))
    bt = rng.integers(1, NB - R, (R, nb)).astype(np.int32)
    ctx = rng.integers(0, nb * BS, R).astype(np.int32)
    clen = np.ones(R, np.int32)
    widx = ((NB - R + np.arange(R)) * BS + rng.integers(0, BS, R)).astype(np.int32)[:, None]
    clen[3], widx[3] = 0, NB * BS            # a padding row
    widx[min(5, R - 1)] = NB * BS            # a dropped write
    tokens = rng.integers(0, cfg.vocab_size, (R, 1)).astype(np.int32)
    return jnp.asarray(tokens), PagedBatch(jnp.asarray(bt), jnp.asarray(ctx), jnp.asarray(clen), jnp.asarray(widx)), cache


@pytest.mark.parametrize("cfg,shape", [(CFG, {}), (BIASED, {}), (WIDE, dict(R=40, NB=300, BS=16, nb=24))],
                         ids=["tied", "bias-untied-odd-dims", "wide-threaded"])
def test_decode_step_matches_xla_paged_path(cfg, shape):
    model, _ = _model(cfg)
    runner = ModelRunner(model)
    native = native_decode.pack(model)
    rng = np.random.default_rng(0)
    tokens, batch, cache = _random_step(cfg, rng, **shape)
    copy = jax.tree.map(jnp.copy, cache)
    want, want_cache = paged_logits(runner.graphdef, runner.state, tokens, batch, copy)
    got, greedy, got_cache = jax.jit(lambda t, b, c: native_decode.decode_logits(model, native, t, b, c))(
        tokens, batch, cache)
    real = np.asarray(batch.chunk_lens) > 0
    want, got = np.asarray(want)[real], np.asarray(got)[real]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()
    np.testing.assert_array_equal(np.asarray(greedy)[real], got.argmax(-1))
    for w, g in ((want_cache.k, got_cache.k), (want_cache.v, got_cache.v)):
        w, g = np.asarray(w), np.asarray(g)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        written = np.zeros(w.shape[2] * w.shape[3], bool)
        written[[int(i) for i in np.asarray(batch.write_index)[real, 0] if i < written.size]] = True
        untouched = ~written.reshape(w.shape[2], w.shape[3])
        np.testing.assert_array_equal(g[:, :, untouched], w[:, :, untouched])   # the rest of the pool, bitwise


def test_decode_steps_match_float64_recompute():
    """Sequences prefilled by the XLA path, then decoded token by token natively (teacher-forced),
    each decode position's logits against a float64 recompute of the whole sequence."""
    model, params = _model(CFG, seed=3)
    runner = ModelRunner(model)
    native = native_decode.pack(model)
    rng = np.random.default_rng(3)
    NB, BS, R, P, T = 40, 4, 3, 5, 13
    seqs = rng.integers(0, CFG.vocab_size, (R, T)).astype(np.int32)
    blocks = rng.permutation(np.arange(1, NB))[:R * 4].reshape(R, 4).astype(np.int32)
    cache = PagedKVCache.create(CFG, NB, BS)
    widx = (blocks[:, np.arange(P) // BS] * BS + np.arange(P) % BS).astype(np.int32)
    batch = PagedBatch(jnp.asarray(blocks), jnp.zeros(R, jnp.int32), jnp.full(R, P, jnp.int32), jnp.asarray(widx))
    _, cache = paged_logits(runner.graphdef, runner.state, jnp.asarray(seqs[:, :P]), batch, cache)
    step = jax.jit(lambda t, b, c: native_decode.decode_logits(model, native, t, b, c))
    want = reference_logits(CFG, params, seqs)
    for pos in range(P, T):
        w = (blocks[:, pos // BS] * BS + pos % BS)[:, None].astype(np.int32)
        batch = PagedBatch(jnp.asarray(blocks), jnp.full(R, pos, jnp.int32), jnp.ones(R, jnp.int32), jnp.asarray(w))
        got, greedy, cache = step(jnp.asarray(seqs[:, pos:pos + 1]), batch, cache)
        np.testing.assert_array_equal(np.asarray(greedy), np.asarray(got).argmax(-1))
        np.testing.assert_allclose(np.asarray(got), want[:, pos], rtol=1e-4, atol=1e-4 * np.abs(want[:, pos]).max())
        assert (np.asarray(got).argmax(-1) == want[:, pos].argmax(-1)).all()


@pytest.mark.parametrize("bad", ["block", "context", "write"])
def test_bad_indices_are_errors_and_leave_the_pool_untouched(bad):
    model, _ = _model(CFG)
    native = native_decode.pack(model)
    tokens, batch, cache = _random_step(CFG, np.random.default_rng(5))
    bt, ctx, widx = np.asarray(batch.block_tables).copy(), np.asarray(batch.context_lens).copy(), \
        np.asarray(batch.write_index).copy()
    ctx[0] = 9
    if bad == "block":
        bt[0, 1], match = 10_000, "outside the pool"
    elif bad == "context":
        ctx[0], match = bt.shape[1] * 4 + 1, "exceeds its block table"
    else:
        widx[0], match = -3, "negative write index"
    batch = PagedBatch(jnp.asarray(bt), jnp.asarray(ctx), batch.chunk_lens, jnp.asarray(widx))
    before = np.asarray(cache.k).copy()
    with pytest.raises(Exception, match=match):
        out, _, cache2 = native_decode.decode_logits(model, native, tokens, batch, cache)
        jax.block_until_ready(out)
    np.testing.assert_array_equal(np.asarray(cache.k), before)


@pytest.mark.parametrize("with_bank", [False, True])
def test_native_weights_leave_prefill_and_adapted_calls_to_xla(with_bank):
    """Only a base-weights decode call (C == 1, no bank) is native: chunks (C > 1) and adapted calls
    given native weights compile to the XLA program, with no native custom call in them."""
    from adapter_factory import random_lora
    from preft_jax.adapters.bank import build_bank
    from preft_jax.adapters.config import PositionPolicy
    model, _ = _model(BIASED)
    runner = ModelRunner(model)
    native = native_decode.pack(model)
    _, batch, cache = _random_step(BIASED, np.random.default_rng(8), R=4)
    R, C = 4, 3
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, BIASED.vocab_size, (R, C)), jnp.int32)
    batch = PagedBatch(batch.block_tables, batch.context_lens % 8, jnp.full(R, C, jnp.int32),
                       jnp.full((R, C), 10_000, jnp.int32))
    bank = ids = None
    if with_bank:
        bank = build_bank(BIASED, [random_lora(BIASED, 1, policy=PositionPolicy(mode="all"), targets=("q", "up"))])
        ids = jnp.asarray([1, 0, 1, 1], jnp.int32)
    samp = (jnp.zeros(R), jnp.ones(R), jnp.zeros(R, jnp.int32), jax.random.PRNGKey(0))
    args = (runner.graphdef, runner.state, tokens, batch, cache, bank, ids, jnp.full(R, 100, jnp.int32), *samp, None)
    with_native = paged_step.lower(*args, native, return_logits=True).as_text()
    assert "preft_" not in with_native
    assert with_native == paged_step.lower(*args, None, return_logits=True).as_text()
    decode = paged_step.lower(runner.graphdef, runner.state, tokens[:, :1], batch, cache, None, None,
                              jnp.ones(R, jnp.int32), *samp, None, native).as_text()
    assert "preft_decode_step" in decode


def test_unsupported_reasons():
    assert "bfloat16" in native_decode.unsupported_reason(CFG, jnp.bfloat16)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",))
    assert "mesh" in native_decode.unsupported_reason(CFG, jnp.float32, mesh)
    assert native_decode.unsupported_reason(CFG, jnp.float32) == ""


def test_unsupported_reasons_allow_list_every_config_field():
    """Each ModelConfig field is either allowed with the values the native step implements or
    named in the reason; a field the allow-list does not know (a new model feature) falls back."""
    import dataclasses
    from preft_jax.config import ModelConfig, RopeScaling
    assert set(native_decode.NATIVE_FIELDS) == {f.name for f in dataclasses.fields(ModelConfig)}
    assert native_decode.unsupported_reason(tiny_config(rope_scaling=RopeScaling()), jnp.float32) == ""
    assert native_decode.unsupported_reason(BIASED, jnp.float32) == ""
    assert native_decode.unsupported_reason(tiny_config(head_dim=15), jnp.float32) == (
        "ModelConfig.head_dim = 15 (the native step implements even (rotate-half RoPE))")

    class YarnScaling(RopeScaling):
        pass
    why = native_decode.unsupported_reason(tiny_config(rope_scaling=YarnScaling()), jnp.float32)
    assert why.startswith("ModelConfig.rope_scaling = ")
    Future = dataclasses.make_dataclass("Future", [("sliding_window", int, dataclasses.field(default=4096))],
                                        bases=(ModelConfig,), frozen=True)
    cfg = Future(**dataclasses.asdict(CFG))
    assert native_decode.unsupported_reason(cfg, jnp.float32) == (
        "ModelConfig.sliding_window is a model feature the native step does not implement")


# ---- the engine ----------------------------------------------------------------------------------
def _engine_outputs(cpu_decode, mode):
    from adapter_factory import random_lora, random_reft
    from preft_jax.sampling import SamplingParams
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    model, _ = _model(CFG, seed=0)
    reg = AdapterRegistry(CFG, 4, lora_rank=4, reft_rank=4)
    reg.load("a", random_lora(CFG, 1))
    reg.load("b", random_reft(CFG, 2))
    eng = Engine(ModelRunner(model), reg, EngineConfig(
        max_num_seqs=4, max_model_len=48, max_prefill_seqs=2, max_num_batched_tokens=12, block_size=4, mode=mode,
        kv_cache_tokens=64, cpu_decode=cpu_decode))            # a small pool: preemption by recompute
    rng = np.random.default_rng(11)
    reqs = [eng.submit(rng.integers(0, CFG.vocab_size, int(rng.integers(3, 20))).tolist(), [None, "a", "b"][i % 3],
                       SamplingParams(max_new_tokens=int(rng.integers(5, 25)), stop_token_ids=(-1,)))
            for i in range(7)]
    while not all(r.finished for r in reqs):
        eng.step()
    return eng, [list(r.tokens) for r in reqs]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_engine_outputs_native_equal_xla(mode):
    """Mixed adapters and base requests, preemption forced. PreFT: every decode call one native call;
    prefill chunks and all-token decode on XLA either way."""
    eng_n, native = _engine_outputs("native", mode)
    eng_x, xla = _engine_outputs("xla", mode)
    assert eng_n.step_runner.native is not None and eng_x.step_runner.native is None
    assert eng_n.scheduler.preemptions > 0                  # the small pool did force recompute
    assert native == xla


def test_engine_cpu_decode_choice():
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    with pytest.raises(ValueError, match="cpu_decode must be one of"):
        EngineConfig(cpu_decode="fast")
    runner = ModelRunner(Llama.from_params(CFG, random_params(CFG), dtype=jnp.bfloat16))
    with pytest.raises(ValueError, match="cpu_decode='native' is unavailable: the model dtype is bfloat16"):
        Engine(runner, AdapterRegistry(CFG, 0), EngineConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64,
                                                              cpu_decode="native"))
    eng = Engine(runner, AdapterRegistry(CFG, 0), EngineConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64))
    assert eng.step_runner.native is None                  # auto: bfloat16 stays on the XLA path


@pytest.mark.slow
def test_tile_without_avx512_matches_in_a_build_without_it(tmp_path):
    """decode.cc has two GEMM register tiles: 8 x 48 on 16-lane vectors with AVX-512, passes of
    4 x 24 (and 2 or 1 x 48 for the last rows) on 8-lane vectors without it (the 8 x 48 tile spilled
    on AVX2 and ran ~18x slower there).
    This machine's default build runs one of them; a build with $CXX carrying -mno-avx512f (its own
    cache folder: $CXX is part of the build key) runs the AVX2 tile whatever this CPU has. The packed
    matmul (row and column tails) and the decode step against the XLA path, in that build."""
    import os
    import subprocess
    import sys
    from pallas_kernels.cpu import _build
    found = _build.compilers()
    if not found:
        pytest.skip("no C++ compiler")
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "PREFT_JAX_NO_CACHE")}
    env.update(CXX=" ".join([*found[0], "-mno-avx512f"]), PREFT_JAX_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", __file__,
                        "-k", "packed_matmul_matches_float64 or decode_step_matches_xla_paged_path"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "10 passed" in r.stdout, r.stdout[-1000:]
    built = list((tmp_path / "cpu_native").glob(f"*/{_build.LIBRARY}"))
    assert len(built) == 1, built                   # the flagged build, in its own folder
