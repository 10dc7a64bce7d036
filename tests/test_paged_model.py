"""The paged forward (block tables, chunked prefill, decode) against a teacher-forced full recompute:
random block placement, random chunk sizes, mixed adapters in both modes, and the Pallas
paged-attention kernels lowering for TPU and GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.config import PositionPolicy
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.paged_kv import PagedBatch, PagedKVCache, kernel_decode_attention
from preft_jax.paged_step import paged_logits
from preft_jax.lowering import lower_for
from reference_llama import random_params

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
BS = 4          # block size
NB = 40         # blocks in the pool


def _bank(mode):
    policy = PositionPolicy(mode=mode)
    return build_bank(CFG, [random_lora(CFG, 1, policy=policy), random_reft(CFG, 2, policy=policy)])


class Seq:
    def __init__(self, tokens, plen, slot, rng, free, start=0):
        self.tokens, self.plen, self.slot, self.start = tokens, plen, slot, start   # start: activated rows
        self.done = 0
        self.blocks = []
        self.free = free

    def need(self, upto):
        while len(self.blocks) * BS < upto:
            self.blocks.append(self.free.pop())


def _run(runner, bank, seqs, rng, chunk_sizes):
    """Feeds the sequences through the cache in random-size chunks (up to 3 rows per step, padded to
    4), collecting the logits at each chunk's last token: {seq index: [(position, logits)]}."""
    cache = PagedKVCache.create(CFG, NB, BS)
    out = {i: [] for i in range(len(seqs))}
    while any(s.done < len(s.tokens) for s in seqs):
        live = [i for i, s in enumerate(seqs) if s.done < len(s.tokens)]
        rows = rng.permutation(live)[:3]
        C = int(rng.choice(chunk_sizes))
        R = 4                                           # padded rows
        nbmax = 12                                      # fixed table width: one compile per chunk size
        tokens = np.zeros((R, C), np.int32)
        bt = np.zeros((R, nbmax), np.int32)
        ctx = np.zeros(R, np.int32)
        clen = np.zeros(R, np.int32)
        widx = np.full((R, C), NB * BS, np.int32)
        ids = np.zeros(R, np.int32)
        plens = np.ones(R, np.int32)
        starts = np.zeros(R, np.int32)
        for r, i in enumerate(rows):
            s = seqs[i]
            n = min(C, len(s.tokens) - s.done)
            s.need(s.done + n)
            tokens[r, :n] = s.tokens[s.done:s.done + n]
            bt[r, :len(s.blocks)] = s.blocks
            ctx[r], clen[r] = s.done, n
            for j in range(n):
                p = s.done + j
                widx[r, j] = s.blocks[p // BS] * BS + p % BS
            ids[r], plens[r], starts[r] = s.slot, s.plen, s.start
        batch = PagedBatch(jnp.asarray(bt), jnp.asarray(ctx), jnp.asarray(clen), jnp.asarray(widx))
        logits, cache = paged_logits(runner.graphdef, runner.state, jnp.asarray(tokens), batch, cache, bank,
                                     None if bank is None else jnp.asarray(ids), jnp.asarray(plens),
                                     jnp.asarray(starts))
        for r, i in enumerate(rows):
            s = seqs[i]
            s.done += int(clen[r])
            out[i].append((s.done - 1, np.asarray(logits[r])))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_paged_chunks_match_full_recompute(mode):
    _check_against_full_recompute(mode, chunk_sizes=(1, 1, 3, 8))


def test_blocked_chunk_attention_matches_full_recompute(monkeypatch):
    """Chunks longer than paged_kv.Q_BLOCK attend Q_BLOCK queries at a time (bounded score temporaries):
    the logits stay the full recompute's."""
    from preft_jax import paged_kv
    monkeypatch.setattr(paged_kv, "Q_BLOCK", 2)
    jax.clear_caches()                      # Q_BLOCK is read when the step is traced
    try:
        _check_against_full_recompute("prefill", chunk_sizes=(4, 8, 3))
    finally:
        jax.clear_caches()


def _check_against_full_recompute(mode, chunk_sizes):
    rng = np.random.default_rng(0)
    runner = ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))
    bank = _bank(mode)
    free = list(rng.permutation(np.arange(1, NB)))
    seqs = [Seq(rng.integers(0, CFG.vocab_size, n).tolist(), plen, slot, rng, free)
            for n, plen, slot in ((23, 9, 1), (17, 17, 2), (30, 5, 0), (11, 6, 2))]
    got = _run(runner, bank, seqs, rng, chunk_sizes=chunk_sizes)
    for i, s in enumerate(seqs):
        toks = jnp.asarray([s.tokens])
        want = np.asarray(sequence_logits(runner.graphdef, runner.state, toks, jnp.asarray([s.plen]), bank,
                                          jnp.asarray([s.slot])))[0]
        for pos, lg in got[i]:
            np.testing.assert_allclose(lg, want[pos], rtol=2e-4, atol=2e-4)
    # adapters matter (slot 2 = ReFT on prompt positions) and the check can fail
    s = seqs[1]
    base = np.asarray(sequence_logits(runner.graphdef, runner.state, jnp.asarray([s.tokens]), jnp.asarray([s.plen])))[0]
    assert np.abs(base[got[1][-1][0]] - got[1][-1][1]).max() > 1e-3


@pytest.mark.slow
def test_paged_chunks_with_activated_rows_match_full_recompute():
    """Activated (aLoRA) rows beside PreFT and base rows: each row's activation start travels with it
    through prefill chunks at any offset and decode rows (adapter on generated tokens, PreFT on base)."""
    from preft_jax.adapters.policy import activation_starts
    rng = np.random.default_rng(1)
    runner = ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))
    inv = [7, 8, 9]
    bank = build_bank(CFG, [random_lora(CFG, 1, policy=PositionPolicy.activated(inv)),
                            random_lora(CFG, 2, policy=PositionPolicy()),
                            random_reft(CFG, 3, policy=PositionPolicy.activated([5]))])
    free = list(rng.permutation(np.arange(1, NB)))
    specs = ((25, 14, 1, 6), (19, 9, 2, None), (22, 12, 3, 10), (14, 8, 0, None), (20, 16, 1, 13))
    seqs = []
    for n, plen, slot, at in specs:
        toks = rng.integers(10, CFG.vocab_size, n).tolist()
        if at is not None:
            seq_inv = inv if slot == 1 else [5]
            toks[at:at + len(seq_inv)] = seq_inv
        seqs.append(Seq(toks, plen, slot, rng, free))
    starts = activation_starts(bank, [s.slot for s in seqs], [s.tokens[:s.plen] for s in seqs])
    assert starts.tolist() == [6, 0, 10, 0, 13]
    for s, st in zip(seqs, starts):
        s.start = int(st)
    got = _run(runner, bank, seqs, rng, chunk_sizes=(1, 1, 3, 8))
    for i, s in enumerate(seqs):
        want = np.asarray(sequence_logits(runner.graphdef, runner.state, jnp.asarray([s.tokens]),
                                          jnp.asarray([s.plen]), bank, jnp.asarray([s.slot]),
                                          jnp.asarray([s.start])))[0]
        for pos, lg in got[i]:
            np.testing.assert_allclose(lg, want[pos], rtol=2e-4, atol=2e-4)
    # the start matters: the same row activated from position 0 gives other logits
    s = seqs[0]
    other = np.asarray(sequence_logits(runner.graphdef, runner.state, jnp.asarray([s.tokens]), jnp.asarray([s.plen]),
                                       bank, jnp.asarray([1]), jnp.asarray([0])))[0]
    assert np.abs(other[got[0][-1][0]] - got[0][-1][1]).max() > 1e-3


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_decode_kernels_lower(platform, dtype):
    L, R, H, KV, hd, nblocks, bs, nb = 2, 8, 32, 8, 128, 256, 16, 16   # Llama-3.1-8B layers (the whole pool)
    args = (jax.ShapeDtypeStruct((R, H, hd), dtype), jax.ShapeDtypeStruct((L, KV, nblocks, bs, hd), dtype),
            jax.ShapeDtypeStruct((L, KV, nblocks, bs, hd), dtype), jax.ShapeDtypeStruct((R, nb), jnp.int32),
            jax.ShapeDtypeStruct((R,), jnp.int32))
    variant = "tpu" if platform == "tpu" else "gpu"
    f = jax.jit(lambda q, k, v, bt, n: kernel_decode_attention(q, k, v, 1, bt, n, variant))
    text = lower_for(f, *args, platform=platform).as_text()
    assert ("tpu_custom_call" in text) if platform == "tpu" else ("triton" in text.lower())
