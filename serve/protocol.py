"""OpenAI request bodies -> validated values. Every check raises `BadRequest` (HTTP 400) naming the
field, so nothing malformed reaches tokenization or the engine.

This module owns the body's shape (JSON types) and the OpenAI API's own limits (temperature <= 2,
prompts x n, stop sequences, ...). The values' rules are owned elsewhere and checked once there:
sampling fields by `SamplingParams` (a `SamplingError` becomes a 400 naming the body key here), and
what the engine can represent (vocabulary, context, `n` <= rows) by serve/validation.py at submit.

Fields the server cannot honour yet (`logit_bias`, `response_format` other than text, tools, `suffix`,
`best_of` other than `n`, penalties, and vLLM's extensions that change the output: `min_tokens`,
`min_p`, `repetition_penalty`, beam search, guided decoding, ... - `UNSUPPORTED`) are a 400 naming the
field when set to anything but their neutral value; unknown fields are ignored, as OpenAI does.
vLLM's `top_k`, `ignore_eos` and `stop_token_ids` are honoured.
"""
from __future__ import annotations

import copy
import json
import math
import re

from preft_jax.sampling import INT32_MAX, SamplingError, SamplingParams, shown
from serve.errors import RequestError

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")    # a chat message's `role` and `name` (OpenAI's rule for
                                                     # names): no room for a chat template's control tokens
MAX_PROMPTS = 64          # prompts in one /v1/completions request
MAX_CHOICES = 128         # prompts x n in one request
MAX_TEMPERATURE = 2.0     # the OpenAI API's range is [0, 2]
MAX_STOP_TOKEN_IDS = 64   # vLLM's `stop_token_ids` per request

# vLLM's sampling extensions this server does not implement: key -> (its neutral values, what a
# request sets it to without changing the output). Anything else is a 400 naming the key: silently
# ignoring a field that changes the output would hand the client another distribution than it asked for.
UNSUPPORTED = {
    "min_tokens": ((None, 0), "0"),
    "min_p": ((None, 0, 0.0), "0"),
    "repetition_penalty": ((None, 1, 1.0), "1"),
    "length_penalty": ((None, 1, 1.0), "1"),
    "use_beam_search": ((None, False), "false"),
    "include_stop_str_in_output": ((None, False), "false"),
    "skip_special_tokens": ((None, True), "true"),
    "prompt_logprobs": ((None,), "absent; /v1/completions gives prompt log-probabilities with 'echo' and "
                                 "'logprobs'"),
    "guided_json": ((None,), "absent"),
    "guided_regex": ((None,), "absent"),
    "guided_choice": ((None,), "absent"),
    "guided_grammar": ((None,), "absent"),
    "structured_outputs": ((None,), "absent"),
    "allowed_token_ids": ((None,), "absent"),
    "bad_words": ((None, []), "absent"),
    "logits_processors": ((None, []), "absent"),
    "truncate_prompt_tokens": ((None,), "absent"),
    "return_tokens_as_token_ids": ((None, False), "false"),
    "chat_template": ((None,), "absent; the model's own chat template is used"),
    "chat_template_kwargs": ((None, {}), "absent"),
}


class BadRequest(RequestError):
    """A malformed body or unsupported field (400)."""
    code = "invalid_request"


_MISSING = object()


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except ValueError as e:                      # e.g. integers of more than 4300 digits
        raise BadRequest(f"request body has a value that cannot be represented: {e}"[:300]) from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def text(value: str, field: str, max_chars: int | None = None) -> str:
    """A string that is valid Unicode (no lone surrogates) and not too long."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"'{field}' contains invalid Unicode (a lone surrogate)", field) from None
    if max_chars is not None and len(value) > max_chars:
        raise BadRequest(f"'{field}' is longer than {max_chars} characters", field)
    return value


def _type_name(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def get(body: dict, key: str, types, default=_MISSING):
    """body[key] checked against `types` (None/absent -> default; absent without default -> 400)."""
    v = body.get(key, None)
    if v is None:
        if default is _MISSING:
            raise BadRequest(f"'{key}' is a required field", key)
        return default
    wanted = types if isinstance(types, tuple) else (types,)
    if isinstance(v, bool) and bool not in wanted:
        raise BadRequest(f"'{key}' must be {_type_name(types)}, got a boolean", key)
    if not isinstance(v, wanted):
        raise BadRequest(f"'{key}' must be {_type_name(types)}, got {type(v).__name__}", key)
    if isinstance(v, str):
        text(v, key)
    return v


def number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = get(body, key, (int, float), default)
    if isinstance(v, int) and abs(v) > 1e300:
        raise BadRequest(f"'{key}' is out of range", key)
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise BadRequest(f"'{key}' must be a finite number in {interval}, got {v}", key)
    return v


# SamplingParams field -> its body key, per endpoint (a SamplingError names the key the client sent)
_COMPLETION_KEYS = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}
_CHAT_KEYS = {"logprobs": "top_logprobs"}


def integer(body: dict, key: str, default: int | None, lo: int, hi: int = INT32_MAX) -> int | None:
    v = get(body, key, int, default)
    if v is not None and not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be an integer in [{lo}, {hi}], got {v if abs(v) < 10**30 else 'a huge value'}",
                         key)
    return v


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise BadRequest(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", "stop")
    return tuple(text(s, "stop", MAX_STOP_CHARS) for s in stop)


def stop_token_ids(body: dict) -> tuple[int, ...]:
    """vLLM's `stop_token_ids`: a list of token ids (non-negative; serve/validation.py checks them
    against the vocabulary) that end a choice like EOS does (the id is not part of the output)."""
    ids = get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in ids):
        raise BadRequest("'stop_token_ids' must be a list of non-negative integer token ids", "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    return tuple(ids)


def sampling(body: dict, max_tokens: int, stop_ids: tuple[int, ...], logprobs: int | None = None,
             prompt_logprobs: int | None = None, chat: bool = False) -> SamplingParams:
    """The body's sampling fields as SamplingParams (which checks their values). `stop_ids`: the
    model's EOS ids, which vLLM's `ignore_eos` drops and its `stop_token_ids` adds to. `chat`: the
    body is a chat completion's (its errors name its keys)."""
    temperature = get(body, "temperature", (int, float), 1.0)
    if temperature > MAX_TEMPERATURE:
        raise BadRequest(f"'temperature' must be at most {MAX_TEMPERATURE:g} (the OpenAI API's range), got "
                         f"{shown(temperature)}", "temperature")
    top_k = get(body, "top_k", int, 0)
    if top_k < -1:
        raise BadRequest(f"'top_k' must be -1 or 0 (off) or a positive integer, got {shown(top_k)}", "top_k")
    if get(body, "ignore_eos", bool, False):     # vLLM's extension: the model's EOS ids do not stop it
        stop_ids = ()
    stop_ids = tuple(dict.fromkeys(stop_ids + stop_token_ids(body))) or (-1,)     # (-1,): nothing stops it
    try:
        return SamplingParams(temperature=temperature, top_p=get(body, "top_p", (int, float), 1.0),
                              top_k=0 if top_k == -1 else top_k,              # -1 or 0: off (vLLM uses -1)
                              max_new_tokens=max_tokens, stop_token_ids=stop_ids, seed=body.get("seed"),
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except SamplingError as e:
        keys = dict(_CHAT_KEYS, max_new_tokens=max_tokens_key(body)) if chat else _COMPLETION_KEYS
        key = keys.get(e.field, e.field)
        raise BadRequest(f"'{key}' {e.requirement}", key) from None


def n_choices(body: dict, prompts: int = 1) -> int:
    """`n`, with prompts x n <= MAX_CHOICES (the engine checks n against its rows at submit)."""
    n = get(body, "n", int, 1)
    if prompts * n > MAX_CHOICES:
        raise BadRequest(f"{prompts} prompt(s) x n={shown(n)} is {shown(prompts * n)} choices; at most "
                         f"{MAX_CHOICES} per request", "n")
    best_of = integer(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise BadRequest(f"'best_of' is not supported (absent or equal to n={n})", "best_of")
    return n


def chat_logprobs(body: dict) -> int | None:
    """`logprobs: true` [+ `top_logprobs: k`] -> k (0 without top_logprobs); None when off."""
    on = get(body, "logprobs", bool, False)
    top = get(body, "top_logprobs", int, None)
    if top and not on:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def completion_logprobs(body: dict) -> int | None:
    """Legacy `logprobs: k` (an integer; SamplingParams takes [0, MAX_TOP_LOGPROBS]) -> k; None when absent."""
    if "top_logprobs" in body and body["top_logprobs"] is not None:
        raise BadRequest("'top_logprobs' is a chat field; /v1/completions takes 'logprobs': <integer>",
                         "top_logprobs")
    return get(body, "logprobs", int, None)


def common_checks(body: dict) -> None:
    """Fields shared by both endpoints that are validated or refused (400) but not otherwise used."""
    for key in ("presence_penalty", "frequency_penalty"):
        if number(body, key, 0.0, -2.0, 2.0) != 0:
            raise BadRequest(f"'{key}' is not supported (must be 0 or absent)", key)
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not supported", "logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequest("'response_format' is not supported (only {\"type\": \"text\"})", "response_format")
    if body.get("tools") or body.get("functions"):
        raise BadRequest("tool / function calling is not supported", "tools")
    if body.get("tool_choice") not in (None, "none"):
        raise BadRequest("'tool_choice' is not supported", "tool_choice")
    integer(body, "seed", None, -(2 ** 63), 2 ** 64 - 1)      # per request: same seed, same output
    get(body, "user", str, "")
    stream = get(body, "stream", bool, False)
    so = get(body, "stream_options", dict, None)
    if so is not None and not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    so = so or {}
    for key in ("include_usage", "continuous_usage_stats"):
        if key in so and not isinstance(so[key], bool):
            raise BadRequest(f"'stream_options.{key}' must be a boolean", "stream_options")
    if so.get("continuous_usage_stats"):
        raise BadRequest("'stream_options.continuous_usage_stats' is not supported", "stream_options")
    for key, (neutral, what) in UNSUPPORTED.items():
        v = body.get(key)
        if not any(_same_value(v, x) for x in neutral):
            raise BadRequest(f"'{key}' is not supported (must be {what})", key)


def _same_value(v, x) -> bool:
    """v == x as JSON values: 0 and 0.0 are the same number, a boolean is not a number."""
    if isinstance(v, (int, float)) and isinstance(x, (int, float)):
        return isinstance(v, bool) == isinstance(x, bool) and v == x
    return type(v) is type(x) and v == x


def max_tokens(body: dict, keys: tuple[str, ...], default: int, prompt_len: int, max_len: int) -> int:
    for key in keys:
        v = get(body, key, int, None)
        if v is not None:
            return v               # SamplingParams checks it; the engine refuses prompt + max_tokens > context
    return max(1, min(default, max_len - prompt_len - 1))


def max_tokens_key(body: dict) -> str:
    """The chat body's key of the token limit: max_completion_tokens when given, else max_tokens."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def in_body_words(e: RequestError, words: dict[str, tuple[str, str]]) -> RequestError:
    """The engine's refusal `e` in the words of the body the client sent (`words`: the engine's field
    -> (the body's key, what the message calls it); a chat body has no 'prompt' but 'messages'): a
    copy of `e` (class, status, code and any state kept) with its param renamed and the engine's own
    phrases in its message ("prompt has", "prompt of", "max_tokens=") rewritten - never a word of
    text the client chose (an adapter's name). `e` itself when its param is none of them."""
    if e.param not in words:
        return e
    message = str(e)
    for engine_word, (_, phrase) in words.items():
        message = re.sub(rf"^{re.escape(engine_word)}(?= has | of )", phrase, message)
        message = re.sub(rf"\({re.escape(engine_word)} \+ ", f"({phrase} + ", message)
        message = re.sub(rf"\b{re.escape(engine_word)}=", f"{phrase}=", message)
    out = copy.copy(e)
    out.args, out.param = (message,), words[e.param][0]
    return out


def completion_prompts(body: dict) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a list of those (at most MAX_PROMPTS); deeper
    nesting ([[[ids]]], [["text"]]) is refused, as OpenAI and vLLM do."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"'prompt' takes at most {MAX_PROMPTS} prompts per request", "prompt")
        return [_one_prompt(p) for p in prompt]
    return [_one_prompt(prompt)]


def _one_prompt(prompt) -> str | list[int]:
    """A string, or a list of token ids (ids range-checked by serve/validation.py)."""
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
        return text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if prompt is None:
        raise BadRequest("'prompt' is a required field", "prompt")
    raise BadRequest("'prompt' must be a non-empty string, a non-empty list of token ids, or a list of "
                     "those", "prompt")


def chat_messages(body: dict) -> list[dict]:
    """`messages`: each {"role", "content"} (content a string, a list of text parts, or null on an
    assistant turn), with its optional `name` handed to the chat template as transformers does."""
    messages = get(body, "messages", list)
    if not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        role = m["role"]
        if not NAME_PATTERN.fullmatch(role):
            raise BadRequest(f"messages[{i}].role must be 1-64 letters, digits, '_' or '-', got {role[:80]!r}",
                             "messages")
        content = m.get("content")
        if isinstance(content, list):      # [{"type": "text", "text": ...}, ...]
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise BadRequest(f"messages[{i}].content[{j}]: only text parts are supported, got "
                                     f"{str(kind)[:64]!r}", "messages")
                if not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content[{j}].text must be a string", "messages")
            content = "".join(p["text"] for p in content)
        if content is None and role == "assistant":     # an assistant turn that only called tools
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        msg = {"role": role, "content": text(content, f"messages[{i}].content")}
        if m.get("name") not in (None, ""):            # an empty name: as absent (some clients send one)
            name = m["name"]
            if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
                raise BadRequest(f"messages[{i}].name must be 1-64 letters, digits, '_' or '-'", "messages")
            msg["name"] = name
        out.append(msg)
    return out
