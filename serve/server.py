"""OpenAI-compatible HTTP server over the continuous-batching Engine.

    app = create_app(engine, tokenizer, model_id="smollm2-135m-instruct")   # starts the engine
    serve_forever(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as SSE),
GET /v1/models, GET /v1/models/{id}, POST /v1/adapters, DELETE /v1/adapters/{name}, GET /health.
`model` is an adapter name (PreFT adapter applied at prefill) or `model_id` (the base model).

Bodies are parsed and validated here (not by pydantic), so every malformed body — bad JSON, wrong
types, missing fields — is a 400 with an OpenAI-style error body {"error": {message, type, code}}.
Request errors are raised at submit time, before a response (streamed or not) starts, so a bad
request never touches the engine's running requests.
"""
from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from typing import Any, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from preft_jax.sampling import SamplingParams
from serve.errors import RequestError, UnknownAdapterError

DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16


class BadRequest(RequestError):
    """A malformed body or unsupported field (400)."""
    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class AdapterExistsError(RequestError):
    status = 409
    code = "adapter_exists"


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    etype = ("invalid_request_error" if status < 500 else "server_error")
    if status == 404:
        etype = "not_found_error"
    return JSONResponse({"error": {"message": message, "type": etype, "code": code, "param": param}},
                        status_code=status)


# ---- field validation ----------------------------------------------------------------------------
_MISSING = object()


def _get(body: dict, key: str, types, default=_MISSING, what: str | None = None):
    """body[key] checked against `types` (None/absent -> default; absent without default -> 400)."""
    v = body.get(key, None)
    if v is None:
        if default is _MISSING:
            raise BadRequest(f"'{key}' is a required field", key)
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"'{key}' must be {what or _type_name(types)}, got a boolean", key)
    if not isinstance(v, types):
        raise BadRequest(f"'{key}' must be {what or _type_name(types)}, got {type(v).__name__}", key)
    return v


def _type_name(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > 4:
            raise BadRequest("'stop' takes at most 4 sequences", "stop")
        return tuple(stop)
    raise BadRequest("'stop' must be a string or a list of strings", "stop")


def _sampling(body: dict, max_tokens: int, stop_ids: tuple[int, ...]) -> SamplingParams:
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    top_k = _get(body, "top_k", int, 0)
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    if top_k < 0:
        raise BadRequest(f"'top_k' must be >= 0, got {top_k}", "top_k")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_tokens,
                          stop_token_ids=stop_ids)


def _common_checks(body: dict) -> None:
    n = _get(body, "n", int, 1)
    if n != 1:
        raise BadRequest(f"only n=1 is supported, got n={n}", "n")
    for key in ("presence_penalty", "frequency_penalty"):
        if _get(body, key, (int, float), 0) != 0:
            raise BadRequest(f"'{key}' is not supported (must be 0 or absent)", key)
    if body.get("logprobs") not in (None, False):
        raise BadRequest("'logprobs' is not supported", "logprobs")
    if body.get("tools") or body.get("functions"):
        raise BadRequest("tool / function calling is not supported", "tools")
    _get(body, "stream", bool, False)
    so = _get(body, "stream_options", dict, {})
    if "include_usage" in so and not isinstance(so["include_usage"], bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean", "stream_options")


def _max_tokens(body: dict, keys: tuple[str, ...], default: int, prompt_len: int, max_len: int) -> int:
    for key in keys:
        v = _get(body, key, int, None)
        if v is not None:
            if v < 1:
                raise BadRequest(f"'{key}' must be >= 1, got {v}", key)
            return v               # the engine ends with finish_reason "length" when the cache is full
    return max(1, min(default, max_len - prompt_len - 1))


# ---- the app -------------------------------------------------------------------------------------
def create_app(engine, tokenizer, model_id: str = "smollm2-135m-instruct") -> FastAPI:
    """FastAPI app serving `engine`. Starts the engine's background loop (idempotent) if it is not
    running; the caller owns shutdown (`engine.shutdown()`), which `serve_forever` does on exit.
    If the engine was built without a tokenizer, `tokenizer` is attached to it (text + stop strings)."""
    if getattr(engine, "tokenizer", None) is None:
        engine.tokenizer = tokenizer
    engine.start()
    app = FastAPI(title="preft_jax server", version="0.1.0")
    app.state.engine, app.state.tokenizer, app.state.model_id = engine, tokenizer, model_id
    created = int(time.time())
    default_stop = tuple(int(i) for i in getattr(tokenizer, "eos_token_ids", ()) or ()) or (-1,)
    max_len = engine.config.max_len

    @app.exception_handler(RequestError)
    async def _request_error(_, exc: RequestError):
        return _error(exc.status, str(exc), exc.code, getattr(exc, "param", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return _error(400, "invalid request: " + "; ".join(parts), "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _internal_error(_, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

    def _adapter_for(body: dict) -> str | None:
        model = _get(body, "model", str)
        return None if model == model_id else model

    def _submit(prompt_ids: list[int], adapter: str | None, sp: SamplingParams, stop: tuple[str, ...]):
        if adapter is not None and adapter not in engine.registry.names():
            known = ", ".join([model_id] + sorted(engine.registry.names()))
            raise UnknownAdapterError(f"The model {adapter!r} does not exist (available: {known})")
        return engine.submit(prompt_ids, adapter, sp, stop)

    def _usage(result) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens}

    def _text(result) -> str:
        return result.text if result.text is not None else tokenizer.decode(result.tokens)

    def _sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def _stream(req, make_chunk, first: list[dict], include_usage: bool) -> Iterator[str]:
        """SSE over req.stream(): `make_chunk(text | None, finish_reason | None)` -> chunk dict."""
        try:
            for chunk in first:
                yield _sse(chunk)
            for kind, payload in req.stream():
                if kind == "delta":
                    if payload[1]:
                        yield _sse(make_chunk(payload[1], None))
                else:
                    yield _sse(make_chunk(None, payload.finish_reason))
                    if include_usage:
                        last = make_chunk(None, None)
                        last["choices"], last["usage"] = [], _usage(payload)
                        yield _sse(last)
        except RuntimeError as e:       # the engine failed this request: tell the client, end cleanly
            yield _sse({"error": {"message": str(e), "type": "server_error", "code": "engine_error"}})
        finally:
            if req.result is None:      # the client went away mid-stream: free the slot now
                engine.cancel(req)
        yield "data: [DONE]\n\n"

    async def _wait(req):
        try:
            return await run_in_threadpool(req.wait)
        except RuntimeError as e:
            return _error(500, str(e), "engine_error")

    # ---- completions -------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        adapter = _adapter_for(body)
        _common_checks(body)
        if body.get("echo"):
            raise BadRequest("'echo' is not supported", "echo")
        if body.get("suffix"):
            raise BadRequest("'suffix' is not supported", "suffix")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]               # a batch of one prompt
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            prompt_ids = list(prompt)
        elif prompt is None:
            raise BadRequest("'prompt' is a required field", "prompt")
        elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise BadRequest("batched prompts are not supported; send one prompt per request", "prompt")
        else:
            raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
        max_tokens = _max_tokens(body, ("max_tokens",), DEFAULT_COMPLETION_MAX_TOKENS, len(prompt_ids), max_len)
        sp = _sampling(body, max_tokens, default_stop)
        stop = _stop_strings(body)
        req = _submit(prompt_ids, adapter, sp, stop)
        rid, now, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), body["model"]

        def chunk(text, finish):
            return {"id": rid, "object": "text_completion", "created": now, "model": model,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(req, chunk, [], include_usage), media_type="text/event-stream")
        result = await _wait(req)
        if isinstance(result, JSONResponse):
            return result
        out = chunk(_text(result), result.finish_reason)
        out["usage"] = _usage(result)
        return out

    # ---- chat completions --------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        adapter = _adapter_for(body)
        _common_checks(body)
        messages = _get(body, "messages", list)
        if not messages:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        msgs = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
            content = m.get("content")
            if isinstance(content, list):      # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string", "messages")
            msgs.append({"role": m["role"], "content": content})
        try:
            prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
        except RequestError:
            raise
        except Exception as e:                 # template errors (raise_exception, bad roles, ...)
            raise BadRequest(f"could not apply the chat template: {e}", "messages")
        max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), DEFAULT_CHAT_MAX_TOKENS,
                                 len(prompt_ids), max_len)
        sp = _sampling(body, max_tokens, default_stop)
        stop = _stop_strings(body)
        req = _submit(prompt_ids, adapter, sp, stop)
        rid, now, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body["model"]

        def chunk(text, finish, role=False):
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(req, chunk, [chunk("", None, role=True)], include_usage),
                                     media_type="text/event-stream")
        result = await _wait(req)
        if isinstance(result, JSONResponse):
            return result
        return {"id": rid, "object": "chat.completion", "created": now, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": _text(result)},
                             "logprobs": None, "finish_reason": result.finish_reason}],
                "usage": _usage(result)}

    # ---- models and adapters -----------------------------------------------------------------
    def _model_entry(name: str, kind: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "preft_jax", "kind": kind,
                "root": model_id, "parent": None if kind == "base" else model_id}

    @app.get("/v1/models")
    async def list_models():
        data = [_model_entry(model_id, "base")]
        data += [_model_entry(n, k) for n, k in sorted(engine.registry.names().items())]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{name}")
    async def get_model(name: str):
        if name == model_id:
            return _model_entry(model_id, "base")
        kinds = engine.registry.names()
        if name not in kinds:
            raise UnknownAdapterError(f"The model {name!r} does not exist")
        return _model_entry(name, kinds[name])

    @app.post("/v1/adapters")
    async def load_adapter(request: Request):
        body = await _json_body(request)
        name, path = _get(body, "name", str), _get(body, "path", str)
        if not name or name == model_id:
            raise BadRequest(f"adapter name must be non-empty and differ from the base model id {model_id!r}",
                             "name")
        if name in engine.registry.names():
            raise AdapterExistsError(f"adapter {name!r} is already loaded; unload it first")
        try:
            slot = await run_in_threadpool(engine.registry.load, name, path)
        except RequestError:
            raise
        except (ValueError, OSError) as e:     # AdapterFormatError, missing files, shape mismatch
            raise BadRequest(f"could not load adapter {name!r} from {path!r}: {e}", "path")
        return {"object": "adapter", "id": name, "name": name, "kind": engine.registry.names().get(name),
                "slot": slot, "path": path}

    @app.delete("/v1/adapters/{name}")
    async def unload_adapter(name: str):
        engine.registry.unload(name)           # UnknownAdapterError 404, AdapterInUseError 409
        return {"object": "adapter", "id": name, "deleted": True}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "adapters": len(engine.registry.names())}

    return app


# ---- running it ----------------------------------------------------------------------------------
def serve_forever(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Runs uvicorn in this thread until interrupted, then shuts the app's engine down."""
    import uvicorn
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        app.state.engine.shutdown()


class BackgroundServer:
    """uvicorn in a daemon thread on an already-bound socket (port 0 = a free port); for tests/tools.

        with BackgroundServer(app) as srv:  ...  srv.url  ->  "http://127.0.0.1:PORT"
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="preft-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
