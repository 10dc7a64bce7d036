"""How the server turns a request's prompt into ids and echoes it, against an independent reference
(the tokenizer's own encode and ModelRunner.generate on those ids): a text prompt gets the BOS HF's
tokenizer(text) gives it (vLLM's `add_special_tokens`, default true on /v1/completions); an echoed
prompt's text and `text_offset` hold its special tokens; chat's `add_generation_prompt` and
`continue_final_message`; prompt shapes and template fields the server refuses by name."""
from __future__ import annotations

import os

import httpx
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from preft_jax.config import tiny_config  # noqa: E402
from preft_jax.generation import ModelRunner  # noqa: E402
from preft_jax.model import Llama  # noqa: E402
from preft_jax.sampling import SamplingParams  # noqa: E402
from reference_llama import random_params  # noqa: E402
from serve.byte_tokenizer import ByteTokenizer  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.registry import AdapterRegistry  # noqa: E402
from serve.server import BackgroundServer, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

BASE = "tiny-base"
BOS, EOS = 1, 2


class BosTokenizer(ByteTokenizer):
    """The byte tokenizer of a family whose text prompts start with BOS (Llama-3's, as HF's tokenizer(text))."""
    add_bos_default = True


@pytest.fixture(scope="module")
def stack():
    cfg = tiny_config()
    runner = ModelRunner(Llama.from_params(cfg, random_params(cfg, seed=4)))
    tok = BosTokenizer(bos_token_id=BOS, eos_token_ids=(EOS,))
    engine = Engine(runner, AdapterRegistry(cfg, 2, lora_rank=4, reft_rank=4),
                    EngineConfig(max_num_seqs=4, max_model_len=64, max_prefill_seqs=2, max_num_batched_tokens=32,
                                 block_size=8), tok)
    server = BackgroundServer(create_app(engine, tok, model_id=BASE)).start()
    yield dict(runner=runner, tok=tok, url=server.url)
    server.stop()
    engine.shutdown()


def _reference(stack, ids, n):
    gen = stack["runner"].generate([ids], SamplingParams(max_new_tokens=n, stop_token_ids=(EOS,)))[0]
    return stack["tok"].decode(gen.tokens)


def _post(stack, path, body):
    return httpx.post(f"{stack['url']}{path}", json={"model": BASE, **body}, timeout=120)


def test_text_prompt_gets_the_tokenizers_bos(stack):
    r = _post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == 3                               # BOS + 2 bytes
    assert r["choices"][0]["text"] == _reference(stack, [BOS, 104, 105], 6)
    r = _post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "temperature": 0,
                                          "add_special_tokens": False}).json()
    assert r["usage"]["prompt_tokens"] == 2
    assert r["choices"][0]["text"] == _reference(stack, [104, 105], 6)
    r = _post(stack, "/v1/completions", {"prompt": [104, 105], "max_tokens": 6, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == 2                               # token ids are taken as given
    r = _post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                               "add_special_tokens": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"


def test_echo_text_and_offsets_hold_the_prompts_special_tokens(stack):
    # a text prompt: echoed as sent; the added BOS is at offset 0 and takes no text
    r = _post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0, "echo": True,
                                          "logprobs": 1}).json()["choices"][0]
    gen = _reference(stack, [BOS, 104, 105], 3)
    assert r["text"] == "hi" + gen
    assert r["logprobs"]["tokens"][:3] == ["\x01", "h", "i"]
    assert r["logprobs"]["text_offset"][:3] == [0, 0, 1]
    assert r["logprobs"]["text_offset"][3] == 2 and len(r["logprobs"]["tokens"]) == 6
    # token ids with a special token inside: echoed with it (vLLM), offsets into that text
    r = _post(stack, "/v1/completions", {"prompt": [104, BOS, 105], "max_tokens": 2, "temperature": 0,
                                          "echo": True, "logprobs": 0}).json()["choices"][0]
    assert r["text"] == "h\x01i" + _reference(stack, [104, BOS, 105], 2)
    assert r["logprobs"]["text_offset"][:4] == [0, 1, 2, 3]
    # score only (max_tokens 0): the same echo
    r = _post(stack, "/v1/completions", {"prompt": [104, BOS, 105], "max_tokens": 0, "echo": True,
                                          "logprobs": 0}).json()["choices"][0]
    assert r["text"] == "h\x01i" and r["logprobs"]["text_offset"] == [0, 1, 2]


def test_chat_generation_prompt_and_continue_final_message(stack):
    tok = stack["tok"]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}]
    body = {"messages": msgs, "max_tokens": 5, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    r = _post(stack, "/v1/chat/completions", body).json()
    assert r["choices"][0]["message"]["content"] == _reference(stack, tok.encode("<user>hi\n<assistant>ab"), 5)
    r = _post(stack, "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 5, "temperature": 0,
                                               "add_generation_prompt": False}).json()
    assert r["choices"][0]["message"]["content"] == _reference(stack, tok.encode("<user>hi\n"), 5)
    r = _post(stack, "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 5, "temperature": 0}).json()
    assert r["choices"][0]["message"]["content"] == _reference(stack, tok.encode("<user>hi\n<assistant>"), 5)
    for bad, words in (({"continue_final_message": True}, "needs 'add_generation_prompt': false"),
                       ({"continue_final_message": True, "add_generation_prompt": False, "messages": msgs[:1]},
                        "needs the last message to be an assistant turn, got role 'user'")):
        r = _post(stack, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **bad})
        assert r.status_code == 400 and words in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": [[[104, 105]]]}, "prompt", "'prompt' must be a non-empty string, a non-empty list of token ids, or a list of those"),
    ({"prompt": [["hi"]]}, "prompt", "a list of those"),
    ({"prompt": "hi", "chat_template": "{{ messages }}"}, "chat_template", "'chat_template' is not supported"),
    ({"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs", "not supported"),
    ({"prompt": "hi", "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", "(must be false)"),
    ({"prompt": "hi", "min_tokens": True}, "min_tokens", "(must be 0)"),
])
def test_refused_prompt_shapes_and_fields(stack, body, param, words):
    r = _post(stack, "/v1/completions", {"max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert words in r.json()["error"]["message"]


def test_neutral_values_are_numbers_not_types(stack):
    for extra in ({"min_tokens": 0.0}, {"repetition_penalty": 1}, {"min_p": 0}, {"chat_template_kwargs": {}}):
        r = _post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0, **extra})
        assert r.status_code == 200, (extra, r.text)
