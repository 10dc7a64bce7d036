"""The paged engine end to end: outputs equal each request generated alone (ModelRunner.generate,
itself checked against float64 recomputes elsewhere) under forced preemption, prefix-cache hits,
chunked prefill and adapter tiering; the cross-adapter prefix-sharing rule both ways; PreFT holds a
device adapter slot only while its prompt is prefilled."""
import os
import shutil

import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.config import PositionPolicy
from preft_jax.adapters.peft_io import save_peft_lora
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params
from serve.engine import Engine, EngineConfig
from serve.registry import AdapterRegistry, with_policy

CFG = tiny_config()
NO_STOP = (-1,)
LAST1 = PositionPolicy(last_k=1)
ADAPTERS = {"a": random_lora(CFG, 1), "b": random_reft(CFG, 2), "c": random_lora(CFG, 3, rank=2, targets=("q", "up")),
            "d": random_lora(CFG, 4), "e": random_reft(CFG, 5, kind="direft"),
            "r1": random_reft(CFG, 6, policy=LAST1), "r2": random_lora(CFG, 7, policy=LAST1),
            "f2": random_lora(CFG, 8, policy=PositionPolicy(first_k=2))}
CPU_DECODE = "auto"


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))


@pytest.fixture(scope="module", autouse=True)
def _decode_path(cpu_decode):
    """Every test here runs over both CPU decode paths (conftest `cpu_decode`); `_engine` reads it."""
    global CPU_DECODE
    CPU_DECODE = cpu_decode


def _sp(n):
    return SamplingParams(max_new_tokens=n, stop_token_ids=NO_STOP)


def _alone(runner, prompt, name, n, mode, weights=None):
    if name is None:
        return runner.generate([prompt], _sp(n))[0].tokens
    w = with_policy(weights or ADAPTERS[name], mode)
    return runner.generate([prompt], _sp(n), bank=build_bank(CFG, [w]), adapter_ids=[1])[0].tokens


def _engine(runner, mode="prefill", capacity=8, names=tuple(ADAPTERS), **kw):
    reg = AdapterRegistry(CFG, capacity, lora_rank=4, reft_rank=4)
    for n in names:
        reg.load(n, ADAPTERS[n])
    cfg = dict(max_num_seqs=4, max_model_len=64, max_prefill_seqs=2, max_num_batched_tokens=16, block_size=4,
               mode=mode, cpu_decode=CPU_DECODE)
    cfg.update(kw)
    return Engine(runner, reg, EngineConfig(**cfg))


def _requests(seed, n=6, names=("a", "b", None, "c", "d", "e")):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, CFG.vocab_size, int(rng.integers(3, 22))).tolist(), names[i % len(names)],
             int(rng.integers(4, 14))) for i in range(n)]


def _run(eng, reqs):
    return [r.tokens for r in eng.generate([(p, a, _sp(m)) for p, a, m in reqs])]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_preemption_by_recompute_keeps_outputs(runner, mode):
    reqs = _requests(1)
    eng = _engine(runner, mode, kv_cache_tokens=48)        # 12 blocks for 4 sequences of up to ~35 tokens
    got = _run(eng, reqs)
    assert eng.scheduler.preemptions > 0
    for (p, a, m), toks in zip(reqs, got):
        assert toks == _alone(runner, p, a, m, mode)
    assert eng.pool.num_available == eng.pool.capacity      # nothing leaked


@pytest.mark.slow
def test_chunked_prefill_equals_whole_prompts_and_prefix_hits_equal_misses(runner):
    reqs = _requests(2)
    whole = _run(_engine(runner, max_num_batched_tokens=64, enable_prefix_cache=False), reqs)
    eng = _engine(runner, max_num_batched_tokens=6)         # prompts up to 21 tokens: 4+ chunks each
    assert _run(eng, reqs) == whole
    assert eng.pool.stats.hits == 0
    again = _run(eng, reqs)                                  # same prompts: leading blocks come from the cache
    assert again == whole and eng.pool.stats.hits > 0
    for (p, a, m), toks in zip(reqs, whole):
        assert toks == _alone(runner, p, a, m, "prefill")


@pytest.mark.slow
def test_prefix_sharing_across_adapters_only_when_adapter_free(runner):
    rng = np.random.default_rng(3)
    system = rng.integers(0, CFG.vocab_size, 12).tolist()   # 3 full blocks of 4
    prompt = lambda: system + rng.integers(0, CFG.vocab_size, 5).tolist()

    def hits(eng, name):
        before = eng.pool.stats.hits
        p = prompt()
        toks = _run(eng, [(p, name, 6)])[0]
        assert toks == _alone(runner, p, name, 6, eng.mode)
        return eng.pool.stats.hits - before

    eng = _engine(runner)
    assert hits(eng, None) == 0
    # last_k=1 adapters act on the last prompt token only: the 12 system tokens are base KV, shared
    assert hits(eng, "r1") == 3 and hits(eng, "r2") == 3 and hits(eng, None) == 3
    # adapters acting on position 0 (unrestricted prefill, first_k) never reuse base blocks ...
    assert hits(eng, "a") == 0 and hits(eng, "f2") == 0
    # ... but do reuse their own
    assert hits(eng, "a") == 3
    # in all-token mode every block is the adapter's: nothing is shared with base or across adapters
    all_eng = _engine(runner, "all")
    assert hits(all_eng, None) == 0 and hits(all_eng, "r1") == 0 and hits(all_eng, "r2") == 0


def test_reloaded_adapter_with_new_weights_never_hits_stale_blocks(runner):
    eng = _engine(runner, names=("a",))
    p = np.random.default_rng(4).integers(0, CFG.vocab_size, 17).tolist()
    first = _run(eng, [(p, "a", 6)])[0]
    eng.registry.unload("a")
    new = random_lora(CFG, 99)
    eng.registry.load("a", new)
    before = eng.pool.stats.hits
    second = _run(eng, [(p, "a", 6)])[0]
    assert eng.pool.stats.hits == before                    # old "a" blocks are not the new "a"'s
    assert second == _alone(runner, p, "a", 6, "prefill", new) and second != first


@pytest.mark.slow
def test_device_tiering_equals_everything_resident(runner):
    reqs = _requests(5, n=8)
    resident = _run(_engine(runner, capacity=8), reqs)
    eng = _engine(runner, capacity=2)                        # 5 adapters through 2 device slots
    assert _run(eng, reqs) == resident
    st = eng.registry.stats
    assert st.device_evictions > 0 and st.device_misses > 2
    assert _run(eng, reqs) == resident                       # evicted and reloaded: identical


@pytest.mark.slow
def test_prefill_rows_are_bucketed_so_one_prompt_computes_one_row(runner):
    eng = _engine(runner, max_num_seqs=8, max_prefill_seqs=6, max_num_batched_tokens=128)
    assert eng.step_runner.prefill_row_buckets == [1, 4, 6]
    rows = []
    eng.step_runner.add_call_hook(lambda call, run: rows.append((call.rows, call.chunk)) or run(call))
    reqs = _requests(8, n=6)
    got = _run(eng, reqs[:1]) + _run(eng, reqs[1:3]) + _run(eng, reqs)
    prefill_rows = [r for r, c in rows if c > 1]
    assert prefill_rows[0] == 1 and 4 in prefill_rows and 6 in prefill_rows and set(prefill_rows) <= {1, 4, 6}
    assert got[:3] == got[3:6]                               # the same requests in 1-, 4- and 6-row calls
    for (p, a, m), toks in zip(reqs[:1] + reqs[1:3] + reqs, got):
        assert toks == _alone(runner, p, a, m, "prefill")


@pytest.mark.slow
def test_preft_holds_a_device_slot_only_while_prefilling(runner):
    """One device slot, three adapters: PreFT decodes all three at once; all-token runs one at a time."""
    for mode, most in (("prefill", 3), ("all", 1)):
        eng = _engine(runner, mode, capacity=1, names=("a", "c", "d"))
        rng = np.random.default_rng(6)
        reqs = [(rng.integers(0, CFG.vocab_size, 5).tolist(), n, 12) for n in ("a", "c", "d")]
        handles = [eng.submit(p, a, _sp(m)) for p, a, m in reqs]
        peak = 0
        while eng.busy:
            eng.step()
            peak = max(peak, sum(1 for s in eng.scheduler.running if s.ref is not None))
        assert peak == most, (mode, peak)
        for h, (p, a, m) in zip(handles, reqs):
            assert h.result.tokens == _alone(runner, p, a, m, mode)
        assert eng.registry.occupancy()["device_pinned"] == 0


def test_waiting_is_bounded_when_adapters_compete(runner):
    """A request whose adapter is not on the device is admitted within starvation_s even while
    requests for the resident adapter keep arriving."""
    eng = _engine(runner, capacity=1, names=("a", "c"), max_num_seqs=2, max_prefill_seqs=1, starvation_s=0.05)
    rng = np.random.default_rng(7)
    eng.generate([(rng.integers(0, CFG.vocab_size, 4).tolist(), "a", _sp(2))])          # "a" is resident
    late = eng.submit(rng.integers(0, CFG.vocab_size, 4).tolist(), "c", _sp(3))
    steps = 0
    while not late.finished:
        if steps < 200:
            eng.submit(rng.integers(0, CFG.vocab_size, 4).tolist(), "a", _sp(3))
        eng.step()
        steps += 1
        assert steps < 400
    assert late.result.finish_reason == "length"


@pytest.mark.slow
def test_adapter_dir_tier_found_by_name_changed_and_broken_folders(runner, tmp_path):
    root = tmp_path / "adapters"
    for i, name in enumerate(("x0", "x1", "x2")):
        save_peft_lora(root / name, random_lora(CFG, 20 + i), CFG)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    reg = AdapterRegistry(CFG, 1, lora_rank=4, reft_rank=4, adapter_dir=root, host_cache_bytes=1)
    eng = Engine(runner, reg, EngineConfig(max_num_seqs=2, max_model_len=64, max_prefill_seqs=2,
                                           max_num_batched_tokens=16, block_size=4, cpu_decode=CPU_DECODE))
    p = [5, 6, 7, 8, 9]
    out = {n: _run(eng, [(p, n, 5)])[0] for n in ("x0", "x1", "x2")}
    for i, n in enumerate(("x0", "x1", "x2")):
        assert out[n] == _alone(runner, p, n, 5, "prefill", random_lora(CFG, 20 + i))
    assert reg.stats.host_evictions > 0                      # a 1-byte host cache keeps nothing
    assert _run(eng, [(p, "x0", 5)])[0] == out["x0"]         # reloaded from disk: identical
    # new weights under the same name are picked up, never served stale
    shutil.rmtree(root / "x1")
    save_peft_lora(root / "x1", random_lora(CFG, 77), CFG)
    assert _run(eng, [(p, "x1", 5)])[0] == _alone(runner, p, "x1", 5, "prefill", random_lora(CFG, 77))
    # a malformed folder fails that request with a message naming it; others are unaffected
    bad = eng.submit(p, "broken", _sp(3))
    good = eng.submit(p, "x2", _sp(5))
    while eng.busy:
        eng.step()
    assert bad.error is not None and "broken" in str(bad.error) and bad.error.status == 400
    assert good.result.tokens == out["x2"]
    with pytest.raises(Exception, match="unknown adapter"):
        eng.submit(p, "nope", _sp(3))
    assert reg.occupancy()["device_pinned"] == 0 and not any(reg.catalog.refs.values())


def _fused_calls(eng) -> list:
    """Records, per step call of `eng`, whether it was a fused 4-step decode call."""
    from serve.step_runner import DecodeCall
    fused = []
    eng.step_runner.add_call_hook(
        lambda call, run: (fused.append(isinstance(call, DecodeCall) and call.steps == 4), run(call))[1])
    return fused


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_fused_decode_calls_equal_requests_alone(runner, mode):
    """`decode_steps_per_call=4` (four decode steps fused in each pipelined call, a device loop):
    greedy outputs equal each request generated alone, with a roomy pool and under preemption (12
    blocks), PreFT and all-token adapters."""
    reqs = [(p, a, m + 16) for p, a, m in _requests(5, n=8)]
    for pool in (None, 48):                                  # 48 tokens: 12 blocks, preemption by recompute
        eng = _engine(runner, mode, kv_cache_tokens=pool, decode_steps_per_call=4)
        fused = _fused_calls(eng)
        got = _run(eng, reqs)
        assert sum(fused) >= 3 and (pool is None or eng.scheduler.preemptions > 0)
        for (p, a, m), toks in zip(reqs, got):
            assert toks == _alone(runner, p, a, m, mode)
        assert eng.pool.num_available == eng.pool.capacity


def test_fused_decode_stops_and_sampling_equal_single_steps(runner):
    """Fused 4-step decode calls against single-step calls: stop tokens hit inside a fused call (its
    later tokens dropped), length limits inside one, seeded sampling: the same tokens and finish
    reasons."""
    rng = np.random.default_rng(6)
    reqs = []
    for i, (p, a, m) in enumerate(_requests(7, n=6)):
        stop = tuple(int(t) for t in rng.integers(0, CFG.vocab_size, 12)) if i % 3 else NO_STOP
        reqs.append((p, a, SamplingParams(max_new_tokens=m + 14, stop_token_ids=stop, seed=i,
                                          temperature=0.9 if i % 2 else 0.0)))
    outs = {}
    for k in (1, 4):
        eng = _engine(runner, decode_steps_per_call=k, max_num_seqs=6, max_prefill_seqs=6,
                      max_num_batched_tokens=160)
        fused = _fused_calls(eng)
        outs[k] = [(r.tokens, r.finish_reason) for r in eng.generate(reqs)]
        assert (sum(fused) >= 3) == (k == 4)
    assert outs[4] == outs[1]
    reasons = [reason for _, reason in outs[4]]
    assert "stop" in reasons and "length" in reasons


@pytest.mark.parametrize("fused", [1, 4])
def test_blocks_completed_by_generated_tokens_serve_later_prompts(runner, fused):
    """A block whose last positions are generated tokens is registered in the prefix cache when the
    decode call completes it (single-step and fused calls, the common-case hand-out): a later prompt
    made of that request's prompt and output reuses every full block, not only the prefilled one."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, CFG.vocab_size, 6).tolist()    # block 0 full after prefill, block 1 half
    eng = _engine(runner, decode_steps_per_call=fused)
    out = _run(eng, [(prompt, None, 12)])[0]                 # positions 0..16 computed: blocks 0-3 full
    before = eng.pool.stats.hits
    follow = prompt + out + rng.integers(0, CFG.vocab_size, 3).tolist()
    assert _run(eng, [(follow, None, 2)])[0] == _alone(runner, follow, None, 2, "prefill")
    assert eng.pool.stats.hits - before == 4


def test_prefix_hits_only_where_the_same_positions_were_adapted(runner):
    """A block is reused by an adapted request only where the same positions of it were adapted
    (against each request generated alone, no cache):
    * a multi-turn follow-up with a PreFT adapter: the first turn's generated tokens ran on base
      weights, and are adapted prompt tokens in the second turn (LoRA and ReFT);
    * a last_k window that moves with the prompt length (a prompt extended by one token);
    * an aLoRA whose activation start falls inside a block another prompt adapted whole.
    The base model's own blocks and the blocks before a window stay shared."""
    rng = np.random.default_rng(11)
    inv = (7, 8, 9)
    extra = {"k3": random_lora(CFG, 30, policy=PositionPolicy(last_k=3)),
             "al": random_lora(CFG, 31, policy=PositionPolicy.activated(inv))}
    ADAPTERS.update(extra)
    try:
        eng = _engine(runner, names=("a", "b", "k3", "al"))
        for name in ("a", "b"):
            prompt = rng.integers(10, CFG.vocab_size, 6).tolist()
            out = _run(eng, [(prompt, name, 12)])[0]           # generated positions 6..16 on base weights
            follow = prompt + out + rng.integers(10, CFG.vocab_size, 3).tolist()
            before = eng.pool.stats.hits
            assert _run(eng, [(follow, name, 6)])[0] == _alone(runner, follow, name, 6, "prefill"), name
            assert eng.pool.stats.hits - before == 1            # block 0: the first turn's prompt alone
        p8 = rng.integers(10, CFG.vocab_size, 8).tolist()      # last_k=3: 5..7 adapted; with one more: 6..8
        assert _run(eng, [(p8, "k3", 4)])[0] == _alone(runner, p8, "k3", 4, "prefill")
        before = eng.pool.stats.hits
        p9 = p8 + [int(rng.integers(10, CFG.vocab_size))]
        assert _run(eng, [(p9, "k3", 8)])[0] == _alone(runner, p9, "k3", 8, "prefill")
        assert eng.pool.stats.hits - before == 1                # block 0 is base in both: shared
        first, second = [7, 8, 9, 7, 20, 21], [7, 8, 9, 7, 8, 9, 22]   # activation from 0, then from 3
        assert _run(eng, [(first, "al", 4)])[0] == _alone(runner, first, "al", 4, "prefill")
        assert _run(eng, [(second, "al", 8)])[0] == _alone(runner, second, "al", 8, "prefill")
    finally:
        for name in extra:
            ADAPTERS.pop(name)
