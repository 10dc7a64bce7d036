"""Engine failure isolation: a failing step fails only the request that caused it (or, when that
cannot be known, every affected request and nothing else), adapter references are released on every
path, deadlines and shutdown end stuck requests, and a full queue refuses instead of growing."""
import gc
import threading
import time
import weakref

import jax
import numpy as np
import pytest

from adapter_factory import random_lora
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params
from serve.engine import Engine, EngineConfig
from serve.errors import DeadlineExceededError, EngineError, QueueFullError, RequestError, UnavailableError
from serve.registry import AdapterRegistry

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
POISON = 251            # a prompt containing this token id makes the faulty runner's prefill fail
NO_STOP = (-1,)


class Faults:
    """Injectable failures around the engine's device calls: poisoned prefills, failing decodes, a
    decode that blocks until released, and failures that consume the donated KV pool."""

    def __init__(self, eng):
        self.eng = eng
        self.fail_decodes = 0
        self.consume_cache = False
        self.block = None          # a threading.Event: decode waits on it
        eng.step_runner.add_call_hook(self)

    def _fail(self, what):
        if self.consume_cache:
            self.eng.step_runner.cache.k.delete()
            self.eng.step_runner.cache.v.delete()
        raise RuntimeError(f"injected {what} failure")

    def __call__(self, call, run):
        decode = call.chunk == 1
        if not decode and np.any(np.asarray(call.tokens) == POISON):
            self._fail("prefill")
        if decode:
            if self.block is not None:
                self.block.wait()
            if self.fail_decodes:
                self.fail_decodes -= 1
                self._fail("decode")
        return run(call)


@pytest.fixture(scope="module")
def model():
    return Llama.from_params(CFG, random_params(CFG, seed=0))


def _engine(model, **kw):
    reg = AdapterRegistry(CFG, capacity=2, lora_rank=4, reft_rank=4)
    reg.load("a", random_lora(CFG, 1))
    cfg = dict(max_num_seqs=3, max_model_len=48, max_prefill_seqs=3, max_num_batched_tokens=32, block_size=4)
    cfg.update(kw)
    eng = Engine(ModelRunner(model), reg, EngineConfig(**cfg))
    return eng, Faults(eng)


def _sp(n):
    return SamplingParams(max_new_tokens=n, stop_token_ids=NO_STOP)


def _run(eng):
    for _ in range(500):
        if not eng.busy:
            return
        eng.step()
    raise AssertionError("engine did not drain")


def _alone(model, prompt, adapter, n):
    eng, _ = _engine(model)
    return eng.generate([(prompt, adapter, _sp(n))])[0].tokens


@pytest.mark.slow
def test_poisoned_prefill_fails_only_its_request(model):
    good = [[3, 4, 5], [9, 8, 7, 6]]
    want = [_alone(model, p, "a", 6) for p in good]
    eng, _ = _engine(model)
    reqs = [eng.submit(good[0], "a", _sp(6)), eng.submit([1, POISON, 2], "a", _sp(6)),
            eng.submit(good[1], "a", _sp(6))]            # all three land in one prefill batch
    _run(eng)
    assert reqs[0].result.tokens == want[0] and reqs[2].result.tokens == want[1]
    assert isinstance(reqs[1].error, EngineError) and reqs[1].result is None
    assert "prefilling" in str(reqs[1].error) and reqs[1].request_id in str(reqs[1].error)
    assert eng.registry.in_use("a") == 0
    eng.registry.unload("a")                             # no reference leaked
    assert eng.metrics.requests_failed["engine_error"] == 1


def test_prefill_failure_that_consumes_the_cache_recomputes_the_running(model):
    want = _alone(model, [3, 4, 5], "a", 20)
    eng, faults = _engine(model, max_prefill_seqs=1, num_scheduler_steps=1)   # one token per step
    faults.consume_cache = True
    running = eng.submit([3, 4, 5], "a", _sp(20))
    eng.step()
    eng.step()
    assert not running.finished and len(running.tokens) == 2
    bad = eng.submit([POISON], None, _sp(3))
    after = eng.submit([7, 7], None, _sp(4))
    _run(eng)
    assert bad.error is not None and "prefilling" in str(bad.error)
    assert running.result.tokens == want                # its KV was lost and recomputed, output unchanged
    assert after.result.tokens == _alone(model, [7, 7], None, 4)
    assert eng.scheduler.preemptions >= 1 and eng.registry.in_use("a") == 0


@pytest.mark.slow
def test_decode_failure_fails_running_requests_only(model):
    eng, faults = _engine(model, max_num_seqs=2, max_prefill_seqs=2)
    r1, r2 = eng.submit([3, 4], "a", _sp(8)), eng.submit([5, 6], None, _sp(8))
    eng.step()
    waiting = eng.submit([1, 2, 3], "a", _sp(5))           # no free row: stays queued
    faults.fail_decodes = 1
    eng.step()
    assert isinstance(r1.error, EngineError) and isinstance(r2.error, EngineError)
    _run(eng)
    assert waiting.result.tokens == _alone(model, [1, 2, 3], "a", 5)
    assert eng.registry.in_use("a") == 0 and eng.metrics.step_failures["decode"] == 1


def test_host_side_token_failure_fails_only_that_request(model):
    """Token handling is per request: one that raises fails alone, and a consumer whose event sink
    breaks (a closed event loop, ...) never reaches the engine or the other requests."""
    other = _alone(model, [1, 2, 3, 4], None, 5)

    class Broken:
        def put(self, event):
            raise RuntimeError("the consumer is gone")

    eng, _ = _engine(model)

    def picky(req, token):
        if req.prompt_ids == [9, 9, 9] and len(req.tokens) == 2:
            raise ValueError("injected token-handling error")

    eng.add_token_hook(picky)
    r_bad = eng.submit([9, 9, 9], "a", _sp(5))
    r_ok = eng.submit([1, 2, 3, 4], None, _sp(5))
    r_deaf = eng.submit([1, 2, 3, 4], "a", _sp(5), events=Broken())
    _run(eng)
    assert r_bad.error is not None and "processing its output" in str(r_bad.error)
    assert r_ok.result.tokens == other
    assert r_deaf.result is not None and len(r_deaf.result.tokens) == 5
    assert eng.registry.in_use("a") == 0


def test_deadline_and_queue_limit(model):
    eng, _ = _engine(model, max_num_seqs=1, max_prefill_seqs=1, max_num_batched_tokens=8, max_queued=2)
    slow = eng.submit([3, 4], "a", _sp(40), timeout=0.5)
    eng.step()                                           # slow now holds the only slot
    q1 = eng.submit([5], None, _sp(2))
    eng.submit([6], None, _sp(2))
    with pytest.raises(QueueFullError, match="queue is full"):
        eng.submit([7], "a", _sp(2))
    assert eng.registry.in_use("a") == 1                 # the refused request took no reference
    time.sleep(0.6)
    _run(eng)
    assert isinstance(slow.error, DeadlineExceededError) and slow.error.status == 504
    assert q1.result is not None and eng.registry.in_use("a") == 0
    with pytest.raises(RequestError, match="timeout"):
        eng.submit([1], None, _sp(1), timeout=float("nan"))


def test_submit_many_is_all_or_nothing(model):
    """`submit_many` queues a batch only when every item is valid, its adapter known and the queue has
    room for all of it: a bad item anywhere (validation, an unknown adapter, the queue's room) raises
    and leaves nothing queued and no adapter reference taken; a good batch gives each item the
    tokens it gets submitted alone, and `generate` returns n completions per item in order."""
    from serve.errors import UnknownAdapterError
    from serve.request import GenerationRequest
    prompts = [[3, 4, 5], [9, 8, 7, 6], [2, 11]]
    want = [_alone(model, p, a, 5) for p, a in zip(prompts, ("a", None, "a"))]
    eng, _ = _engine(model, max_queued=3)
    bad_items = [
        ([(prompts[0], "a", _sp(5)), (prompts[1], None, _sp(5)), ([], "a", _sp(5))], RequestError, "prompt is empty"),
        ([(prompts[0], "a", _sp(5)), (prompts[1], "nope", _sp(5))], UnknownAdapterError, "nope"),
        ([(p, "a", _sp(5)) for p in prompts] + [([1], None, _sp(5))], RequestError,
         r"this submission brings 4 prompts; the request queue holds at most 3 \(max_queued"),   # never fits: 400
    ]
    for items, error, text in bad_items:
        with pytest.raises(error, match=text):
            eng.submit_many(items)
        assert not eng.busy and eng.queued == 0 and eng.registry.in_use("a") == 0
        assert eng.metrics.requests_submitted == 0
    first = eng.submit([1], None, _sp(1))
    with pytest.raises(QueueFullError, match=r"room for 2 more prompt\(s\) and this submission brings 3"):
        eng.submit_many([(p, "a", _sp(5)) for p in prompts])
    assert eng.queued == 1 and eng.registry.in_use("a") == 0
    _run(eng)
    assert first.result is not None
    reqs = eng.submit_many([GenerationRequest(p, a, _sp(5), request_id=f"r{i}")
                            for i, (p, a) in enumerate(zip(prompts, ("a", None, "a")))])
    assert [len(r) for r in reqs] == [1, 1, 1] and [r[0].request_id for r in reqs] == ["r0", "r1", "r2"]
    assert eng.registry.in_use("a") == 2 and eng.queued == 3
    with pytest.raises(QueueFullError, match="queue is full"):
        eng.submit([1], None, _sp(1))
    _run(eng)
    assert [r[0].result.tokens for r in reqs] == want and eng.registry.in_use("a") == 0
    seeded = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7, stop_token_ids=NO_STOP)
    lone = _engine(model)[0]
    pair = lone.submit_n(prompts[1], "a", seeded, n=2)
    _run(lone)
    out = _engine(model, max_queued=1)[0].generate([GenerationRequest(prompts[1], "a", seeded, n=2),
                                                    (prompts[0], None, _sp(3))])   # offline: no queue bound
    assert [r.tokens for r in out] == [pair[0].result.tokens, pair[1].result.tokens, _alone(model, prompts[0], None, 3)]
    assert pair[0].result.tokens != pair[1].result.tokens          # two different samples, in their order


def test_sweep_ends_what_cancel_and_deadlines_name(model):
    """The step's sweep ends exactly the requests `cancel` named and those past their deadline (a
    deadline heap, no per-request scan): a cancelled sibling of an n=2 prompt that waits for its
    parent's prefill ends alone, its parent and a later request run on; a request whose deadline
    passes while it waits in the queue fails with 504; finished requests do not pile up in the heap."""
    eng, _ = _engine(model, max_num_seqs=2, max_prefill_seqs=1, max_num_batched_tokens=8)
    want = _alone(model, [3, 4, 5], None, 4)
    parent, kid = eng.submit_n([3, 4, 5], None, _sp(4), n=2)
    hog = eng.submit([6, 7], None, _sp(30))
    late = eng.submit([8], None, _sp(2), timeout=0.2)     # waits: both rows are taken
    eng.cancel(kid)
    eng.step()
    assert kid.finished and kid.result.finish_reason == "cancelled" and not parent.finished
    for _ in range(3):
        eng.step()
    assert hog.tokens and not hog.finished
    eng.cancel(hog)                                       # decoding: ended at the next step
    eng.step()
    assert hog.finished and hog.result.finish_reason == "cancelled" and len(hog.result.tokens) < 30
    time.sleep(0.3)
    _run(eng)
    assert parent.result.tokens == want and parent.result.finish_reason == "length"
    assert isinstance(late.error, DeadlineExceededError) and late.error.status == 504
    for _ in range(3):                                    # 1100 short requests, each with a deadline
        for r in [eng.submit([1, 2], None, _sp(1), timeout=600.0) for _ in range(400)]:
            pass
        _run(eng)
    assert len(eng._deadlines) <= 1024 + 2 * len(eng.live_requests()) + 1
    done = eng.submit([1, 2], None, _sp(1), timeout=600.0)
    _run(eng)
    gone = weakref.ref(done)
    del done, r
    gc.collect()
    assert gone() is None                                 # the deadline heap does not keep it alive


def test_validation_refuses_what_the_engine_cannot_represent(model):
    eng, _ = _engine(model)
    with pytest.raises(RequestError, match="top_k"):
        eng.submit([1, 2], None, SamplingParams(top_k=CFG.vocab_size + 1))
    with pytest.raises(RequestError, match="stop token"):
        eng.submit([1, 2], None, SamplingParams(stop_token_ids=(CFG.vocab_size,)))
    with pytest.raises(ValueError):
        SamplingParams(top_k=2 ** 31)
    with pytest.raises(ValueError):
        SamplingParams(temperature=float("nan"))
    assert not eng.busy and eng.registry.in_use("a") == 0


def test_nan_adapter_is_refused_before_the_bank(model):
    eng, _ = _engine(model)
    bad = random_lora(CFG, 5)
    bad.B["q"][1, 0, 0] = np.nan
    with pytest.raises(RequestError, match="NaN or Inf"):
        eng.registry.load("bad", bad)
    assert "bad" not in eng.registry


def test_shutdown_with_a_stuck_step_returns_and_fails_everything(model):
    eng, faults = _engine(model, max_num_seqs=1, max_prefill_seqs=1, max_num_batched_tokens=8)
    faults.block = threading.Event()
    eng.start()
    stuck = eng.submit([3, 4], "a", _sp(10))
    queued = eng.submit([5, 6], None, _sp(3))
    deadline = time.monotonic() + 60
    while eng.health()["step_in_progress_s"] < 0.3 and time.monotonic() < deadline:
        time.sleep(0.05)                                  # the loop is now blocked inside decode
    h = eng.health()
    assert h["running"] == 1 and h["queued"] == 1
    t0 = time.monotonic()
    eng.shutdown(grace=0.5, join_timeout=0.5)
    assert time.monotonic() - t0 < 5
    for r in (stuck, queued):
        with pytest.raises(EngineError, match="shutting down"):
            r.wait(timeout=5)
    assert eng.registry.in_use("a") == 0
    with pytest.raises(UnavailableError):
        eng.submit([1], None, _sp(1))
    faults.block.set()                                    # let the abandoned thread finish


def test_health_reports_a_wedged_step(model):
    """/health's status over an engine's life (serve.api.ops.health_status): unhealthy before its loop
    starts and while a step is wedged, ok otherwise, shutting_down once shut down - also after the
    drain has ended the loop (the process is about to exit: not "unhealthy")."""
    from serve.api.ops import health_status
    eng, faults = _engine(model, max_num_seqs=1, max_prefill_seqs=1, max_num_batched_tokens=8, wedge_timeout=0.3)
    faults.block = threading.Event()
    assert health_status(eng.health()) == "unhealthy"
    eng.start()
    try:
        assert not eng.health()["wedged"] and health_status(eng.health()) == "ok"
        r = eng.submit([3, 4], None, _sp(5))
        deadline = time.monotonic() + 60
        while not eng.health()["wedged"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.health()["wedged"] and health_status(eng.health()) == "unhealthy"
        faults.block.set()
        r.wait(timeout=60)
        deadline = time.monotonic() + 30                 # the step that settled r may still be ending
        while eng.health()["wedged"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not eng.health()["wedged"] and health_status(eng.health()) == "ok"
    finally:
        faults.block.set()
        eng.shutdown()
    h = eng.health()
    assert not h["loop_running"] and health_status(h) == "shutting_down"
    jax.clear_caches()


def test_concurrent_shutdowns_are_safe(model):
    """Issue 23: a server's exit handler and its lifespan hook shut the engine down at once. Every
    caller returns without an error, /health stays readable throughout, requests fail with 503."""
    for attempt in range(3):
        eng, faults = _engine(model, max_num_seqs=1, max_prefill_seqs=1, max_num_batched_tokens=8)
        faults.block = threading.Event()                  # the loop is busy inside a step
        eng.start()
        req = eng.submit([3, 4], "a", _sp(10))
        deadline = time.monotonic() + 60
        while eng.health()["step_in_progress_s"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        errors, stop_probe = [], threading.Event()

        def call(fn):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - what the test looks for
                errors.append(e)

        def probe():
            while not stop_probe.is_set():
                call(eng.health)

        threads = [threading.Thread(target=call, args=(lambda g=g: eng.shutdown(grace=g, join_timeout=0.3),))
                   for g in (0.2, 0.0, 0.1, 0.3)] + [threading.Thread(target=probe)]
        for t in threads:
            t.start()
        for t in threads[:-1]:
            t.join(30)
        faults.block.set()
        stop_probe.set()
        threads[-1].join(30)
        assert errors == [], (attempt, errors)
        with pytest.raises(EngineError, match="shutting down"):
            req.wait(timeout=5)
        h = eng.health()
        assert not h["loop_running"] and not h["accepting"]
        eng.shutdown()                                    # once more, after the fact: a no-op
        assert eng.registry.in_use("a") == 0
