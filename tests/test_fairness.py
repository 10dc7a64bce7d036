"""One expensive request cannot monopolize the engine (issue 23): prompt log-probabilities computed
inside the chunked prefill, several positions per LM-head matmul (checked against a float64
log-softmax of the dense forward's logits), per-request caps with 400s naming the limit, and
scheduling that gives a small request its prefill and decode steps while a big one runs (checked
by engine steps, not time, with every output equal to its solo run)."""
import numpy as np
import pytest

from preft_jax import paged_step
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params
from serve.engine import Engine, EngineConfig
from serve.errors import RequestError
from serve.registry import AdapterRegistry
from serve.scheduler import fair_pick
from serve.validation import check_request_group

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
NO_STOP = (-1,)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=3)))


def _engine(runner, **kw):
    cfg = dict(max_num_seqs=8, max_model_len=128, max_prefill_seqs=2, max_num_batched_tokens=24, block_size=4)
    cfg.update(kw)
    return Engine(runner, AdapterRegistry(CFG, 0), EngineConfig(**cfg))


def _run(engine, handles):
    while any(not h.finished for h in handles):
        engine.step()
    for h in handles:
        assert h.error is None, h.error
    return [h.result for h in handles]


def test_prompt_logprobs_several_positions_per_matmul_equal_float64(runner, monkeypatch):
    """A prompt over several chunks (24-token step budget), echo with 5 top log-probs, batched with a
    request that asks none; positions grouped 3 per LM-head matmul (with a remainder group)."""
    R, V = 2, CFG.vocab_size
    monkeypatch.setattr(paged_step, "PROMPT_LOGIT_ELEMENTS", 3 * R * V)
    assert paged_step.prompt_logprob_positions(R, 16, V) == 3
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, V, 45).tolist()
    other = rng.integers(0, V, 30).tolist()
    eng = _engine(runner)
    want = eng.submit(prompt, None, SamplingParams(max_new_tokens=2, stop_token_ids=NO_STOP, prompt_logprobs=5))
    plain = eng.submit(other, None, SamplingParams(max_new_tokens=2, stop_token_ids=NO_STOP))
    out = want.output()
    _run(eng, [want, plain])
    while not want.events.empty():
        out.handle(want.events.get_nowait())
    eng_entries = out.prompt_logprobs
    x = np.asarray(sequence_logits(runner.graphdef, runner.state, np.asarray([prompt], np.int32),
                                   np.asarray([len(prompt)], np.int32))[0], np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))       # float64 log_softmax
    assert eng_entries[0] is None and len(eng_entries) == len(prompt)
    for pos in range(1, len(prompt)):
        lp, top = eng_entries[pos]
        assert abs(lp - logp[pos - 1, prompt[pos]]) < 1e-4, pos
        assert [t for t, _ in top] == np.argsort(-logp[pos - 1])[:5].tolist(), pos
        np.testing.assert_allclose([v for _, v in top], np.sort(logp[pos - 1])[::-1][:5], atol=1e-4, err_msg=str(pos))
    # the request that asked none generates what it generates alone
    solo = _engine(runner)
    assert _run(solo, [solo.submit(other, None, SamplingParams(max_new_tokens=2, stop_token_ids=NO_STOP))])[0].tokens \
        == plain.result.tokens


@pytest.mark.slow
def test_small_request_is_served_while_a_big_one_runs(runner):
    """A big request (6 prompts of 60 ids, echo + logprobs, one group) then, one step later, a 2-token
    request: the small one is admitted at once and finishes within a few steps, long before the big
    one; every output equals its solo run."""
    rng = np.random.default_rng(1)
    bigs = [rng.integers(0, CFG.vocab_size, 60).tolist() for _ in range(6)]
    small_prompt = rng.integers(0, CFG.vocab_size, 6).tolist()
    echo = SamplingParams(max_new_tokens=1, stop_token_ids=NO_STOP, prompt_logprobs=3)
    two = SamplingParams(max_new_tokens=2, stop_token_ids=NO_STOP)
    eng = _engine(runner)
    big = [eng.submit_n(p, None, echo, 1, group="big")[0] for p in bigs]
    eng.step()
    small = eng.submit(small_prompt, None, two)
    steps = 0
    while not small.finished:
        eng.step()
        steps += 1
    assert steps <= 3, steps                       # admitted on the next step, then 1 decode
    assert sum(not h.finished for h in big) >= 4   # most of the big request is still to come
    _run(eng, big)
    solo = _engine(runner)
    assert _run(solo, [solo.submit(small_prompt, None, two)])[0].tokens == small.result.tokens
    solo_big = _run(solo, [solo.submit(p, None, echo) for p in bigs])
    assert [r.tokens for r in solo_big] == [h.result.tokens for h in big]


def test_without_groups_the_small_request_waits_behind_the_big_one(runner, monkeypatch):
    """The same workload with fair picking replaced by FCFS (the old order): the small request is
    not admitted until the big one's prompts are - what the fair order fixes (so the test above can fail)."""
    import serve.scheduler as sch
    monkeypatch.setattr(sch, "fair_pick", lambda candidates, share: 0)
    rng = np.random.default_rng(1)
    bigs = [rng.integers(0, CFG.vocab_size, 60).tolist() for _ in range(6)]
    eng = _engine(runner)
    big = [eng.submit_n(p, None, SamplingParams(max_new_tokens=1, stop_token_ids=NO_STOP, prompt_logprobs=3), 1,
                        group="big")[0] for p in bigs]
    eng.step()
    small = eng.submit(rng.integers(0, CFG.vocab_size, 6).tolist(), None,
                       SamplingParams(max_new_tokens=2, stop_token_ids=NO_STOP))
    steps = 0
    while not small.finished:
        eng.step()
        steps += 1
    assert steps > 3 and sum(h.finished for h in big) >= 4


def test_fair_pick_round_robins_between_requests():
    class R:
        def __init__(self, g):
            self.group = g

    class S:
        def __init__(self, g):
            self.req = R(g)

    import collections
    cands = [(S("big"), False), (S("big"), True), (S("big"), True), (S("small"), True)]
    share = collections.Counter({"big": 1})
    assert fair_pick(cands, share) == 3           # the request holding nothing goes first
    share["small"] = 2
    assert fair_pick(cands, share) == 0           # then the least served, FCFS among equals


def test_request_caps_name_the_limit(runner):
    limits = _engine(runner, max_request_sequences=6, max_request_prompt_logprob_tokens=100).limits
    check_request_group(limits, [10, 10, 10], 2, True)
    with pytest.raises(RequestError) as e:
        check_request_group(limits, [10, 10, 10], 3, False)
    assert str(e.value) == ("this request starts 9 sequences (3 prompt(s) x n=3); the server's limit is 6 per "
                            "request (--max-request-sequences)")
    assert e.value.param == "n"
    with pytest.raises(RequestError) as e:
        check_request_group(limits, [60, 50], 1, True)
    assert str(e.value) == ("echo with logprobs asks for the log-probabilities of 110 prompt tokens; the server's "
                            "limit is 100 per request (--max-request-prompt-logprob-tokens)")
    check_request_group(limits, [60, 50], 1, False)            # no logprobs: no token cap
