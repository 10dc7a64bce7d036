"""benchmarks/bare_loop.py measures the engine against a replay of the engine's own device calls:
the replay must be exactly those calls (same arguments, same outputs), whatever the engine's step
signature becomes, or the ratio it reports means nothing."""
import jax
import numpy as np
import pytest

from adapter_factory import random_lora
from benchmarks.bare_loop import Recorder, bare_loop
from benchmarks.common import serve
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from reference_llama import random_params
from serve.engine import Engine, EngineConfig
from serve.registry import AdapterRegistry

CFG = tiny_config()


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))


@pytest.mark.parametrize("steps", [4, 1])
def test_replay_reproduces_every_engine_call(runner, steps):
    reg = AdapterRegistry(CFG, 4, lora_rank=4, reft_rank=4)
    for i in range(3):
        reg.load(f"l{i}", random_lora(CFG, 10 + i))
    eng = Engine(runner, reg, EngineConfig(max_num_seqs=4, max_model_len=64, max_prefill_seqs=4,
                                           max_num_batched_tokens=64, block_size=4, mode="prefill",
                                           enable_prefix_cache=False, num_scheduler_steps=steps))
    rng = np.random.default_rng(steps)
    prompts = [rng.integers(1, CFG.vocab_size, int(rng.integers(3, 12))).tolist() for _ in range(6)]
    adapters = ["l0", None, "l1", "l2", "l0", None]
    serve(eng, prompts[:3], ["l0", "l1", "l2"], 2)     # adapters resident first, as in the benchmark (a slot
    rec = Recorder(eng, keep_outputs=True)              # write donates the bank an earlier call recorded)
    served = serve(eng, prompts, adapters, 7)
    assert served.tokens == 6 * 7
    expected = jax.device_get(rec.outputs)
    staged = rec.staged()
    assert len(staged) == len(expected) >= 7            # one call per step at least (prefill + decode)
    for host in (None, ("asleep", 1e-4), ("busy", 1e-4)):  # --host-probe: the same calls, a host beside them
        replayed = []
        bare_loop(eng, staged, replayed, host=host)
        got = jax.device_get(replayed)
        assert len(got) == len(expected)
        for i, (e, g) in enumerate(zip(expected, got)):
            e, g = (x if isinstance(x, dict) else {"tokens": x} for x in (e, g))
            assert e.keys() == g.keys()
            for k in e:
                np.testing.assert_array_equal(np.asarray(g[k]), np.asarray(e[k]), err_msg=f"{host} call {i}: {k}")


@pytest.mark.parametrize("adapters", [[None] * 4, ["l0", None, "l1", "l0"]])
def test_host_only_hands_out_the_recorded_tokens_and_refuses_another_workload(runner, adapters):
    """`host_only` serves the same requests again with every device call answered by its recorded
    output: the requests must get exactly the tokens of the real run (the engine's host work is the
    same), and a workload that makes other calls must raise, not report another workload's cost."""
    from benchmarks.bare_loop import host_only
    reg = AdapterRegistry(CFG, 4, lora_rank=4, reft_rank=4)
    for i in range(2):
        reg.load(f"l{i}", random_lora(CFG, 20 + i))
    eng = Engine(runner, reg, EngineConfig(
        max_num_seqs=4, max_model_len=64, max_prefill_seqs=4, max_num_batched_tokens=64, block_size=4,
        mode="prefill", enable_prefix_cache=False, num_scheduler_steps=4))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, CFG.vocab_size, int(rng.integers(3, 12))).tolist() for _ in range(4)]
    serve(eng, prompts, adapters, 2)                    # adapters resident first, as in the benchmark
    rec = Recorder(eng, keep_outputs=True)
    real = serve(eng, prompts, adapters, 9)
    calls, outputs, stamps = list(rec.calls), list(rec.outputs), list(rec.stamps)
    assert len(calls) >= 9
    # the burst-edge columns: submit, then the first call, ..., the last call, then the burst's end (one clock)
    assert len(stamps) == len(calls) and stamps == sorted(stamps)
    assert real.started < real.started + real.submit_s <= stamps[0] and stamps[-1] < real.started + real.wall
    got, answered = [], []
    cpu = host_only(eng, calls, outputs, lambda: got.append(serve(eng, prompts, adapters, 9)), answered)
    assert cpu > 0 and got[0].outputs == real.outputs
    assert len(answered) == len(calls) and got[0].started + got[0].submit_s <= answered[0]
    assert answered[-1] < got[0].started + got[0].wall
    fresh = [rng.integers(1, CFG.vocab_size, 20).tolist() for _ in range(4)]   # longer prompts: other calls
    with pytest.raises(RuntimeError, match="another call than the recorded one|fewer calls"):
        host_only(eng, calls, outputs, lambda: serve(eng, fresh, adapters, 3))


def test_paired_bursts_replay_each_burst_right_after_it(runner, monkeypatch):
    """`--pairs`: every variant serves a burst and the bare loop replays exactly that burst's calls
    before anything else runs; one entry per pair, the variants' order reversed every other pair,
    and the recorder keeps no outputs (200 pairs would hold every call's output)."""
    import benchmarks.bare_loop as bl
    engines, seen = {}, {}
    for steps in (4, 1):
        eng = Engine(runner, AdapterRegistry(CFG, 0), EngineConfig(
            max_num_seqs=4, max_model_len=64, max_prefill_seqs=4, max_num_batched_tokens=64, block_size=4,
            enable_prefix_cache=False, num_scheduler_steps=steps))
        serve(eng, [[1, 2, 3]], [None], 2)
        rec = Recorder(eng, keep_outputs=True)
        rec.outputs.append("stale")
        serve(eng, [[4, 5]], [None], 2)                  # recorded before the pairs: dropped, not replayed
        engines[f"steps={steps}"] = (eng, rec, [None] * 3)
        seen[eng] = Recorder(eng)                         # a second recorder: the calls each burst made
    order, real = [], bl.bare_loop

    def checked(eng, staged):
        made = seen[eng].staged()
        assert [type(c).__name__ for c in staged] == [type(c).__name__ for c in made] and len(made) >= 5
        order.append(next(k for k, v in engines.items() if v[0] is eng))
        return real(eng, staged)

    monkeypatch.setattr(bl, "bare_loop", checked)
    rng = np.random.default_rng(3)
    prompts = [[rng.integers(1, CFG.vocab_size, 6).tolist() for _ in range(3)] for _ in range(3)]
    hooks = {name: (lambda name=name: order.append(f"before {name}")) for name in engines}
    out = bl.paired_bursts(engines, 3, lambda i: prompts[i], 5, hooks)
    assert order == ["before steps=4", "steps=4", "before steps=1", "steps=1", "before steps=1", "steps=1",
                     "before steps=4", "steps=4", "before steps=4", "steps=4", "before steps=1", "steps=1"]
    for name, p in out.items():
        assert p["tokens"] == [15, 15, 15] and all(x > 0 for x in p["engine_s"] + p["bare_s"])
        assert bl.paired_ratio(p) == pytest.approx((p["bare_s"][0] + p["bare_s"][1] + p["bare_s"][2])
                                                   / (p["engine_s"][0] + p["engine_s"][1] + p["engine_s"][2]))
        assert bl.paired_ratio(p, slice(1, None)) == pytest.approx((p["bare_s"][1] + p["bare_s"][2])
                                                                   / (p["engine_s"][1] + p["engine_s"][2]))
        rec = engines[name][1]
        assert rec.outputs == [] and rec.calls == []
