"""Warm-up (serve/warmup.py): `warmup()` compiles every program the engine can call, so serving any
mix of prompt lengths, chunked prompts, adapters and n > 1 compiles nothing more; the background
warm-up (the server's default) serves requests that arrive before it is done with the same outputs,
and once it is done nothing compiles either."""
import time

import jax
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from greedy_reference import first_tokens
from preft_jax.adapters.bank import build_bank
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.paged_step import bind_paged_step, copy_blocks, paged_step, sample_rows
from preft_jax.sampling import SamplingParams
from reference_llama import random_params
from serve.engine import Engine, EngineConfig
from serve.registry import AdapterRegistry, with_policy
from serve.step_runner import decode_step, handoff_tokens

pytestmark = [pytest.mark.slow,      # whole module; README "Tests" names where its fast path is covered
              pytest.mark.usefixtures("cheap_codegen")]

CFG = tiny_config()
NO_STOP = (-1,)
ADAPTERS = {"a": random_lora(CFG, 21), "b": random_reft(CFG, 22)}


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=3)))


def _engine(runner, **kw):
    reg = AdapterRegistry(CFG, 4, lora_rank=4, reft_rank=4)
    for n, w in ADAPTERS.items():
        reg.load(n, w)
    cfg = dict(max_num_seqs=4, max_model_len=48, max_prefill_seqs=4, max_num_batched_tokens=24, block_size=4)
    cfg.update(kw)
    return Engine(runner, reg, EngineConfig(**cfg))


def _requests(seed, n=7):
    rng = np.random.default_rng(seed)
    names = ("a", None, "b")
    return [(rng.integers(0, CFG.vocab_size, int(rng.integers(2, 36))).tolist(), names[i % 3], int(rng.integers(2, 10)))
            for i in range(n)]


_REFS: dict = {}


def _alone(runner, prompt, name, n):
    bank = None if name is None else build_bank(CFG, [with_policy(ADAPTERS[name], "prefill")])
    return first_tokens(runner, prompt, n, bank, memo=_REFS, key=(tuple(prompt), name))


def _compiled(runner):
    """Programs compiled so far; the prefill and decode steps are the engine's (`bind_paged_step`
    and `decode_step` bind the runner's graph and State structure and return the same jitted
    function for them every time)."""
    tree = jax.tree_util.tree_structure(runner.state)
    return (paged_step._cache_size() + bind_paged_step(runner.graphdef, state_tree=tree)._cache_size()
            + decode_step(runner.graphdef, state_tree=tree)._cache_size() + sample_rows._cache_size()
            + copy_blocks._cache_size() + handoff_tokens._cache_size())


def _serve_all(eng, reqs, n_samples=3):
    """Every request, plus one n > 1 sampled request, through the background loop; returns tokens."""
    handles = [eng.submit(p, a, SamplingParams(max_new_tokens=m, stop_token_ids=NO_STOP)) for p, a, m in reqs]
    forks = eng.submit_n(reqs[0][0], "a", SamplingParams(max_new_tokens=3, temperature=0.8, seed=5,
                                                         stop_token_ids=NO_STOP), n_samples)
    return [h.wait(timeout=600).tokens for h in handles], [f.wait(timeout=600).tokens for f in forks]


@pytest.mark.parametrize("fused", [1, 4])
def test_full_warmup_leaves_nothing_to_compile(runner, fused):
    """... with fused 4-step decode calls too (their programs are warm-up tasks of their own). The
    warm-up freezes the startup heap (EngineConfig.freeze_gc) and shutdown thaws it."""
    import gc
    gc.unfreeze()
    before_thresholds = gc.get_threshold()
    eng = _engine(runner, decode_steps_per_call=fused, gc_gen0_threshold=12_345)
    eng.warmup()
    assert gc.get_freeze_count() > 1000
    assert gc.get_threshold() == (12_345, *before_thresholds[1:])
    before = _compiled(runner)
    eng.start()
    try:
        got, _ = _serve_all(eng, _requests(1) + [(list(range(5)), None, 30)])   # long enough for fused calls
    finally:
        eng.shutdown()
    assert _compiled(runner) == before
    assert got[0] == _alone(runner, *_requests(1)[0])
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before_thresholds
    eng = _engine(runner, freeze_gc=False)
    eng.warmup()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before_thresholds


def test_background_warmup_serves_early_requests_exactly(runner):
    eng = _engine(runner, max_num_batched_tokens=16)
    n = eng.warm_in_background()
    assert n == len(eng.warmup_tasks()) > 4 and eng.health()["warmup_pending"] == n
    eng.start()
    try:
        reqs = _requests(2)
        got, _ = _serve_all(eng, reqs)                   # submitted while most shapes are not compiled yet
        for (p, a, m), toks in zip(reqs, got):
            assert toks == _alone(runner, p, a, m)
        deadline = time.monotonic() + 600
        while eng.health()["warmup_pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.health()["warmup_pending"] == 0
        before = _compiled(runner)
        got2, _ = _serve_all(eng, _requests(3))
        assert _compiled(runner) == before                     # warm: nothing compiles any more
    finally:
        eng.shutdown()
    for (p, a, m), toks in zip(_requests(3), got2):
        assert toks == _alone(runner, p, a, m)


def _small_engine(runner, **kw):
    """Few buckets (two prefill, two decode shapes): a background warm-up of a few seconds."""
    return _engine(runner, **dict(dict(max_num_seqs=2, max_model_len=16, max_prefill_seqs=1,
                                       max_num_batched_tokens=8, block_size=8), **kw))


def _wait_warm(eng, timeout=600.0):
    deadline = time.monotonic() + timeout
    while eng.health()["warmup_pending"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.health()["warmup_pending"] == 0


def test_an_adapter_upload_during_background_warmup_does_not_kill_it(runner, caplog):
    """Issue 23: the first adapter request uploads its adapter into the bank, which donates (frees)
    the bank array; warm-up tasks read the bank when they run, so every later task still compiles."""
    eng = _small_engine(runner)
    n = eng.warm_in_background()
    assert n >= 5 and eng.registry.occupancy()["device_resident"] == 0
    eng.start()
    try:
        p, a, m = [5, 6, 7], "a", 4
        r = eng.submit(p, a, SamplingParams(max_new_tokens=m, stop_token_ids=NO_STOP))    # pins: a slot write
        assert r.wait(timeout=600).tokens == _alone(runner, p, a, m)
        _wait_warm(eng)
        h = eng.health()
        assert h["warmup_failed"] == 0 and h["loop_running"]
    finally:
        eng.shutdown()
    assert not [rec for rec in caplog.records if "warm-up" in rec.getMessage() and rec.levelname != "INFO"]


def test_a_failing_warmup_task_is_retried_once_then_skipped(runner, caplog):
    """One shape fails once (retried: compiled), another fails every time (skipped, one log line
    each time); the remaining tasks still run and /health says what happened."""
    eng = _small_engine(runner)
    assert eng.step_runner.block_buckets == [1, 2]
    flaky, broken = "decode (context 1 blocks)", "decode (context 2 blocks)"
    tasks = [label for label, _ in eng.warmup_tasks()]
    assert flaky in tasks and broken in tasks
    failures = {1: 1, 2: 10 ** 6}            # decode calls by block-table width: failures left to inject

    def hook(call, run):
        nb = call.width
        if call.chunk == 1 and call.bank is None and failures.get(nb, 0) > 0:    # base decode programs only
            failures[nb] -= 1
            raise RuntimeError(f"injected failure\nsecond line, width {nb}")
        return run(call)

    eng.step_runner.add_call_hook(hook)
    with caplog.at_level("INFO", logger="serve.engine"):
        assert eng.warm_in_background() == len(tasks) == eng.health()["warmup_pending"]
        eng.start()
        try:
            _wait_warm(eng)
            h = eng.health()
            assert h["warmup_failed"] == 1 and h["loop_running"]
            assert h["warmup_skipped"] == [f"{broken} (RuntimeError: injected failure)"]
            failures.clear()
            r = eng.submit([9, 8, 7], None, SamplingParams(max_new_tokens=3, stop_token_ids=NO_STOP))
            assert r.wait(timeout=600).tokens == _alone(runner, [9, 8, 7], None, 3)
        finally:
            eng.shutdown()
    lines = [rec.getMessage() for rec in caplog.records if "warm-up of" in rec.getMessage()]
    assert lines == [f"background warm-up of {flaky!r} failed (RuntimeError: injected failure); retrying it once",
                     f"background warm-up of {broken!r} failed (RuntimeError: injected failure); retrying it once",
                     f"background warm-up of {broken!r} failed again (RuntimeError: injected failure); skipped, "
                     f"it compiles on first use"]


def _failing_hook(failures):
    """A call hook failing decode calls by block-table width, failures[width] times each."""
    def hook(call, run):
        if call.chunk == 1 and call.bank is None and failures.get(call.width, 0) > 0:   # base decode only
            failures[call.width] -= 1
            raise RuntimeError(f"injected failure\nsecond line, width {call.width}")
        return run(call)
    return hook


def test_a_failing_full_warmup_task_is_retried_once_then_skipped(runner, caplog):
    """`warmup()` (--warmup full) follows the background policy: no exception stops the server start;
    a shape failing once is retried (compiled), one failing every time is skipped with one ERROR line,
    the other tasks all compile, and health() lists the skipped one."""
    eng = _small_engine(runner)
    flaky, broken = "decode (context 1 blocks)", "decode (context 2 blocks)"
    tasks = [label for label, _ in eng.warmup_tasks()]
    failures = {1: 1, 2: 10 ** 6}
    eng.step_runner.add_call_hook(_failing_hook(failures))
    progress = []
    with caplog.at_level("INFO", logger="serve.engine"):
        eng.warmup(progress=progress.append)
    assert progress == ([f"compiling {i + 1}/{len(tasks)}: {label}" for i, label in enumerate(tasks)]
                        + [f"compiling again: {flaky}", f"compiling again: {broken}"])
    lines = [(rec.levelname, rec.getMessage()) for rec in caplog.records if rec.name == "serve.engine"]
    assert lines == [("WARNING", f"warm-up of {flaky!r} failed (RuntimeError: injected failure); retrying it once"),
                     ("WARNING", f"warm-up of {broken!r} failed (RuntimeError: injected failure); retrying it once"),
                     ("ERROR", f"warm-up of {broken!r} failed again (RuntimeError: injected failure); skipped, "
                               f"it compiles on first use")]
    h = eng.health()
    assert h["warmup_failed"] == 1 and h["warmup_pending"] == 0
    assert h["warmup_skipped"] == [f"{broken} (RuntimeError: injected failure)"]
    failures.clear()
    eng.start()
    try:
        r = eng.submit([9, 8, 7, 6, 5, 4, 3, 2, 1], None, SamplingParams(max_new_tokens=6, stop_token_ids=NO_STOP))
        assert r.wait(timeout=600).tokens == _alone(runner, [9, 8, 7, 6, 5, 4, 3, 2, 1], None, 6)
    finally:
        eng.shutdown()
