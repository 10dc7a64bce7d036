"""OpenAI API features through the `openai` client against a real server process (`python -m serve
server --model tiny`): n > 1, seed, logprobs / top_logprobs (chat) and logprobs (legacy), echo, a
list of prompts, streaming == non-streaming. Log-probabilities are checked against an independent
reference: the tiny model's dense forward run here (preft_jax, not the server's paged engine) and a
float64 log_softmax of its raw logits."""
from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from preft_jax.config import tiny_config  # noqa: E402
from preft_jax.generation import ModelRunner, sequence_logits  # noqa: E402
from preft_jax.model import Llama  # noqa: E402
from serve.byte_tokenizer import ByteTokenizer  # noqa: E402
from serve.tiny_model import tiny_params  # noqa: E402
from test_server_faults import Server  # noqa: E402

CFG = tiny_config(max_seq_len=1024)          # what `--model tiny` builds
TOK = ByteTokenizer()
MSGS = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(["--max-num-seqs", "4", "--max-model-len", "128", "--max-prefill-seqs", "2",
                  "--max-num-batched-tokens", "32", "--block-size", "8", "--no-warmup"],
                 tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference():
    runner = ModelRunner(Llama.from_params(CFG, tiny_params(CFG)))

    def log_softmax(ids: list[int]) -> np.ndarray:
        """float64 log_softmax of the dense forward's raw logits; row t predicts ids[t + 1]."""
        logits = sequence_logits(runner.graphdef, runner.state, jnp.asarray([ids], jnp.int32),
                                 jnp.asarray([len(ids)]))
        x = np.asarray(logits[0], np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    return log_softmax


def _legacy_id(token: str) -> int:
    """ByteTokenizer: one byte per token; 'bytes:\\xNN' when it is not UTF-8 by itself."""
    if token.startswith("bytes:"):
        return int(token[len("bytes:\\x"):], 16)
    b = token.encode("utf-8")
    assert len(b) == 1, token
    return b[0]


@pytest.mark.slow
def test_n_with_seed_is_reproducible_and_independent_of_batch_mates(client):
    kw = dict(model="tiny", prompt="the quick brown fox", max_tokens=10, temperature=1.0, n=3, seed=1234)
    first = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1                                     # n different samples
    assert first.usage.prompt_tokens == len("the quick brown fox")  # the prompt counted once
    # the same seed while other requests run: the same outputs
    noise = threading.Thread(target=lambda: client.completions.create(model="tiny", prompt="zzz", max_tokens=40,
                                                                      temperature=0.9, n=2))
    noise.start()
    again = client.completions.create(**kw)
    noise.join()
    assert [c.text for c in again.choices] == texts
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in other.choices] != texts
    chat = [client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=1.0, n=2, seed=7)
            for _ in range(2)]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]


def test_greedy_n_gives_identical_choices(client):
    one = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0).choices[0].text
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0, n=3)
    assert [c.text for c in r.choices] == [one] * 3
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0, n=2)
    assert r.choices[0].message.content == r.choices[1].message.content


@pytest.mark.slow
def test_chat_logprobs_equal_the_model_log_softmax(client, reference):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=1.3, n=2, seed=4,
                                       logprobs=True, top_logprobs=5)
    prompt = TOK.encode_chat(MSGS)
    for choice in r.choices:
        content = choice.logprobs.content
        ids = [e.bytes[0] for e in content]
        assert ids and all(len(e.bytes) == 1 for e in content)
        ref = reference(prompt + ids)
        for i, e in enumerate(content):
            row = ref[len(prompt) - 1 + i]
            assert abs(e.logprob - row[ids[i]]) < 2e-4            # raw logits, not temperature-scaled
            assert [t.bytes[0] for t in e.top_logprobs] == np.argsort(-row)[:5].tolist()
            np.testing.assert_allclose([t.logprob for t in e.top_logprobs], np.sort(row)[::-1][:5], atol=2e-4)
    no = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, temperature=0, logprobs=True)
    assert no.choices[0].logprobs.content[0].top_logprobs == []


@pytest.mark.slow
def test_legacy_logprobs_with_echo_equal_the_model_log_softmax(client, reference):
    prompt = "hello world"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.9, seed=1, echo=True,
                                  logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(prompt)
    ids = [_legacy_id(t) for t in lp.tokens]
    assert ids[:len(prompt)] == TOK.encode(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None     # nothing predicts the first token
    ref = reference(ids)
    for i in range(1, len(ids)):
        row = ref[i - 1]
        assert abs(lp.token_logprobs[i] - row[ids[i]]) < 2e-4, i
        top = sorted(lp.top_logprobs[i].items(), key=lambda kv: -kv[1])
        assert [_legacy_id(t) for t, _ in top] == np.argsort(-row)[:3].tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:3], atol=2e-4)
    assert lp.text_offset[:len(prompt)] == list(range(len(prompt)))
    assert lp.text_offset[len(prompt)] == len(prompt) and lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.9, seed=1, logprobs=3)
    assert c.text == prompt + plain.choices[0].text                # echo: the prompt prepended, same sample
    np.testing.assert_allclose(plain.choices[0].logprobs.token_logprobs, lp.token_logprobs[len(prompt):],
                               atol=1e-5)                       # another compiled variant: float32 noise
    assert plain.choices[0].logprobs.text_offset[0] == 0
    echo_only = client.completions.create(model="tiny", prompt=[104, 105], max_tokens=2, temperature=0, echo=True)
    assert echo_only.choices[0].text.startswith("hi") and echo_only.choices[0].logprobs is None


def test_a_list_of_prompts_equals_individual_requests(client):
    prompts = ["hello", "abc def", [104, 105, 33]]
    kw = dict(model="tiny", max_tokens=6, temperature=1.0, n=2, seed=9)
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    for i, a in enumerate(alone):
        for j in range(2):
            assert r.choices[i * 2 + j].text == a.choices[j].text
            assert r.choices[i * 2 + j].finish_reason == a.choices[j].finish_reason
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


@pytest.mark.slow
def test_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", prompt=["one two", "three"], max_tokens=8, temperature=1.1, n=2, seed=21, echo=True,
              logprobs=2)
    full = client.completions.create(**kw)
    texts, lps, offsets, finish = {}, {}, {}, {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for c in full.choices:
        assert texts[c.index] == c.text and finish[c.index] == c.finish_reason
        assert lps[c.index] == c.logprobs.token_logprobs and offsets[c.index] == c.logprobs.text_offset
    kw = dict(model="tiny", messages=MSGS, max_tokens=8, temperature=1.1, n=2, seed=5, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kw)
    texts, lps, finish = {}, {}, {}
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if not ch.choices:
            assert ch.usage.total_tokens == full.usage.total_tokens
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend((e.bytes, e.logprob) for e in c.logprobs.content)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for c in full.choices:
        assert texts[c.index] == c.message.content and finish[c.index] == c.finish_reason
        assert lps[c.index] == [(e.bytes, e.logprob) for e in c.logprobs.content]


def test_bad_combinations_are_clear_400s(client):
    for kw, param in [(dict(n=5), "n"), (dict(logprobs=21), "logprobs"), (dict(n=2, best_of=3), "best_of")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, **kw)
        assert e.value.body["param"] == param and e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, top_logprobs=2)
    assert "logprobs" in e.value.body["message"]
