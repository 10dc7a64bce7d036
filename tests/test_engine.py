"""Continuous batching == each request generated alone; errors at submit never touch other requests."""
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.config import PositionPolicy
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params
from serve.engine import Engine, EngineConfig
from serve.errors import AdapterInUseError, PromptTooLongError, RequestError, UnknownAdapterError
from serve.registry import AdapterRegistry

CFG = tiny_config()
ALL = PositionPolicy(mode="all")


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))


def _setup(runner, mode):
    policy = ALL if mode == "all" else PositionPolicy()
    adapters = {"a": random_lora(CFG, 1, policy=policy), "b": random_reft(CFG, 2, policy=policy),
                "c": random_lora(CFG, 3, rank=2, targets=("q", "up"), policy=policy)}
    reg = AdapterRegistry(CFG, capacity=4, lora_rank=4, reft_rank=4)
    for name, w in adapters.items():
        reg.load(name, w)
    eng = Engine(runner, reg, EngineConfig(n_slots=3, max_len=48, mode=mode, prefill_batch=2))
    return eng, adapters


def _alone(runner, adapters, prompt, name, sp):
    if name is None:
        return runner.generate([prompt], sp)[0].tokens
    bank = build_bank(CFG, [adapters[name]])
    return runner.generate([prompt], sp, bank=bank, adapter_ids=[1])[0].tokens


@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_continuous_batching_equals_each_request_alone(runner, mode):
    eng, adapters = _setup(runner, mode)
    rng = np.random.default_rng(0)
    specs = [(5, "a", 6), (3, None, 9), (7, "b", 4), (4, "c", 8), (6, "b", 5), (2, "a", 3), (9, None, 2)]
    reqs = []
    for i, (n, name, m) in enumerate(specs):      # staggered: new requests arrive while others decode
        sp = SamplingParams(max_new_tokens=m, stop_token_ids=(-1,))
        reqs.append((eng.submit(list(rng.integers(0, CFG.vocab_size, n)), name, sp), name, sp))
        if i % 2:
            eng.step()
    while eng.busy:
        eng.step()
    outs = []
    for req, name, sp in reqs:
        want = _alone(runner, adapters, req.prompt_ids, name, sp)
        assert req.result.tokens == want
        assert req.result.finish_reason == "length"
        outs.append(want)
    # adapters matter: the same prompt with and without adapter "a" differs
    p = reqs[0][0].prompt_ids
    assert _alone(runner, adapters, p, None, reqs[0][2]) != outs[0]


def test_stop_token_and_cache_full(runner):
    eng, adapters = _setup(runner, "prefill")
    prompt = [5, 6, 7]
    free = _alone(runner, adapters, prompt, "a", SamplingParams(max_new_tokens=6, stop_token_ids=(-1,)))
    stop = free[3]
    r = eng.generate([(prompt, "a", SamplingParams(max_new_tokens=6, stop_token_ids=(stop,)))])[0]
    assert r.finish_reason == "stop" and r.tokens == free[:free.index(stop)]
    long_prompt = list(range(1, 45))
    r = eng.generate([(long_prompt, None, SamplingParams(max_new_tokens=40, stop_token_ids=(-1,)))])[0]
    assert r.finish_reason == "length" and len(long_prompt) + len(r.tokens) == 48


def test_bad_requests_fail_at_submit_and_leave_others_intact(runner):
    eng, adapters = _setup(runner, "prefill")
    sp = SamplingParams(max_new_tokens=7, stop_token_ids=(-1,))
    good = eng.submit([9, 8, 7, 6], "a", sp)
    eng.step()
    with pytest.raises(UnknownAdapterError, match="nope"):
        eng.submit([1, 2], "nope", sp)
    with pytest.raises(PromptTooLongError, match="48"):
        eng.submit(list(range(1, 60)), "a", sp)
    with pytest.raises(RequestError, match="token ids"):
        eng.submit([CFG.vocab_size + 3], None, sp)
    with pytest.raises(RequestError, match="empty"):
        eng.submit([], None, sp)
    with pytest.raises(AdapterInUseError):
        eng.registry.unload("a")
    while eng.busy:
        eng.step()
    assert good.result.tokens == _alone(runner, adapters, [9, 8, 7, 6], "a", sp)
    eng.registry.unload("a")                      # free now; its slot can be reused by another adapter
    new = random_lora(CFG, 7)
    eng.registry.load("a2", new)
    r = eng.generate([([9, 8, 7, 6], "a2", sp)])[0]
    assert r.tokens == _alone(runner, {"a2": new}, [9, 8, 7, 6], "a2", sp)
    with pytest.raises(UnknownAdapterError):
        eng.submit([1], "a", sp)


def test_background_loop_serves_concurrent_requests(runner):
    eng, adapters = _setup(runner, "prefill")
    eng.start()
    try:
        sp = SamplingParams(max_new_tokens=5, stop_token_ids=(-1,))
        reqs = [eng.submit([3 + i, 4, 5], name, sp) for i, name in enumerate(["a", None, "b", "c", "a"])]
        for i, (req, name) in enumerate(zip(reqs, ["a", None, "b", "c", "a"])):
            assert req.wait(timeout=120).tokens == _alone(runner, adapters, [3 + i, 4, 5], name, sp)
        streamed = [p for kind, p in eng.submit([3, 4, 5], "a", sp).stream(timeout=120) if kind == "delta"]
        assert [t for toks, _ in streamed for t in toks] == reqs[0].result.tokens
    finally:
        eng.shutdown()


@pytest.mark.real_model
def test_real_model_stop_strings_and_text(default_model):
    cfg, params, tok = default_model
    runner = ModelRunner(Llama.from_params(cfg, params))
    eng = Engine(runner, AdapterRegistry(cfg, capacity=0), EngineConfig(n_slots=2, max_len=128), tokenizer=tok)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    sp = SamplingParams(max_new_tokens=12, stop_token_ids=tuple(tok.eos_token_ids))
    full = eng.generate([(ids, None, sp)])[0]
    assert "Paris" in full.text and full.tokens == runner.generate([ids], sp)[0].tokens
    cut = eng.generate([(ids, None, sp, ("Paris",))])[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index("Paris")]
