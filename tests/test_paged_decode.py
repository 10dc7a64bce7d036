"""Decode as the GPU/TPU would run it, checked on CPU:

* `paged_decode_steps` (N decode steps in one call, no host sync) gives exactly the tokens and KV
  pool of N `paged_step` calls, greedy and sampled with per-row keys, a padding row included;
* the paged-attention kernel path (the whole pool read in place, split-K; the GPU kernel runs in
  Pallas interpret mode here) matches the gather path;
* the Llama-3.1-8B-shaped bf16 decode step at B=64 (one step and N steps) lowers for cuda and tpu
  with its kernel, and the KV pool is donated (every pool input aliases an output)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from preft_jax.config import MODEL_PRESETS, ModelConfig, tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.paged_kv import KernelLayout, PagedBatch, PagedKVCache, choose_attention, kernel_layout
from preft_jax.paged_step import decode_advance, paged_decode_steps, paged_step
from preft_jax.lowering import lower_for
from reference_llama import random_params

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
BS = 16


def _runner(cfg=CFG):
    return ModelRunner(Llama.from_params(cfg, random_params(cfg, seed=3)))


def _decode_setup(cfg, R, ctx, steps, seed=0, pad_rows=1, attention="gather", lens=None):
    """R rows (the last `pad_rows` of them padding) with `ctx` random cached tokens each (`lens`: each
    live row's own), block tables covering ctx + steps positions; the pool filled with random K/V.
    Returns (tokens, batch, cache)."""
    rng = np.random.default_rng(seed)
    nb = -(-(ctx + steps) // BS)
    NB = R * nb + 1
    perm = rng.permutation(np.arange(1, NB))
    bt = np.zeros((R, nb), np.int32)
    live = R - pad_rows
    bt[:live] = perm[:live * nb].reshape(live, nb)
    ctx_lens = np.where(np.arange(R) < live, ctx - np.arange(R), 0).astype(np.int32)   # ragged contexts
    if lens is not None:
        ctx_lens[:live] = lens
    clen = (np.arange(R) < live).astype(np.int32)
    widx = np.full((R, 1), NB * BS, np.int32)
    for r in range(live):
        p = ctx_lens[r]
        widx[r, 0] = bt[r, p // BS] * BS + p % BS
    shape = (cfg.n_layers, cfg.n_kv_heads, NB, BS, cfg.head_dim)
    cache = PagedKVCache(jnp.asarray(rng.normal(size=shape), jnp.float32), jnp.asarray(rng.normal(size=shape),
                                                                                       jnp.float32))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (R, 1)), jnp.int32)
    batch = PagedBatch(jnp.asarray(bt), jnp.asarray(ctx_lens), jnp.asarray(clen), jnp.asarray(widx), attention)
    return tokens, batch, cache


def _sampling(R, temperature):
    rng = np.random.default_rng(7)
    key_data = jnp.asarray(rng.integers(0, 2 ** 32, (R, 2), dtype=np.uint64).astype(np.uint32))
    return (jnp.full((R,), temperature, jnp.float32), jnp.full((R,), 0.9, jnp.float32), jnp.zeros((R,), jnp.int32),
            key_data, jnp.asarray(rng.integers(0, 50, R), jnp.int32))


def _single_steps(runner, tokens, batch, cache, samp, n):
    temp, top_p, top_k, key_data, counters = samp
    out = []
    for i in range(n):
        b = decode_advance(batch, cache.block_size, cache.num_blocks, i)
        tokens, cache = paged_step(runner.graphdef, runner.state, tokens, b, cache, None, None,
                                   jnp.ones_like(counters), temp, top_p, top_k, (key_data, counters + i))
        out.append(np.asarray(tokens))
        tokens = tokens[:, None]
    return np.stack(out, 1), cache


def _copy(cache):
    return jax.tree.map(lambda x: x.copy(), cache)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_steps_equal_single_steps(temperature):
    runner = _runner()
    R, N = 4, 5
    tokens, batch, cache = _decode_setup(CFG, R, ctx=21, steps=N)
    samp = _sampling(R, temperature)
    want, want_cache = _single_steps(runner, tokens, batch, _copy(cache), samp, N)
    temp, top_p, top_k, key_data, counters = samp
    got, got_cache = paged_decode_steps(runner.graphdef, runner.state, tokens, batch, cache, None, None,
                                        jnp.ones_like(counters), temp, top_p, top_k, (key_data, counters),
                                        num_steps=N)
    assert got.shape == (R, N) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_allclose(np.asarray(got_cache.k), np.asarray(want_cache.k), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_cache.v), np.asarray(want_cache.v), rtol=1e-6, atol=1e-6)
    # the steps really advance: every live row wrote N new positions (the pool changed there only)
    assert len(set(map(tuple, want[:R - 1]))) > 1


def test_decode_advance_write_index():
    bt = jnp.asarray([[5, 7, 0], [2, 0, 0]], jnp.int32)
    b = PagedBatch(bt, jnp.asarray([15, 3], jnp.int32), jnp.asarray([1, 0], jnp.int32),
                   jnp.zeros((2, 1), jnp.int32))
    a = decode_advance(b, 16, 10, 1)          # row 0: position 16 -> block 7 offset 0; row 1: padding
    np.testing.assert_array_equal(np.asarray(a.write_index), [[7 * 16], [160]])
    np.testing.assert_array_equal(np.asarray(a.context_lens), [16, 4])
    far = decode_advance(b, 16, 10, 40)      # past the table: dropped
    assert int(far.write_index[0, 0]) == 160


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("ctx, lens, width, layout", [
    (250, None, 16, KernelLayout(16, 16, 8, 2)),     # two compute blocks of 8 pages, split-K (k = 2)
    (130, [130, 100], 9, KernelLayout(9, 16, 8, 2)),  # an odd table padded to 16 pages, split as well;
                                                      # the second row ends in the first partition
    (40, None, 3, KernelLayout(3, 4, 4, 1)),         # narrower than a block: one block of 4 pages
])
def test_kernel_attention_matches_gather(platform, ctx, lens, width, layout):
    """The kernel path (the GPU kernel interpreted on CPU: both platforms' default branch, in the
    platform's `kernel_layout`: split-K on "gpu", none on "tpu") against the gather path, logits and
    pool; rows of ragged contexts, one of them ending before a partition that then loads nothing."""
    cfg = tiny_config(n_layers=2)
    runner = _runner(cfg)
    tokens, batch, cache = _decode_setup(cfg, R=3, ctx=ctx, steps=1, seed=1, lens=lens)
    assert batch.block_tables.shape[1] == width
    assert kernel_layout(width, 3 * cfg.n_kv_heads, "gpu") == layout
    assert kernel_layout(width, 3 * cfg.n_kv_heads, "tpu").k_splits == 1
    kern = PagedBatch(batch.block_tables, batch.context_lens, batch.chunk_lens, batch.write_index,
                      f"kernel:{platform}")
    model = nnx.merge(runner.graphdef, runner.state)
    f = jax.jit(lambda t, b, c: model.forward_paged(t, b, c))
    h_ref, c_ref = f(tokens, batch, _copy(cache))
    h, c = f(tokens, kern, _copy(cache))
    live = np.asarray(batch.chunk_lens) > 0
    np.testing.assert_allclose(np.asarray(h)[live], np.asarray(h_ref)[live], rtol=2e-4, atol=2e-4)
    for got, want in ((c.k, c_ref.k), (c.v, c_ref.v)):     # layer 0's new K/V exact, later layers' close
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
    assert not np.array_equal(np.asarray(c.k), np.asarray(cache.k))          # the new K/V were written
    # the comparison sees the cached context: without it the hidden states differ
    no_ctx = PagedBatch(kern.block_tables, kern.context_lens * 0, kern.chunk_lens, kern.write_index, kern.attention)
    h0, _ = f(tokens, no_ctx, _copy(cache))
    assert np.abs(np.asarray(h0)[live] - np.asarray(h)[live]).max() > 1e-2


def test_kernel_layout_choice():
    """8B shape (8 KV heads): B=64 fills an H200's SMs (no split); B=1 at 2048 tokens (128 pages of
    16, blocks of 8): 16 splits, one block each; B=16: 4. The benchmark's tables of 2048 + 1 tokens are 129 pages
    wide and 128 + 1 tokens 9: padded, not read in 1-page blocks with no split."""
    assert kernel_layout(128, 64 * 8, "gpu") == KernelLayout(128, 128, 8, 1)
    assert kernel_layout(128, 1 * 8, "gpu") == KernelLayout(128, 128, 8, 16)
    assert kernel_layout(128, 16 * 8, "gpu") == KernelLayout(128, 128, 8, 4)
    assert kernel_layout(8, 8, "gpu") == KernelLayout(8, 8, 8, 1)       # one compute block: nothing to split
    assert kernel_layout(129, 64 * 8, "gpu") == KernelLayout(129, 136, 8, 1)
    assert kernel_layout(129, 1 * 8, "gpu") == KernelLayout(129, 256, 8, 32)   # 17 blocks: one per partition
    assert kernel_layout(129, 16 * 8, "gpu") == KernelLayout(129, 160, 8, 4)
    assert kernel_layout(9, 1 * 8, "gpu") == KernelLayout(9, 16, 8, 2)
    assert kernel_layout(129, 1 * 8, "tpu") == KernelLayout(129, 136, 8, 1)    # TPU: blocks, no split
    assert kernel_layout(5, 8, "tpu") == KernelLayout(5, 8, 8, 1)
    assert kernel_layout(1, 8, "gpu") == KernelLayout(1, 1, 1, 1)
    assert kernel_layout(129, 8, "gpu", k_splits=2) == KernelLayout(129, 144, 8, 2)   # given: kept, padded
    assert kernel_layout(512, 8, "gpu") == KernelLayout(512, 512, 8, 64)      # B=1 at 8192 tokens
    with pytest.raises(ValueError, match=r"^a block table of 0 pages: the kernel needs at least one$"):
        kernel_layout(0, 8, "gpu")
    with pytest.raises(ValueError, match=r"^k_splits must be >= 1, got 0$"):
        kernel_layout(9, 8, "gpu", k_splits=0)


LLAMA_8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                       ffn_dim=14336, rope_theta=5e5, rms_eps=1e-5, tie_embeddings=False, max_seq_len=4096)
MARKERS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _abstract_decode(cfg, R, ctx, platform, steps=None):
    """Lowered (not compiled) bf16 decode of R rows at context ctx for `platform`, from shapes only."""
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, adapter_backend="xla"))
    graphdef, state = nnx.split(model)
    nb = -(-(ctx + (steps or 1)) // BS)
    NB = R * nb + 1
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    pool = sds((cfg.n_layers, cfg.n_kv_heads, NB, BS, cfg.head_dim), jnp.bfloat16)
    batch = PagedBatch(sds((R, nb), i32), sds((R,), i32), sds((R,), i32), sds((R, 1), i32),
                       choose_attention(cfg, BS, "gpu" if platform == "cuda" else platform))
    f32 = sds((R,), jnp.float32)
    args = (graphdef, state, sds((R, 1), i32), batch, PagedKVCache(pool, pool), None, None, sds((R,), i32),
            f32, f32, sds((R,), i32), (sds((R, 2), jnp.uint32), sds((R,), i32)))
    fn = paged_step if steps is None else paged_decode_steps
    kw = {} if steps is None else {"num_steps": steps}
    return batch.attention, lower_for(fn, *args, platform=platform, **kw).as_text()


def _main_signature(text):
    return re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("steps", [None, 4])
def test_llama8b_decode_lowers_with_kernel_and_donated_pool(platform, steps):
    attention, text = _abstract_decode(LLAMA_8B, 64, 2048, platform, steps)
    assert attention == ("kernel:gpu" if platform == "cuda" else "kernel:tpu")
    assert MARKERS[platform] in text
    assert text.count(MARKERS[platform]) >= 1
    sig = _main_signature(text)
    pool_args = [a for a in sig.split("%arg")[1:] if "32x8x" in a and "bf16" in a]
    assert len(pool_args) == 2, sig[:2000]                        # k and v pools
    assert all("tf.aliasing_output" in a for a in pool_args)      # donated: updated in place


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("R", [1, 64])
def test_cuda_decode_lowers_in_its_kernel_layout(model, R):
    """The device run's decode shapes (context 2048 + 1 token: a 129-page table) lowered for cuda:
    jax's Triton kernel with compute blocks of 8 pages over the table padded to its
    `kernel_layout` (8B at B=1: 32 split-K partitions, 256 pages per kernel row; B=64: 136), the pools
    donated. The Qwen2.5-0.5B shape (head_dim 64, 7 query heads per KV head) takes the kernel too."""
    cfg = MODEL_PRESETS[model]
    attention, text = _abstract_decode(cfg, R, 2048, "cuda")
    assert attention == "kernel:gpu"
    lay = kernel_layout(129, R * cfg.n_kv_heads, "gpu")
    assert lay.pages_per_block == 8 and (lay.k_splits > 1) == (R * cfg.n_kv_heads < 264)
    assert "paged_attention_block_h_16_pages_per_compute_block_8" in text
    assert f"tensor<{R * cfg.n_kv_heads}x{lay.width}xi32>" in text            # the kernel rows' padded tables
    sig = _main_signature(text)
    pool_args = [a for a in sig.split("%arg")[1:] if f"{cfg.n_layers}x{cfg.n_kv_heads}x" in a and "bf16" in a]
    assert len(pool_args) == 2 and all("tf.aliasing_output" in a for a in pool_args), sig[:2000]


def test_decode_attention_env_override(monkeypatch):
    from preft_jax.paged_kv import ATTENTION_ENV
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    assert choose_attention(LLAMA_8B, 16, "gpu") == "kernel:gpu"
    assert choose_attention(LLAMA_8B, 16, "tpu") == "kernel:tpu"
    monkeypatch.setenv(ATTENTION_ENV, "gather")
    assert choose_attention(LLAMA_8B, 16, "gpu") == "gather"
    monkeypatch.setenv(ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="PREFT_JAX_DECODE_ATTENTION must be 'auto' or 'gather', got 'flash'"):
        choose_attention(LLAMA_8B, 16, "gpu")


@pytest.mark.parametrize("kind,platform", [("gpu", "gpu"), ("gpu", "cuda"), ("tpu", "tpu")])
def test_decode_attention_falls_back_when_jax_has_no_kernel(monkeypatch, caplog, kind, platform):
    """A jax without the paged-attention kernel module (the GPU one is one of jax's Pallas Triton
    ops, deprecated from jax 0.11 and to be removed with it) gets the gather path and one log line
    naming the module, not a decode step that fails at trace time; the other platform's choice is
    unchanged."""
    import logging
    import sys
    from preft_jax import paged_kv
    monkeypatch.delenv(paged_kv.ATTENTION_ENV, raising=False)
    monkeypatch.setitem(sys.modules, paged_kv.KERNEL_MODULES[kind], None)      # import raises ImportError
    caches = (paged_kv.kernel_missing, paged_kv.kernel_fails_to_lower)
    for c in caches:
        c.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="preft_jax.paged_kv"):
            assert choose_attention(LLAMA_8B, 16, platform) == "gather"
        assert f"paged attention: no {platform} kernel (jax {jax.__version__} has no " \
               f"{paged_kv.KERNEL_MODULES[kind]} (ModuleNotFoundError: " in caplog.text
        assert caplog.text.rstrip().endswith("; using the gather path")
        other = "tpu" if kind == "gpu" else "gpu"      # the TPU path lowers without jax's GPU kernel too
        assert choose_attention(LLAMA_8B, 16, other) == f"kernel:{other}"
    finally:
        monkeypatch.undo()
        for c in caches:
            c.cache_clear()
    assert choose_attention(LLAMA_8B, 16, platform) == f"kernel:{kind}"


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_decode_attention_falls_back_when_the_kernel_does_not_lower(monkeypatch, caplog, platform):
    """A kernel that does not lower for the platform (a jax or device it does not build for) is
    found by one probe at a small shape: the gather path and one log line with the lowering's
    error, not a decode step that fails at its first call. With the kernel lowering, the probe
    passes (the real kernel lowered here for the platform, cuda through an abstract H100)."""
    import logging
    from preft_jax import paged_kv
    monkeypatch.delenv(paged_kv.ATTENTION_ENV, raising=False)
    paged_kv.kernel_fails_to_lower.cache_clear()
    assert paged_kv.kernel_fails_to_lower(platform) == ""
    real = paged_kv.kernel_decode_attention

    def broken(q, k, v, layer, tables, lengths, kind, k_splits=None):
        if kind == ("tpu" if platform == "tpu" else "gpu"):
            raise NotImplementedError("Unimplemented primitive in Pallas GPU lowering: frobnicate")
        return real(q, k, v, layer, tables, lengths, kind, k_splits)

    monkeypatch.setattr(paged_kv, "kernel_decode_attention", broken)
    paged_kv.kernel_fails_to_lower.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="preft_jax.paged_kv"):
            assert choose_attention(LLAMA_8B, 16, platform) == "gather"
        kind = "tpu" if platform == "tpu" else "gpu"
        assert f"paged attention: no {platform} kernel (jax {jax.__version__}'s {kind} paged-attention kernel " \
               f"does not lower for {platform} (NotImplementedError: Unimplemented primitive in Pallas GPU " \
               f"lowering: frobnicate)); using the gather path" in caplog.text
        other = "tpu" if platform == "gpu" else "gpu"
        assert choose_attention(LLAMA_8B, 16, other) == f"kernel:{other}"
    finally:
        paged_kv.kernel_fails_to_lower.cache_clear()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_engine_fused_decode_call_lowers_with_kernel_and_donated_pool(platform):
    """The serving engine's own decode call (serve/step_runner.py: the rows' int32 buffer, 4 decode
    steps fused in one call, `EngineConfig.decode_steps_per_call`) lowers for the accelerator from
    shapes only, 8B shape at 64 rows x 2048 context: the paged-attention kernel inside the loop and
    the pool donated (updated in place)."""
    from serve.step_runner import BLOCKS, decode_step
    cfg, R, ctx, steps = LLAMA_8B, 64, 2048, 4
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, adapter_backend="xla"))
    graphdef, state = nnx.split(model)
    nb = -(-(ctx + steps) // BS)
    pool = jax.ShapeDtypeStruct((cfg.n_layers, cfg.n_kv_heads, R * nb + 1, BS, cfg.head_dim), jnp.bfloat16)
    attention = choose_attention(cfg, BS, "gpu" if platform == "cuda" else platform)
    tree, leaves = jax.tree_util.tree_structure(state), tuple(jax.tree_util.tree_leaves(state))   # as the engine calls it
    text = lower_for(
        decode_step(graphdef, state_tree=tree),
        leaves, jax.ShapeDtypeStruct((R, BLOCKS + nb), jnp.int32), jax.ShapeDtypeStruct((R,), jnp.int32),
        PagedKVCache(pool, pool), None, None, attention=attention, logprobs=False, steps=steps, platform=platform,
    ).as_text()
    assert attention == ("kernel:gpu" if platform == "cuda" else "kernel:tpu")
    assert MARKERS[platform] in text
    pool_args = [a for a in _main_signature(text).split("%arg")[1:] if "32x8x" in a and "bf16" in a]
    assert len(pool_args) == 2 and all("tf.aliasing_output" in a for a in pool_args)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_engine_prefill_call_and_handoff_lower_with_donated_pool(platform):
    """The serving engine's prefill call (`bind_paged_step`: the model graph bound in) lowers for the
    accelerator from shapes only, 8B shape, 16 rows x 512-token chunks after 1024 tokens of context,
    the pool donated; and so does the hand-off of its tokens to the next decode call
    (`handoff_tokens`, async scheduling: [P] prefill tokens -> [R] decode rows, on the device)."""
    from preft_jax.paged_step import bind_paged_step
    from serve.step_runner import handoff_tokens
    cfg, P, C, ctx, R = LLAMA_8B, 16, 512, 1024, 64
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, adapter_backend="xla"))
    graphdef, state = nnx.split(model)
    sds, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
    nb = -(-(ctx + C) // BS)
    pool = sds((cfg.n_layers, cfg.n_kv_heads, P * nb + 1, BS, cfg.head_dim), jnp.bfloat16)
    batch = PagedBatch(sds((P, ctx // BS), i32), sds((P,), i32), sds((P,), i32), sds((P, C), i32), "gather")
    tree, leaves = jax.tree_util.tree_structure(state), tuple(jax.tree_util.tree_leaves(state))   # as the engine calls it
    text = lower_for(
        bind_paged_step(graphdef, state_tree=tree),
        leaves, sds((P, C), i32), batch, PagedKVCache(pool, pool), None, None, sds((P,), i32), sds((P,), f32),
        sds((P,), f32), sds((P,), i32), (sds((P, 2), jnp.uint32), sds((P,), i32)), None, None, None,
        logprobs=False, prompt_logprobs=False, return_logits=True, platform=platform,
    ).as_text()
    pool_args = [a for a in _main_signature(text).split("%arg")[1:] if "32x8x" in a and "bf16" in a]
    assert len(pool_args) == 2 and all("tf.aliasing_output" in a for a in pool_args)
    hand = lower_for(handoff_tokens, sds((P,), i32), sds((R,), i32), platform=platform).as_text()
    assert re.search(r"@main\(%arg0: tensor<16xi32>, %arg1: tensor<64xi32>\) -> \(tensor<64xi32>", hand)


@pytest.mark.parametrize("attention", ["gather", "kernel:gpu"])
@pytest.mark.parametrize("steps", [1, 4])
def test_compiled_cpu_decode_updates_the_pool_in_place(steps, attention):
    """The engine's decode call (the rows' buffer; 1 step or 4 fused) compiled for this CPU, on the
    gather path and on the kernel path (the pool carried through the layer scan and written layer by
    layer; the GPU kernel interpreted): both pools alias outputs (XLA's buffer assignment, not only
    the donation asked for in the lowering) and no temporary buffer could hold a copy of either pool
    (temp bytes < one pool's). (A 1-layer model does copy both pools on the gather path: XLA drops
    the one-trip layer loop and then copies the pool it gathers from before scattering into it.)"""
    from serve.step_runner import BLOCKS, decode_step
    cfg = tiny_config(n_layers=2)
    model = Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, adapter_backend="xla")
    graphdef, state = nnx.split(model)
    R, nb, NB = 4, 4, 1024                                    # a pool far larger than anything else
    pool = jax.ShapeDtypeStruct((cfg.n_layers, cfg.n_kv_heads, NB, BS, cfg.head_dim), jnp.float32)
    tree, leaves = jax.tree_util.tree_structure(state), tuple(jax.tree_util.tree_leaves(state))
    compiled = decode_step(graphdef, state_tree=tree).trace(
        leaves, jax.ShapeDtypeStruct((R, BLOCKS + nb), jnp.int32), jax.ShapeDtypeStruct((R,), jnp.int32),
        PagedKVCache(pool, pool), None, None, attention=attention, logprobs=False, steps=steps).lower().compile()
    mem = compiled.memory_analysis()
    pool_bytes = int(np.prod(pool.shape)) * 4
    assert mem.alias_size_in_bytes >= 2 * pool_bytes
    assert mem.temp_size_in_bytes < pool_bytes, (mem.temp_size_in_bytes, pool_bytes)
    alias = re.search(r"input_output_alias=\{(.*?)\}, entry", compiled.as_text()).group(1)
    assert alias.count("may-alias") == 2
