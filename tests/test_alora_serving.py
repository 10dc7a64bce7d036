"""Activated (aLoRA) adapters in the serving engine: mixed in one batch with PreFT and base requests,
each request's greedy tokens equal a float64 full recompute with the adapter acting from the last
occurrence of its invocation (prompt tail and every generated token); decode takes the adapter bank
only when such a row is in the batch; a prompt without the invocation is refused (400) naming the
adapter and the sequence; prefix-cache blocks before the activation start are base blocks, shared
with base requests, PreFT last_k requests and every other aLoRA adapter."""
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from preft_jax.adapters.config import PositionPolicy
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params, reference_logits
from serve.engine import Engine, EngineConfig
from serve.errors import AdapterFitError, InvocationMissingError
from serve.registry import AdapterRegistry
from serve.step_runner import ADAPTER, CHUNK, DecodeCall

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
PARAMS = random_params(CFG, seed=0)
NO_STOP = (-1,)
INV = {"mid": (7, 8, 9), "end": (40, 41), "twice": (3, 5, 3, 6)}
ALORA = {k: random_lora(CFG, 10 + i, policy=PositionPolicy.activated(inv)) for i, (k, inv) in enumerate(INV.items())}
PREFT = random_lora(CFG, 20)
LASTK = random_lora(CFG, 21, policy=PositionPolicy(last_k=3))
REFT = random_reft(CFG, 22)
CPU_DECODE = "native"


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, PARAMS))


@pytest.fixture(scope="module", autouse=True)
def _decode_path(cpu_decode):
    global CPU_DECODE
    CPU_DECODE = cpu_decode


def _engine(runner, mode="prefill", prefix=True, **kw):
    reg = AdapterRegistry(CFG, capacity=4, lora_rank=4, reft_rank=4, **kw)
    for name, w in {**ALORA, "preft": PREFT, "lastk": LASTK, "reft": REFT}.items():
        reg.load(name, w)
    return Engine(runner, reg, EngineConfig(max_num_seqs=6, max_model_len=64, mode=mode, max_prefill_seqs=4,
                                            max_num_batched_tokens=32, block_size=4, cpu_decode=CPU_DECODE,
                                            enable_prefix_cache=prefix))


def _prompts():
    rng = np.random.default_rng(0)
    r = lambda n: rng.integers(10, CFG.vocab_size, n).tolist()      # noqa: E731 - no accidental invocations
    return {"mid": r(9) + list(INV["mid"]) + r(5), "end": r(13) + list(INV["end"]),
            "twice": r(3) + list(INV["twice"]) + r(6) + list(INV["twice"]) + r(2), "preft": r(11), "base": r(8)}


def _weights(name):
    return {**ALORA, "preft": PREFT, "lastk": LASTK}.get(name)


def _replay_ok(prompt, tokens, name, mode="prefill"):
    """Float64 full recompute of prompt + generated tokens, the adapter on the positions its policy
    covers (activated: from the LAST occurrence of the invocation on, generated tokens included):
    each generated token is the argmax given the ones before."""
    seq = np.asarray([list(prompt) + list(tokens)])
    idx = np.zeros_like(seq)
    w = _weights(name)
    if w is not None:
        pol = w.config.policy
        if pol.mode == "activated":
            inv, p = list(pol.invocation_tokens), list(prompt)
            start = max(i for i in range(len(p) - len(inv) + 1) if p[i:i + len(inv)] == inv)
            idx[:, start:] = 1
        elif mode == "all":
            idx[:] = 1
        else:
            idx[:, len(prompt) - (pol.last_k or len(prompt)):len(prompt)] = 1
    logits = reference_logits(CFG, PARAMS, seq, idx, {} if w is None else {1: w})[0]
    return logits[len(prompt) - 1:seq.shape[1] - 1].argmax(-1).tolist() == list(tokens)


@pytest.mark.parametrize("mode", ["prefill", pytest.param("all", marks=pytest.mark.slow)])
def test_activated_mixed_with_preft_and_base_in_one_batch(runner, mode):
    """Three aLoRA adapters (invocation mid-prompt, at the end, twice), a PreFT LoRA and the base
    model in one engine batch; each equals a float64 recompute, adapters matter, and the decode
    calls carry the bank exactly while an activated row decodes (mode "all": while any adapter does)."""
    eng = _engine(runner, mode)
    banked, plain = [], []

    def hook(call, run):
        if isinstance(call, DecodeCall):
            live = np.asarray(call.packed)[:, CHUNK] > 0
            (banked if call.bank is not None else plain).append(np.asarray(call.packed)[live, ADAPTER])
        return run(call)
    eng.step_runner.add_call_hook(hook)
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=NO_STOP)
    reqs = {k: eng.submit(p, None if k == "base" else k, sp) for k, p in prompts.items()}
    while eng.busy:
        eng.step()
    for k, req in reqs.items():
        toks = req.result.tokens
        assert len(toks) == 8 and _replay_ok(prompts[k], toks, None if k == "base" else k, mode), k
        if k != "base":
            assert not _replay_ok(prompts[k], toks, None), k                 # the adapter matters
    # activated: the adapter from the LAST occurrence, not from the first
    first = prompts["twice"].index(INV["twice"][0])
    p = prompts["twice"]
    assert p[first:first + 4] == list(INV["twice"]) and first < len(p) - 12
    # one decode batch mixes activated rows (their slot) with PreFT / base rows (slot 0: base weights)
    assert any((ids > 0).any() and (ids == 0).any() for ids in banked)
    # no row whose generated tokens use an adapter (PreFT + base; mode "all": base only): the plain
    # base program again
    n = len(banked)
    eng.generate([(prompts["preft"], "preft", sp)] * (mode == "prefill") + [(prompts["base"], None, sp)])
    assert len(banked) == n
    assert eng.registry.occupancy()["device_pinned"] == 0                    # every pin released


def test_decode_bank_only_with_activated_rows_and_native_fallback(runner):
    """PreFT + base decode: the base program (native where it serves); an activated row joining makes
    the batch's decode calls carry the bank (XLA) until it leaves."""
    eng = _engine(runner)
    seen = []

    def hook(call, run):
        if isinstance(call, DecodeCall):
            seen.append((call.bank is not None, call.native is not None))
        return run(call)
    eng.step_runner.add_call_hook(hook)
    prompts = _prompts()
    long = SamplingParams(max_new_tokens=40, stop_token_ids=NO_STOP)
    a = eng.submit(prompts["preft"], "preft", long)
    b = eng.submit(prompts["base"], None, long)
    for _ in range(2):
        eng.step()
    before = list(seen)
    c = eng.submit(prompts["end"], "end", SamplingParams(max_new_tokens=3, stop_token_ids=NO_STOP))
    while eng.busy:
        eng.step()
    assert before and not any(bank for bank, _ in before)
    banked = [i for i, (bank, _) in enumerate(seen) if bank]
    # c's tokens 2 and 3 (its first comes from its prefill): two consecutive calls with the bank, on XLA,
    # the first dispatched right behind c's prefill (async scheduling hands its first token over on the
    # device); every other call (before c decodes, after it is done) is the base program (native where it serves)
    assert len(banked) == 2 and banked[1] == banked[0] + 1 and banked[0] == len(before) and banked[1] < len(seen) - 1
    assert not any(native for bank, native in seen if bank)
    if CPU_DECODE == "native":
        assert all(native for bank, native in seen if not bank)
    for req, name in ((a, "preft"), (b, None), (c, "end")):
        assert _replay_ok(req.prompt_ids, req.result.tokens, name)


def test_prompt_without_invocation_is_refused(runner, tmp_path):
    eng = _engine(runner)
    ok = eng.submit(_prompts()["base"], None, SamplingParams(max_new_tokens=3, stop_token_ids=NO_STOP))
    bad = [50, 41, 40, 60]
    with pytest.raises(InvocationMissingError) as e:
        eng.submit(bad, "end", SamplingParams(max_new_tokens=3))
    msg = ("the prompt (4 tokens) does not contain the invocation sequence [40, 41] of the activated (aLoRA) "
           "adapter 'end'; an activated adapter acts from the last occurrence of its invocation sequence in the "
           "prompt, so the prompt must contain it")
    assert str(e.value) == msg and e.value.status == 400 and e.value.code == "invocation_missing"
    assert e.value.param == "prompt"
    assert eng.registry.in_use("end") == 0                                   # its reference was released
    with pytest.raises(InvocationMissingError):
        eng.generate([(bad, "end", SamplingParams(max_new_tokens=3))])
    assert eng.queued == 1                                                   # nothing queued by either
    while eng.busy:
        eng.step()
    assert ok.result.finish_reason == "length"
    # an adapter still loading when the request comes: refused when it has loaded, as a 400 event
    from preft_jax.adapters.peft_io import save_peft_lora
    save_peft_lora(tmp_path / "late", ALORA["end"], CFG)
    reg = AdapterRegistry(CFG, capacity=2, lora_rank=4, reft_rank=4, adapter_dir=tmp_path)
    eng2 = Engine(runner, reg, EngineConfig(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16,
                                            block_size=4, cpu_decode=CPU_DECODE))
    try:           # the loader thread may finish first: then submit itself refuses it
        req = eng2.submit(bad, "late", SamplingParams(max_new_tokens=3))
        while eng2.busy:
            eng2.step()
        err = req.error
    except InvocationMissingError as e:
        err = e
    assert err is not None and str(err) == msg.replace("'end'", "'late'")
    assert err.status == 400 and err.code == "invocation_missing"
    assert reg.in_use("late") == 0


def test_invocation_longer_than_the_bank_holds():
    reg = AdapterRegistry(CFG, capacity=2, lora_rank=4, max_invocation_tokens=3)
    with pytest.raises(AdapterFitError) as e:
        reg.load("long", ALORA["twice"])
    assert str(e.value) == ("cannot load adapter 'long': invocation sequence of 4 tokens does not fit the adapter "
                            "bank, which holds invocation sequences of up to 3 tokens (build it with "
                            "max_invocation_tokens >= 4) (the server's --lora-rank / --reft-rank / "
                            "--max-invocation-tokens size the adapter bank)")
    reg.load("short", ALORA["end"])
    assert reg.policies() == {"short": PositionPolicy.activated(INV["end"])}


def test_mode_prefill_keeps_activated_policy_and_lists_policies(runner):
    eng = _engine(runner, "all")
    pol = eng.registry.policies()
    assert pol["mid"] == PositionPolicy.activated(INV["mid"]) and pol["preft"] == PositionPolicy(mode="all")
    eng = _engine(runner, "prefill")
    pol = eng.registry.policies()
    assert pol["mid"] == PositionPolicy.activated(INV["mid"]) and pol["preft"] == PositionPolicy()
    assert pol["lastk"] == PositionPolicy(last_k=3)
    assert pol["end"].describe() == "activated from invocation [40, 41]"


def test_prefix_cache_base_blocks_shared_across_alora_adapters(runner):
    """A base conversation, then requests on two different aLoRA adapters (each appending its
    invocation), a PreFT last_k request and a base request continuing it: every block before each
    one's adapted positions is a hit on the base conversation's blocks; outputs equal a run
    without the prefix cache."""
    rng = np.random.default_rng(5)
    conv = rng.integers(10, CFG.vocab_size, 20).tolist()          # 5 full blocks of 4
    sp = SamplingParams(max_new_tokens=4, stop_token_ids=NO_STOP)
    follow = [(conv + [11] + list(INV["mid"]), "mid"), (conv + list(INV["end"]) + [12], "end"),
              (conv + [13, 14, 15], "lastk"), (conv + [16, 17], None), (conv + [18] + list(INV["mid"]), "mid"),
              (conv + [19, 20], "preft")]
    out = {}
    for prefix in (True, False):
        eng = _engine(runner, prefix=prefix)
        first = eng.generate([(conv, None, sp)])[0]
        hits = []
        res = []
        for p, name in follow:
            h0 = eng.pool.stats.hits
            res.append(eng.generate([(p, name, sp)])[0].tokens)
            hits.append(eng.pool.stats.hits - h0)
        out[prefix] = (first.tokens, res, hits)
    assert out[True][:2] == out[False][:2]
    # conv = 20 tokens = blocks 0-4. mid: start 21 -> blocks 0-4 base (5 hits); end: start 20 -> 5;
    # lastk (prompt 23, last 3 adapted: from 20) -> 5; base: 22 tokens, last token computed -> 5;
    # a second mid request: its own adapted block 5 is not shared (different token 18) -> 5;
    # a PreFT request adapting its whole prompt shares nothing -> 0
    assert out[True][2] == [5, 5, 5, 5, 5, 0] and out[False][2] == [0] * 6
    for (p, name), toks in zip(follow, out[True][1]):
        assert _replay_ok(p, toks, name)


def test_http_models_list_policies_and_missing_invocation_is_400(runner):
    httpx = pytest.importorskip("httpx")
    from serve.server import BackgroundServer, create_app

    class Tok:                                   # one token per latin-1 character
        eos_token_ids = (2,)

        def encode(self, text, add_bos=False):
            return list(text.encode("latin-1"))

        def decode(self, ids, skip_special_tokens=True):
            return bytes(int(i) for i in ids).decode("latin-1")
    eng = _engine(runner)
    with BackgroundServer(create_app(eng, Tok(), model_id="base")) as srv:
        models = {m["id"]: m for m in httpx.get(f"{srv.url}/v1/models").json()["data"]}
        assert "policy" not in models["base"]
        assert models["end"]["policy"] == "activated from invocation [40, 41]"
        assert models["end"]["position_policy"] == {"mode": "activated", "first_k": None, "last_k": None,
                                                   "invocation_tokens": [40, 41]}
        assert models["lastk"]["policy"] == "prefill (last_k=3)" and models["preft"]["policy"] == "prefill"
        assert httpx.get(f"{srv.url}/v1/models/mid").json()["policy"] == "activated from invocation [7, 8, 9]"
        body = {"model": "end", "prompt": [50, 41, 40, 60], "max_tokens": 2}
        res = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        assert res.status_code == 400
        assert res.json()["error"] == {
            "message": "the prompt (4 tokens) does not contain the invocation sequence [40, 41] of the activated "
                       "(aLoRA) adapter 'end'; an activated adapter acts from the last occurrence of its invocation "
                       "sequence in the prompt, so the prompt must contain it",
            "type": "invalid_request_error", "code": "invocation_missing", "param": "prompt"}
        ok = httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": [50, 40, 41, 60]}, timeout=120)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    eng.shutdown()


def test_prebuilt_bank_serves_activated_adapters(runner):
    """`AdapterRegistry.from_bank` (a bank built by `build_bank`): the aLoRA slot keeps its policy."""
    from preft_jax.adapters.bank import build_bank
    reg = AdapterRegistry.from_bank(CFG, build_bank(CFG, [ALORA["end"], PREFT]), ["end", "preft"])
    assert reg.policies() == {"end": PositionPolicy.activated(INV["end"]), "preft": PositionPolicy()}
    eng = Engine(runner, reg, EngineConfig(max_num_seqs=2, max_model_len=48, max_num_batched_tokens=32,
                                           block_size=4, cpu_decode=CPU_DECODE))
    p = _prompts()
    sp = SamplingParams(max_new_tokens=6, stop_token_ids=NO_STOP)
    out = eng.generate([(p["end"], "end", sp), (p["preft"], "preft", sp)])
    assert _replay_ok(p["end"], out[0].tokens, "end") and _replay_ok(p["preft"], out[1].tokens, "preft")


def test_prefix_blocks_computed_by_an_alora_request_are_base_blocks(runner):
    """The other direction: the first request on a conversation is an aLoRA one; its blocks before
    the activation start serve a PreFT last_k request, another aLoRA adapter and a base request."""
    conv = np.random.default_rng(6).integers(10, CFG.vocab_size, 16).tolist()      # 4 full blocks
    sp = SamplingParams(max_new_tokens=3, stop_token_ids=NO_STOP)
    follow = [(conv + list(INV["end"]) + [21], "end"), (conv + [22, 23, 24, 25], "lastk"),
              (conv + list(INV["mid"]), "mid"), (conv + [26], None)]
    hits, out = {}, {}
    for prefix in (True, False):
        eng = _engine(runner, prefix=prefix)
        hits[prefix], out[prefix] = [], []
        for p, name in follow:
            h0 = eng.pool.stats.hits
            out[prefix].append(eng.generate([(p, name, sp)])[0].tokens)
            hits[prefix].append(eng.pool.stats.hits - h0)
    assert hits[True] == [0, 4, 4, 4] and hits[False] == [0] * 4
    assert out[True] == out[False]
