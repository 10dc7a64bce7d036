"""OpenAI-compatible server over the Engine: a tiny random model, a byte tokenizer, real HTTP on loopback."""
from __future__ import annotations

import json
import os
import threading

import httpx
import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
openai = pytest.importorskip("openai")

from adapter_factory import random_lora, random_reft  # noqa: E402
from preft_jax.adapters.bank import build_bank  # noqa: E402
from preft_jax.adapters.peft_io import save_peft_lora  # noqa: E402
from preft_jax.config import tiny_config  # noqa: E402
from preft_jax.generation import ModelRunner  # noqa: E402
from preft_jax.model import Llama  # noqa: E402
from preft_jax.sampling import SamplingParams  # noqa: E402
from reference_llama import random_params  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.registry import AdapterRegistry  # noqa: E402
from serve.server import BackgroundServer, ServerConfig, create_app  # noqa: E402

BASE = "tiny-base"
EOS = 2
ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class ByteTokenizer:
    """One token per latin-1 character (vocab 256, eos 2): text <-> tokens is a bijection."""
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return list(text.encode("latin-1", errors="replace"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids).decode("latin-1")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **_) -> str:
        text = "".join(f"{m['role'][0].upper()}:{m['content']}\n" for m in messages)
        return text + ("A:" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = tiny_config()
    runner = ModelRunner(Llama.from_params(cfg, random_params(cfg)))
    registry = AdapterRegistry(cfg, 4, lora_rank=4, reft_rank=4)
    adapters = {"lora-a": random_lora(cfg, 1), "reft-b": random_reft(cfg, 2), "lora-c": random_lora(cfg, 3)}
    registry.load("lora-a", adapters["lora-a"])
    registry.load("reft-b", adapters["reft-b"])
    folder = tmp_path_factory.mktemp("adapters") / "lora-c"
    save_peft_lora(folder, adapters["lora-c"], cfg)
    tok = ByteTokenizer()
    engine = Engine(runner, registry, EngineConfig(max_num_seqs=4, max_model_len=64, max_prefill_seqs=2, max_num_batched_tokens=32, block_size=8), tok)
    app = create_app(engine, tok, model_id=BASE,
                     config=ServerConfig(admin_key=ADMIN_KEY, adapter_root=str(folder.parent)))
    server = BackgroundServer(app).start()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    yield dict(cfg=cfg, runner=runner, adapters=adapters, folder=str(folder), tok=tok, server=server,
               client=client, url=server.url, engine=engine)
    server.stop()
    engine.shutdown()


def reference(stack, prompt_ids, adapter, max_tokens):
    """Independent greedy reference: ModelRunner.generate with a one-adapter bank (or none)."""
    sp = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(EOS,))
    if adapter is None:
        gen = stack["runner"].generate([prompt_ids], sp)[0]
    else:
        bank = build_bank(stack["cfg"], [stack["adapters"][adapter]])
        gen = stack["runner"].generate([prompt_ids], sp, bank=bank, adapter_ids=[1])[0]
    return stack["tok"].decode(gen.tokens), gen.finish_reason


PROMPT = "hello world"


@pytest.mark.slow
def test_completion_matches_reference_and_stream(stack):
    c = stack["client"]
    outs = {}
    for model in (BASE, "lora-a", "reft-b"):
        r = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        text, finish = reference(stack, stack["tok"].encode(PROMPT), None if model == BASE else model, 8)
        assert r.choices[0].text == text and r.choices[0].finish_reason == finish
        assert r.object == "text_completion" and r.model == model and r.id
        assert r.usage.prompt_tokens == len(PROMPT)
        counted = len(text) + (finish == "stop")          # a stop token is generated and counted (OpenAI, vLLM)
        assert r.usage.completion_tokens == counted
        assert r.usage.total_tokens == len(PROMPT) + counted
        chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == text
        assert chunks[-1].choices[0].finish_reason == finish
        outs[model] = text
    assert outs["lora-a"] != outs[BASE] and outs["reft-b"] != outs[BASE]
    # token-id prompt == the same string prompt
    r = c.completions.create(model="lora-a", prompt=stack["tok"].encode(PROMPT), max_tokens=8, temperature=0)
    assert r.choices[0].text == outs["lora-a"]


def test_chat_completion_and_stream(stack):
    c = stack["client"]
    msgs = [{"role": "user", "content": "hi"}]
    prompt_ids = stack["tok"].encode(stack["tok"].apply_chat_template(msgs))
    r = c.chat.completions.create(model="reft-b", messages=msgs, max_tokens=6, temperature=0)
    text, finish = reference(stack, prompt_ids, "reft-b", 6)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish and r.usage.prompt_tokens == len(prompt_ids)
    chunks = list(c.chat.completions.create(model="reft-b", messages=msgs, max_tokens=6, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_stop_string(stack):
    c = stack["client"]
    full = c.completions.create(model=BASE, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    stop = full[3:5]
    r = c.completions.create(model=BASE, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"


def test_models_lists_adapters(stack):
    ids = [m.id for m in stack["client"].models.list().data]
    assert ids[0] == BASE and {"lora-a", "reft-b"} <= set(ids)


def test_runtime_adapter_load_use_unload(stack):
    url, c = stack["url"], stack["client"]
    denied = httpx.post(f"{url}/v1/adapters", json={"name": "lora-c", "path": "lora-c"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/v1/adapters", json={"name": "lora-c", "path": "lora-c"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["kind"] == "lora"
    assert "lora-c" in [m.id for m in c.models.list().data]
    dup = httpx.post(f"{url}/v1/adapters", json={"name": "lora-c", "path": stack["folder"]}, headers=ADMIN)
    assert dup.status_code == 409 and "already loaded" in dup.json()["error"]["message"]
    out = c.completions.create(model="lora-c", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert out == reference(stack, stack["tok"].encode(PROMPT), "lora-c", 8)[0]
    assert httpx.delete(f"{url}/v1/adapters/lora-c").status_code == 401
    assert httpx.delete(f"{url}/v1/adapters/lora-c", headers=ADMIN).status_code == 200
    assert "lora-c" not in [m.id for m in c.models.list().data]
    gone = httpx.delete(f"{url}/v1/adapters/lora-c", headers=ADMIN)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(f"{url}/v1/adapters", json={"name": "bad", "path": "lora-c-missing"}, headers=ADMIN)
    assert bad.status_code == 400 and "bad" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/adapters", json={"name": "x"}, headers=ADMIN).status_code == 400


def test_request_errors(stack):
    url, c = stack["url"], stack["client"]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=BASE, prompt="x" * 100, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "y" * 100}], stream=True)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=BASE, prompt=PROMPT, n=5)        # > max_num_seqs (4)
    r = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny-base", "prompt": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    for body in ({"prompt": "x"}, {"model": BASE, "prompt": 5}, {"model": BASE, "prompt": "x", "max_tokens": "3"},
                 {"model": BASE, "prompt": "x", "temperature": -1}, {"model": BASE, "prompt": [1, 999]},
                 [1, 2], {"model": BASE, "messages": "hi"}):
        path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)
    assert httpx.get(f"{url}/v1/nothing").status_code == 404


def _stream_text(url, body) -> str:
    out = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(out)


def test_failures_do_not_affect_running_requests(stack):
    url = stack["url"]
    body = {"model": "lora-a", "prompt": [5, 6, 7, 8], "max_tokens": 40, "temperature": 0}
    alone = _stream_text(url, body)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("text", _stream_text(url, body)))
    t.start()
    bad = [({"model": "nope", "prompt": "x"}, 404), ({"model": BASE, "prompt": "z" * 80}, 400),
           ({"model": BASE, "prompt": "x", "n": 5}, 400), ({"model": BASE, "prompt": [300]}, 400)]
    for _ in range(3):
        for b, status in bad:
            assert httpx.post(f"{url}/v1/completions", json=b).status_code == status
        assert httpx.post(f"{url}/v1/completions", content=b"{nope").status_code == 400
    ok = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "abc", "max_tokens": 3,
                                                   "temperature": 0}, timeout=120)
    assert ok.status_code == 200
    t.join(timeout=120)
    assert result["text"] == alone
    assert "lora-a" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]


@pytest.mark.slow
@pytest.mark.real_model
def _samples(text: str) -> dict:
    """{(sample name, sorted labels): value} of a Prometheus text scrape, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_and_health_words_and_per_app_registry(stack):
    from prometheus_client import REGISTRY
    eng = stack["engine"]
    r = stack["client"].completions.create(model="lora-a", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason
    for _ in range(500):                                   # the engine is idle: its counters are still
        if eng.health()["running"] == 0 and eng.health()["queued"] == 0:
            break
        threading.Event().wait(0.01)
    resp = httpx.get(f"{stack['url']}/metrics")
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    got = _samples(resp.text)
    m, occ = eng.metrics, eng.registry.occupancy()
    assert got[("preft_generated_tokens_total", ())] == m.generated_tokens > 0
    assert got[("preft_prompt_tokens_total", ())] == m.prompt_tokens > 0
    for reason, n in m.requests_finished.items():
        assert got[("preft_requests_finished_total", (("reason", reason),))] == n
    assert got[("preft_decode_rows", ())] == eng.config.max_num_seqs == 4
    assert got[("preft_adapter_slots", ())] == occ["device_slots"] == 4
    assert got[("preft_adapter_slots_resident", ())] == occ["device_resident"] >= 1
    assert got[("preft_kv_blocks", ())] == eng.pool.capacity
    assert got[("preft_http_responses_total", (("code", "200"), ("path", "/v1/completions")))] >= 1
    ttft = got[("preft_time_to_first_token_seconds_count", ())]
    assert ttft >= 1 and got[("preft_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == ttft
    assert not any(name in ("preft_slots", "preft_device_adapter_slots") for name, _ in got)
    h = httpx.get(f"{stack['url']}/health").json()
    assert h["decode_rows"] == 4 and h["adapter_slots"] == 4 and "slots" not in h
    # a second app on the same engine has its own registry: engine state shared, HTTP counts not
    other = _samples(create_app(eng, stack["tok"], model_id=BASE).state.api.metrics.exposition(None)[0].decode())
    assert other[("preft_generated_tokens_total", ())] == m.generated_tokens
    assert not any(name == "preft_http_responses_total" for name, _ in other)
    assert not any(name.startswith("preft_") for name in REGISTRY._names_to_collectors)   # never the global one


@pytest.mark.slow
def test_real_model_chat_and_completion(default_model):
    """SmolLM2-135M + its real tokenizer behind the server: greedy chat == ModelRunner.generate alone."""
    cfg, params, tok = default_model
    runner = ModelRunner(Llama.from_params(cfg, params))
    engine = Engine(runner, AdapterRegistry(cfg, 0), EngineConfig(max_num_seqs=2, max_model_len=128, max_prefill_seqs=2), tok)
    with BackgroundServer(create_app(engine, tok, model_id="smollm2")) as srv:
        try:
            c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
            msgs = [{"role": "user", "content": "What is the capital of France?"}]
            r = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12, temperature=0)
            ids = tok.encode_chat(msgs)
            want = runner.generate([ids], SamplingParams(max_new_tokens=12, stop_token_ids=tuple(tok.eos_token_ids)))[0]
            assert r.choices[0].message.content == tok.decode(want.tokens) and "Paris" in r.choices[0].message.content
            assert r.usage.prompt_tokens == len(ids)
            assert r.usage.completion_tokens == len(want.tokens) + (r.choices[0].finish_reason == "stop")
            chunks = list(c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12, temperature=0,
                                                    stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
            cut = c.completions.create(model="smollm2", prompt=tok.apply_chat_template(msgs), max_tokens=12,
                                       temperature=0, stop=["Paris"])
            text = r.choices[0].message.content
            assert cut.choices[0].text == text[:text.index("Paris")] and cut.choices[0].finish_reason == "stop"
        finally:
            engine.shutdown()
