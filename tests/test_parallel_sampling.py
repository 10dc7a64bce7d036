"""Parallel samples (n > 1) and per-request randomness in the paged engine.

The n sequences of one prompt are prefilled once and then share its KV blocks (the partial last
block copied on first write). Each sequence's tokens are checked by replay against an independent
reference: the dense (non-paged) teacher-forced forward of prompt + tokens, sampled with that
sequence's own key (seed, index) at each token index - so a broken share or copy (a sequence
reading another's K/V) shows up as a token the reference would not draw."""
import jax.numpy as jnp
import numpy as np
import pytest

from adapter_factory import random_lora
from preft_jax.adapters.bank import build_bank
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams, row_keys, sample, seed_key_data
from reference_llama import random_params
from serve.engine import Engine, EngineConfig
from serve.errors import RequestError
from serve.registry import AdapterRegistry, with_policy

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
NO_STOP = (-1,)
LORA = random_lora(CFG, 1)
PROMPT = [5, 9, 14, 3, 77, 21, 8, 130, 64, 2]          # 10 tokens: 2 full blocks of 4 + a partial one


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))


def _engine(runner, mode="prefill", **kw):
    reg = AdapterRegistry(CFG, 2, lora_rank=4, reft_rank=4)
    reg.load("a", LORA)
    cfg = dict(max_num_seqs=4, max_model_len=64, max_prefill_seqs=2, max_num_batched_tokens=16, block_size=4,
               mode=mode)
    cfg.update(kw)
    return Engine(runner, reg, EngineConfig(**cfg))


def _sp(n, seed=5, **kw):
    return SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=n, stop_token_ids=NO_STOP, seed=seed, **kw)


def _replays(runner, mode, prompt, tokens, sp, index, adapter="a") -> bool:
    """Whether `tokens` are what the dense reference draws with key (sp.seed, index)."""
    seq = jnp.asarray([list(prompt) + list(tokens)], jnp.int32)
    if adapter is None:
        logits = sequence_logits(runner.graphdef, runner.state, seq, jnp.asarray([len(prompt)]))
    else:
        bank = build_bank(CFG, [with_policy(LORA, mode)])
        logits = sequence_logits(runner.graphdef, runner.state, seq, jnp.asarray([len(prompt)]), bank,
                                 jnp.asarray([1]))
    rows = logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    m = len(tokens)
    kd = np.tile(seed_key_data(sp.seed, index), (m, 1))
    drawn = sample(rows, row_keys(kd, np.arange(m, dtype=np.int32)), jnp.full(m, sp.temperature),
                   jnp.full(m, sp.top_p), jnp.full(m, sp.top_k, jnp.int32))
    return np.asarray(drawn).tolist() == list(tokens)


def _drain(eng):
    for _ in range(1000):
        if not eng.busy:
            return
        eng.step()
    raise AssertionError("engine did not drain")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_one_prefill_shared_blocks_copy_on_write_and_replay(runner, mode):
    eng = _engine(runner, mode)
    sp = _sp(12)
    reqs = eng.submit_n(PROMPT, "a", sp, n=3)
    assert [r.request_id for r in reqs] == [f"{reqs[0].request_id[:-2]}-{i}" for i in range(3)]
    while not reqs[0].tokens:                       # until the prefill ends and the three fork
        eng.step()
    seqs = [eng.sequence(r) for r in reqs]
    assert eng.metrics.prompt_tokens == len(PROMPT)  # prefilled once
    assert all(len(r.tokens) == 1 for r in reqs)     # each drew its first token from that prefill
    blocks = [s.blocks for s in seqs]
    assert blocks[0] == blocks[1] == blocks[2] and len(blocks[0]) == 3
    assert all(eng.pool.refcount(b) == 3 for b in blocks[0])
    eng.step()                                      # first decode: the partial block is copied per writer
    assert [s.blocks[:2] for s in seqs] == [blocks[0][:2]] * 3          # full prompt blocks still shared
    assert len({s.blocks[2] for s in seqs}) == 3                          # the partial one is private
    _drain(eng)
    outs = [r.result.tokens for r in reqs]
    assert all(len(o) == 12 for o in outs) and len({tuple(o) for o in outs}) == 3
    for i, o in enumerate(outs):
        assert _replays(runner, mode, PROMPT, o, sp, i), i
    assert eng.registry.in_use("a") == 0 and eng.pool.num_available == eng.pool.capacity
    # the same seed again: the same n outputs
    again = [r.result.tokens for r in _run_n(_engine(runner, mode), PROMPT, sp, 3)]
    assert again == outs


def _run_n(eng, prompt, sp, n, adapter="a"):
    reqs = eng.submit_n(prompt, adapter, sp, n=n)
    _drain(eng)
    return reqs


@pytest.mark.slow
def test_block_aligned_prompt_and_preemption_give_the_same_tokens(runner):
    prompt = PROMPT[:8]                              # block aligned: no partial block to copy
    sp = _sp(20, seed=11)
    roomy = [r.result.tokens for r in _run_n(_engine(runner), prompt, sp, 3)]
    for i, o in enumerate(roomy):
        assert _replays(runner, "prefill", prompt, o, sp, i)
    tight = _engine(runner, kv_cache_tokens=14 * 4)  # 3 x 7 blocks do not fit: sequences are preempted
    reqs = _run_n(tight, prompt, sp, 3)
    assert tight.scheduler.preemptions >= 1
    assert [r.result.tokens for r in reqs] == roomy


@pytest.mark.slow
def test_seeded_request_ignores_its_batch_mates(runner):
    sp = _sp(10, seed=3)
    alone = _run_n(_engine(runner), PROMPT, sp, 1)[0].result.tokens
    eng = _engine(runner)
    rng = np.random.default_rng(0)
    others = [eng.submit(rng.integers(0, 256, int(rng.integers(3, 20))).tolist(), None,
                         SamplingParams(temperature=0.8, max_new_tokens=15, stop_token_ids=NO_STOP))
              for _ in range(3)]
    eng.step()
    mine = eng.submit(PROMPT, "a", sp)
    _drain(eng)
    assert mine.result.tokens == alone and all(o.result is not None for o in others)
    unseeded = [_run_n(_engine(runner, seed=s), PROMPT, _sp(10, seed=None), 1)[0].result.tokens for s in (1, 2)]
    assert unseeded[0] != unseeded[1]                # no seed: the engine's generator decides


def test_greedy_n_are_identical_and_early_ends_release_everything(runner):
    eng = _engine(runner)
    sp = SamplingParams(max_new_tokens=6, stop_token_ids=NO_STOP)
    reqs = eng.submit_n(PROMPT, "a", sp, n=4)
    _drain(eng)
    assert len({tuple(r.result.tokens) for r in reqs}) == 1
    assert reqs[0].result.tokens == _run_n(_engine(runner), PROMPT, sp, 1)[0].result.tokens
    one = eng.submit_n(PROMPT, None, SamplingParams(max_new_tokens=1, stop_token_ids=NO_STOP), n=3)
    _drain(eng)                                     # every sequence ends on its first token
    assert all(len(r.result.tokens) == 1 for r in one)
    assert eng.pool.num_available == eng.pool.capacity and eng.registry.in_use("a") == 0


def test_cancelling_the_first_before_its_prefill_ends_all_and_bad_n_is_refused(runner):
    eng = _engine(runner)
    reqs = eng.submit_n(PROMPT, "a", _sp(5), n=3)
    eng.cancel(reqs[0])
    _drain(eng)
    assert all(r.result is not None and r.result.finish_reason == "cancelled" for r in reqs)
    assert eng.registry.in_use("a") == 0 and eng.pool.num_available == eng.pool.capacity
    for bad in (0, 5, True, 2.0):
        with pytest.raises(RequestError, match="n must be"):
            eng.submit_n(PROMPT, None, _sp(5), n=bad)
    assert not eng.busy and eng.registry.in_use("a") == 0


@pytest.mark.slow
def test_logprobs_are_the_model_log_softmax(runner):
    """Engine logprob entries (sampled token + top k, and prompt tokens) == log_softmax of the dense
    reference's raw logits (not of the temperature-scaled distribution)."""
    eng = _engine(runner)
    sp = SamplingParams(temperature=1.7, max_new_tokens=6, stop_token_ids=NO_STOP, seed=2, logprobs=3,
                        prompt_logprobs=2)
    reqs = eng.submit_n(PROMPT, "a", sp, n=2)
    outs = [r.output() for r in reqs]
    _drain(eng)
    for r, out in zip(reqs, outs):
        while not r.events.empty():
            out.handle(r.events.get_nowait())
    bank = build_bank(CFG, [with_policy(LORA, "prefill")])
    for r, out in zip(reqs, outs):
        res = r.result
        seq = jnp.asarray([PROMPT + res.tokens], jnp.int32)
        logits = sequence_logits(runner.graphdef, runner.state, seq, jnp.asarray([len(PROMPT)]), bank,
                                 jnp.asarray([1]))
        x = np.asarray(logits[0], np.float64)                 # float64 log_softmax of the raw logits
        ref = x - x.max(-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
        assert len(res.logprobs) == len(res.tokens)
        for i, (tok, (lp, top)) in enumerate(zip(res.tokens, res.logprobs)):
            row = ref[len(PROMPT) - 1 + i]
            assert abs(lp - row[tok]) < 2e-4
            assert [t for t, _ in top] == np.argsort(-row)[:3].tolist()
            np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:3], atol=2e-4)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
        for pos in range(1, len(PROMPT)):
            lp, top = out.prompt_logprobs[pos]
            assert abs(lp - ref[pos - 1][PROMPT[pos]]) < 2e-4 and len(top) == 2
