"""Async scheduling's prefill -> decode hand-off (serve/engine.py `_hand_off`): with
num_scheduler_steps > 1 a step's first decode call is dispatched right behind its prefill call, the
sequences that prefill completes taking their input token from its output on the device. Compared
with the synchronous engine (num_scheduler_steps=1, no hand-off) on the same requests: greedy and
seeded sampling, PreFT and base rows, chunked prompts, a first token that stops, a request whose
budget ends at its first or second token, parallel samples, log-probabilities, late arrivals that
join running rows and a KV pool small enough to preempt. And a prefill that fails on the device
after the hand-off: only its own requests fail, the decoding ones go on unchanged."""
import numpy as np
import pytest

from adapter_factory import random_lora
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params
from serve.engine import Engine, EngineConfig
from serve.errors import EngineError
from serve.registry import AdapterRegistry

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
NO_STOP = (-1,)


@pytest.fixture(scope="module")
def model():
    return Llama.from_params(CFG, random_params(CFG, seed=3))


def _engine(model, steps, **kw):
    reg = AdapterRegistry(CFG, capacity=2, lora_rank=4, reft_rank=4)
    reg.load("a", random_lora(CFG, 1))
    cfg = dict(max_num_seqs=6, max_model_len=48, max_prefill_seqs=4, max_num_batched_tokens=16, block_size=4,
               num_scheduler_steps=steps)
    cfg.update(kw)
    eng = Engine(ModelRunner(model), reg, EngineConfig(**cfg))
    handoffs = []                    # (rows of the call, rows handed over from the prefill)
    dispatch = eng.step_runner.dispatch_decode

    def spy(seqs, after=None, handoff=None):
        if handoff is not None:
            handoffs.append((len(seqs), int(np.sum(handoff[1] >= 0))))
        return dispatch(seqs, after, handoff)
    eng.step_runner.dispatch_decode = spy
    return eng, handoffs


def _drain(eng, late=()):
    """Steps until idle; `late`: (step index, submit thunk) pairs submitted as the steps go."""
    late, out, i = list(late), [], 0
    while eng.busy or late:
        while late and late[0][0] <= i:
            out.extend(late.pop(0)[1](eng))
        if eng.busy:
            eng.step()
        i += 1
        assert i < 2000, "engine did not drain"
    return out


def _workload(first_greedy):
    """(prompt, adapter, sampling, n) of the mix; `first_greedy`: base greedy first token of [8, 1, 8]."""
    sp = lambda n, **k: SamplingParams(max_new_tokens=n, stop_token_ids=k.pop("stop", NO_STOP), **k)  # noqa: E731
    now = [([3, 4, 5], "a", sp(9), 1),
           (list(range(1, 21)), None, sp(6), 1),                            # 20 tokens: two chunks of 16 + 4
           ([9, 8, 7, 6], "a", sp(7, temperature=0.9, seed=5), 1),
           ([5, 5], None, sp(1), 1),                                        # ends at its first token
           ([6, 1, 2], "a", sp(2), 1),                                      # one token after the first
           ([8, 1, 8], None, sp(5, stop=(first_greedy,)), 1)]              # its first token is a stop token
    late = [([4, 4, 4], None, sp(6, temperature=0.8, seed=3), 2),           # parallel samples
            ([2, 7, 1], "a", sp(4, logprobs=2), 1),
            (list(range(30, 43)), "a", sp(8), 1)]
    return now, late


def _submit(items):
    def go(eng):
        return [r for p, a, s, n in items for r in eng.submit_n(p, a, s, n)]
    return go


def _serve(model, steps, **kw):
    probe, _ = _engine(model, 1)
    first = probe.generate([([8, 1, 8], None, SamplingParams(max_new_tokens=1, stop_token_ids=NO_STOP))])[0].tokens[0]
    eng, handoffs = _engine(model, steps, **kw)
    now, late = _workload(first)
    reqs = _submit(now)(eng)
    reqs += _drain(eng, [(3, _submit(late))])
    out = [(r.result.tokens, r.result.finish_reason, r.result.logprobs) for r in reqs]     # in submission order
    assert eng.registry.in_use("a") == 0 and eng.registry.occupancy()["device_pinned"] == 0
    return out, handoffs, eng


@pytest.mark.parametrize("pool", [None, 40], ids=["pool-ample", "pool-preempts"])
def test_handoff_gives_the_synchronous_engines_outputs(model, pool):
    kw = {} if pool is None else {"kv_cache_tokens": pool}
    want, none, _ = _serve(model, 1, **kw)
    got, handoffs, eng = _serve(model, 4, **kw)
    assert got == want
    assert not none                                                    # synchronous: no hand-off
    assert any(h for _, h in handoffs)                                 # some prefill's rows were handed over
    assert any(0 < h < n for n, h in handoffs)                         # ... in a call with running rows
    stopped = [o for o in got if o[1] == "stop"]
    assert len(stopped) == 1 and stopped[0][0] == []                   # the first-token stop: nothing generated
    if pool is not None:
        assert eng.scheduler.preemptions >= 1


class _Boom:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("injected device failure")


def test_prefill_that_fails_on_the_device_after_the_handoff_fails_only_its_requests(model):
    bad_prompt, good_prompt = [7, 7, 7, 7, 7], [3, 4, 5]
    want = _engine(model, 1)[0].generate([(good_prompt, "a", SamplingParams(max_new_tokens=12,
                                                                            stop_token_ids=NO_STOP))])[0].tokens
    eng, handoffs = _engine(model, 4)

    def hook(call, run):
        out = run(call)
        if call.chunk > 1 and np.any(np.all(np.asarray(call.tokens)[:, :5] == 7, axis=1)):
            out = {**out, "boom": _Boom()}             # the tokens are fine; reading the call back fails
        return out
    eng.step_runner.add_call_hook(hook)
    good = eng.submit(good_prompt, "a", SamplingParams(max_new_tokens=12, stop_token_ids=NO_STOP))
    eng.step()
    eng.step()
    assert not good.finished and len(good.tokens) >= 2
    bad = eng.submit(bad_prompt, "a", SamplingParams(max_new_tokens=6, stop_token_ids=NO_STOP))
    _drain(eng)
    assert handoffs[-1] == (2, 1) or any(h == (2, 1) for h in handoffs)   # the bad prefill handed its row over
    assert isinstance(bad.error, EngineError) and "prefilling" in str(bad.error) and bad.request_id in str(bad.error)
    assert good.result.tokens == want                  # decoding alongside it: unchanged
    assert eng.metrics.step_failures["prefill"] == 1
    assert eng.registry.in_use("a") == 0
    after = eng.generate([(good_prompt, "a", SamplingParams(max_new_tokens=12, stop_token_ids=NO_STOP))])[0]
    assert after.tokens == want                        # the pool and the rows serve on


@pytest.mark.parametrize("n", [2, 5])
def test_handoff_makes_no_call_past_a_requests_budget(model, n):
    """1 prefill + n - 1 decode calls for n tokens: the handed row's budget counts its first token."""
    eng, handoffs = _engine(model, 4)
    calls = []
    eng.step_runner.add_call_hook(lambda call, run: calls.append(call.chunk) or run(call))
    r = eng.submit([3, 4, 5], "a", SamplingParams(max_new_tokens=n, stop_token_ids=NO_STOP))
    _drain(eng)
    assert len(r.result.tokens) == n and handoffs == [(1, 1)]
    assert len(calls) == n and calls[0] > 1 and calls[1:] == [1] * (n - 1)      # a prefill, then decodes


def test_a_chunked_prompt_does_not_wait_on_a_decode_chain(model):
    """While a prompt is part-way through its chunks, a step runs one decode call (the hand-off) and
    no chain: its next chunk comes the next step, not after num_scheduler_steps decode calls."""
    eng, _ = _engine(model, 4)
    calls = []
    eng.step_runner.add_call_hook(lambda call, run: calls.append("D" if call.chunk == 1 else "P") or run(call))
    a = eng.submit([3, 4, 5], "a", SamplingParams(max_new_tokens=30, stop_token_ids=NO_STOP))
    eng.step()
    eng.step()
    start = len(calls)
    b = eng.submit(list(range(1, 41)), None, SamplingParams(max_new_tokens=3, stop_token_ids=NO_STOP))
    _drain(eng)
    seen = "".join(calls[start:])
    first, last = seen.index("P"), seen.rindex("P")
    assert seen.count("P") >= 3 and seen[first:last + 1] == "PD" * ((last - first) // 2) + "P", seen
    assert len(a.result.tokens) == 30 and len(b.result.tokens) == 3


def _alone_n(model, prompt, sp, n):
    eng, _ = _engine(model, 1)
    reqs = eng.submit_n(prompt, None, sp, n)
    _drain(eng)
    return [r.result.tokens for r in reqs]


def test_a_handoff_call_that_loses_the_pool_leaves_the_prefills_other_rows_consistent(model):
    """The hand-off's decode dispatch fails after consuming the pool: its rows fail (not
    attributable), the recovery requeues the running sequences - among them a prompt of the same
    prefill that was not handed over (its samples wait on its logits) - and that prompt is
    recomputed, not taken as prefilled: its samples equal those of an engine without the failure,
    and no KV block leaks."""
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=NO_STOP, temperature=1.0, seed=11)
    want = _alone_n(model, [3, 4, 5], sp, 2)
    eng, _ = _engine(model, 4)
    state = {"prefill": False, "fired": False}

    def hook(call, run):
        if call.chunk > 1:
            state["prefill"] = True
        elif state["prefill"] and not state["fired"]:
            state["fired"] = True
            eng.step_runner.cache.k.delete()
            raise RuntimeError("injected: the hand-off's decode dispatch failed after consuming the pool")
        return run(call)
    eng.step_runner.add_call_hook(hook)
    xs = eng.submit_n([3, 4, 5], None, sp, 2)
    y = eng.submit([6, 1, 2], None, SamplingParams(max_new_tokens=5, stop_token_ids=NO_STOP))
    eng.step()
    parent = eng.sequence(xs[0])
    assert parent.status == "waiting" and parent.num_computed == 0 and parent in eng.scheduler.waiting
    assert not eng.scheduler.running
    _drain(eng)
    assert state["fired"] and isinstance(y.error, EngineError) and "decoding" in str(y.error)
    assert [r.result.tokens for r in xs] == want
    assert eng.pool.num_available == eng.pool.capacity


def test_chunks_requeued_by_a_failed_block_copy_are_not_prefilled(model):
    """A copy-on-write that fails after consuming the pool requeues the running sequences; the
    step's prefill chunks of those sequences are dropped, not run on blocks they no longer hold
    (which wrote block 0 and registered all-zero K/V in the prefix cache)."""
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=NO_STOP)
    want_z = _alone_n(model, [9, 9, 9, 9, 9, 1], SamplingParams(max_new_tokens=5, stop_token_ids=NO_STOP), 1)[0]
    eng, _ = _engine(model, 4)
    xs = eng.submit_n([3, 4, 5], None, sp, 2)
    eng.step()
    z = eng.submit([9, 9, 9, 9, 9, 1], None, SamplingParams(max_new_tokens=5, stop_token_ids=NO_STOP))
    copy = eng.step_runner.copy_blocks

    def boom(copies):
        eng.step_runner.cache.k.delete()
        raise RuntimeError("injected: block copy failed after consuming the pool")
    eng.step_runner.copy_blocks = boom
    eng.step()
    eng.step_runner.copy_blocks = copy
    zs = eng.sequence(z)
    assert zs.status == "waiting" and zs.blocks == [] and zs in eng.scheduler.waiting
    assert not eng.pool._by_hash                               # nothing registered from the dropped chunk
    _drain(eng)
    assert all(isinstance(r.error, EngineError) for r in xs)  # the decoding samples failed with the copy
    assert z.result.tokens == want_z
    assert eng.pool.num_available == eng.pool.capacity
    w = eng.submit([9, 9, 9, 9, 9, 1], None, SamplingParams(max_new_tokens=5, stop_token_ids=NO_STOP))
    _drain(eng)
    assert w.result.tokens == want_z                          # no poisoned prefix-cache entry
