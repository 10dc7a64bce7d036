"""OpenAI-compatible HTTP server over the continuous-batching Engine.

    app = create_app(engine, tokenizer, model_id="smollm2-135m-instruct", config=ServerConfig(...))
    serve_forever(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as SSE),
GET /v1/models, GET /v1/models/{id}, POST /v1/adapters, DELETE /v1/adapters/{name} (admin),
GET /health, GET /metrics (Prometheus text). `model` is an adapter name (PreFT adapter applied at
prefill) or `model_id` (the base model).

Hardening (docs/serving.md lists every limit):
* bodies are parsed and validated here (serve/protocol.py): every malformed body is a 400 naming the
  field; bad requests are refused before they reach the engine, so they never touch running ones;
* keys and the adapter root (serve/access.py), body size and request ids (serve/middleware.py);
* tokenization runs off the event loop, after a length pre-check that needs no tokenization;
* waiting and streaming handlers hold no thread (serve/bridge.py); a client that disconnects has
  its request cancelled within one engine step; every wait has a deadline;
* a full queue is a 429 with Retry-After; a shutting-down engine a 503; a 500 never leaks internals
  (the log has the traceback and the request id).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import preft_jax
from preft_jax.cache import status as runtime_status
from preft_jax.sampling import SamplingParams
from serve import protocol
from serve.access import ServerConfig, check_admin, check_api_key, resolve_adapter_path
from serve import logprobs as logprobs_fmt
from serve.bridge import AsyncSink, ClientGone, TaggedSink, collect_many
from serve.errors import AdapterExistsError, AdapterLoadError, EngineError, PromptTooLongError, RequestError
from serve.metrics import render
from serve.middleware import LimitsMiddleware
from serve.protocol import BadRequest
from serve.registry import check_adapter_name

log = logging.getLogger("serve.server")

DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16
CHAT_TEMPLATE_OVERHEAD_TOKENS = 256     # room the pre-check leaves for the template's own tokens

__all__ = ["create_app", "serve_forever", "BackgroundServer", "ServerConfig", "BadRequest"]


def _error(status: int, message: str, code: str | None = None, param: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    etype = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        etype = "not_found_error"
    elif status == 401:
        etype = "authentication_error"
    elif status == 403:
        etype = "permission_error"
    elif status == 429:
        etype = "rate_limit_error"
    return JSONResponse({"error": {"message": message, "type": etype, "code": code, "param": param}},
                        status_code=status, headers=headers)


def _rid(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex


class _HttpCounters:
    def __init__(self):
        self.lock = threading.Lock()
        self.responses: dict[tuple[str, int], int] = {}
        self.disconnects = 0
        self.adapter_loads: dict[str, int] = {}

    def count(self, path: str, status: int):
        with self.lock:
            self.responses[(path, status)] = self.responses.get((path, status), 0) + 1


def create_app(engine, tokenizer, model_id: str = "smollm2-135m-instruct",
               config: ServerConfig = ServerConfig()) -> FastAPI:
    """FastAPI app serving `engine`. Starts the engine's background loop (idempotent); shutting the
    app down (lifespan end) shuts the engine down with `config.shutdown_grace`. If the engine was
    built without a tokenizer, `tokenizer` is attached to it (text + stop strings)."""
    if getattr(engine, "tokenizer", None) is None:
        engine.tokenizer = tokenizer
    engine.start()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await anyio.to_thread.run_sync(lambda: engine.shutdown(grace=config.shutdown_grace))

    app = FastAPI(title="preft_jax server", version=preft_jax.__version__, lifespan=lifespan)
    http = _HttpCounters()
    def _on_response(scope, status: int):
        route = scope.get("route")
        http.count(getattr(route, "path", "unmatched"), status)

    app.add_middleware(LimitsMiddleware, max_body_bytes=config.max_body_bytes, on_response=_on_response)
    app.state.engine, app.state.tokenizer, app.state.model_id, app.state.config = engine, tokenizer, model_id, config
    created = int(time.time())
    default_stop = tuple(int(i) for i in getattr(tokenizer, "eos_token_ids", ()) or ()) or (-1,)
    max_len = engine.config.max_model_len
    vocab = engine.runner.cfg.vocab_size
    tok_limiter = anyio.CapacityLimiter(config.tokenizer_threads)
    max_token_bytes = getattr(tokenizer, "max_token_bytes", None)
    retry = {"Retry-After": str(config.retry_after_s)}
    token_text = logprobs_fmt.TokenText(tokenizer)

    # ---- errors ------------------------------------------------------------------------------
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return _error(exc.status, str(exc), exc.code, getattr(exc, "param", None),
                      retry if exc.status in (429, 503) else None)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError):
        return _error(exc.status, str(exc), exc.code, None, retry if exc.status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        return _error(400, "invalid request", "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        rid = _rid(request)
        log.error("request %s failed with an internal error", rid, exc_info=exc)
        return _error(500, f"internal server error (request id {rid}); the server log has details",
                      "internal_error")

    # ---- shared pieces -----------------------------------------------------------------------
    def _adapter_for(body: dict) -> str | None:
        model = protocol.get(body, "model", str)
        if model == model_id:
            return None
        if model not in engine.registry:
            known = ", ".join([model_id] + sorted(engine.registry.names()))
            raise _unknown(model, known)
        return model

    def _precheck(n_bytes: int, what: str, overhead_tokens: int = 0):
        """Refuses text that cannot fit the context whatever it tokenizes to (no tokenization)."""
        if max_token_bytes and n_bytes > (max_len - 1 + overhead_tokens) * max_token_bytes:
            raise PromptTooLongError(f"{what} is {n_bytes} bytes; it cannot fit the context length of {max_len} "
                                     f"tokens", "prompt" if what == "prompt" else "messages")

    async def _tokenize(fn, *args):
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=tok_limiter)
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad roles, ...)
            raise BadRequest(f"could not apply the chat template: {e}"[:500], "messages") from None

    async def _submit(request: Request, prompts: list[list[int]], adapter: str | None,
                      sps: list[SamplingParams], stop: tuple[str, ...], n: int):
        """Every prompt x n completions, all or nothing: (requests in choice order, their shared sink).
        Choice k is prompt k // n, sample k % n (OpenAI's order)."""
        if adapter is not None:        # load it (disk -> host) before anything starts: errors are 4xx
            await asyncio.wait_for(asyncio.wrap_future(engine.registry.prepare(adapter)),
                                   engine.config.request_timeout)
        sink = AsyncSink()
        rid = _rid(request)
        reqs = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, sps)):
                sinks = [TaggedSink(sink, len(reqs) + j) for j in range(n)]
                reqs += engine.submit_n(ids, adapter, sp, n, stop, events=sinks,
                                        request_id=rid if len(prompts) == 1 else f"{rid}-p{i}")
        except BaseException:
            for r in reqs:
                engine.cancel(r)
            raise
        return reqs, sink

    def _usage(prompts: list[list[int]], results) -> dict:
        p = sum(len(ids) for ids in prompts)          # each prompt once, whatever n
        c = sum(r.completion_tokens for r in results)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _text(result) -> str:
        return result.text if result.text is not None else tokenizer.decode(result.tokens)

    def _sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def _stream(reqs, sink, first: list[dict], on_delta, on_done, usage):
        """SSE over the requests' events: on_delta(k, output, ids, text) and on_done(k, output, result)
        give choice k's chunks; `usage(results)` the final usage chunk (None: none). A client
        disconnect cancels the generator (Starlette), and `finally` cancels the requests."""
        outs = [r.output() for r in reqs]
        deadline = max((r.deadline for r in reqs if r.deadline is not None), default=None)
        results = [None] * len(reqs)
        try:
            for chunk in first:
                yield _sse(chunk)
            left = len(reqs)
            while left:
                tag, event = await sink.get(deadline)
                for kind, payload in outs[tag].handle(event):
                    if kind == "delta":
                        for chunk in on_delta(tag, outs[tag], *payload):
                            yield _sse(chunk)
                    elif kind == "done":
                        results[tag] = payload
                        left -= 1
                        for chunk in on_done(tag, outs[tag], payload):
                            yield _sse(chunk)
                    else:
                        raise payload
            if usage is not None:
                yield _sse(usage(results))
        except EngineError as e:            # the engine failed a request: tell the client, end cleanly
            yield _sse({"error": {"message": str(e), "type": "server_error", "code": e.code}})
        finally:
            live = [r for r, out in zip(reqs, outs) if not out.done]
            if live and not any(out.done and res is None for out, res in zip(outs, results)):
                http.disconnects += 1             # gone before the end (not ended by an engine error)
            for r in live:
                engine.cancel(r)
        yield "data: [DONE]\n\n"

    async def _wait(request: Request, reqs, sink):
        try:
            return await collect_many(engine, reqs, sink, request.is_disconnected)
        except ClientGone:
            http.disconnects += 1
            return None

    def _include_usage(body) -> bool:
        return bool((body.get("stream_options") or {}).get("include_usage"))

    # ---- completions -------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        check_api_key(config, request.headers)
        body = protocol.parse_json(await request.body())
        adapter = _adapter_for(body)
        protocol.common_checks(body)
        echo = protocol.get(body, "echo", bool, False)
        if body.get("suffix"):
            raise BadRequest("'suffix' is not supported", "suffix")
        raw_prompts = protocol.completion_prompts(body)
        n = protocol.n_choices(body, engine.config.max_num_seqs, len(raw_prompts))
        k_lp = protocol.completion_logprobs(body)
        stop = protocol.stop_strings(body)
        prompts, prompt_texts, sps = [], [], []
        for prompt in raw_prompts:
            if isinstance(prompt, str):
                _precheck(len(prompt.encode("utf-8")), "prompt")
                ids = await _tokenize(tokenizer.encode, prompt)
            else:
                ids = prompt
            prompts.append(ids)
            prompt_texts.append(prompt if isinstance(prompt, str) else (tokenizer.decode(ids) if echo else ""))
            max_tokens = protocol.max_tokens(body, ("max_tokens",), DEFAULT_COMPLETION_MAX_TOKENS, len(ids), max_len)
            sps.append(protocol.sampling(body, max_tokens, default_stop, vocab, logprobs=k_lp,
                                         prompt_logprobs=k_lp if echo else None))
        reqs, sink = await _submit(request, prompts, adapter, sps, stop, n)
        rid, now, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), body["model"]

        def choice(k, text, logprobs=None, finish=None):
            return {"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish}

        def envelope(choices):
            return {"id": rid, "object": "text_completion", "created": now, "model": model, "choices": choices}

        def echo_part(k, out):
            """(text, logprobs) of choice k's echoed prompt."""
            i = k // n
            text = prompt_texts[i]
            if k_lp is None:
                return text, None
            entries = out.prompt_logprobs or [None] * len(prompts[i])
            return text, logprobs_fmt.legacy(token_text, prompts[i], entries,
                                             logprobs_fmt.text_offsets(tokenizer, prompts[i]))

        if body.get("stream"):
            sent = [[] for _ in reqs]              # ids streamed per choice
            echoed = [not echo] * len(reqs)

            def echo_chunks(k, out):
                if echoed[k]:
                    return []
                echoed[k] = True
                return [envelope([choice(k, *echo_part(k, out))])]

            def on_delta(k, out, ids, text):
                chunks = echo_chunks(k, out)
                lp = None
                if k_lp is not None and ids:
                    start = len(prompt_texts[k // n]) if echo else 0
                    lp = logprobs_fmt.legacy(token_text, ids, out.logprobs[len(sent[k]):len(sent[k]) + len(ids)],
                                             logprobs_fmt.text_offsets(tokenizer, ids, start, sent[k]))
                sent[k] += ids
                if text or lp is not None:
                    chunks.append(envelope([choice(k, text, lp)]))
                return chunks

            def on_done(k, out, result):
                return echo_chunks(k, out) + [envelope([choice(k, "", None, result.finish_reason)])]

            def usage(results):
                return dict(envelope([]), usage=_usage(prompts, results))

            return StreamingResponse(_stream(reqs, sink, [], on_delta, on_done,
                                             usage if _include_usage(body) else None),
                                     media_type="text/event-stream")
        results = await _wait(request, reqs, sink)
        if results is None:
            return _error(499, "client closed the request", "client_closed")
        choices = []
        for k, (req, result) in enumerate(zip(reqs, results)):
            text, lp = _text(result), None
            if k_lp is not None:
                start = len(prompt_texts[k // n]) if echo else 0
                lp = logprobs_fmt.legacy(token_text, result.tokens, result.logprobs,
                                         logprobs_fmt.text_offsets(tokenizer, result.tokens, start))
            if echo:
                etext, elp = echo_part(k, req.output())
                text = etext + text
                if lp is not None:
                    lp = {key: elp[key] + lp[key] for key in lp}
            choices.append(choice(k, text, lp, result.finish_reason))
        return dict(envelope(choices), usage=_usage(prompts, results))

    # ---- chat completions --------------------------------------------------------------------
    def _encode_chat(msgs):
        if hasattr(tokenizer, "encode_chat"):
            return tokenizer.encode_chat(msgs, add_generation_prompt=True)
        return tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_api_key(config, request.headers)
        body = protocol.parse_json(await request.body())
        adapter = _adapter_for(body)
        protocol.common_checks(body)
        n = protocol.n_choices(body, engine.config.max_num_seqs)
        k_lp = protocol.chat_logprobs(body)
        msgs = protocol.chat_messages(body)
        _precheck(sum(len(m["content"].encode("utf-8")) for m in msgs), "the conversation",
                  CHAT_TEMPLATE_OVERHEAD_TOKENS)
        prompt_ids = await _tokenize(_encode_chat, msgs)
        max_tokens = protocol.max_tokens(body, ("max_completion_tokens", "max_tokens"), DEFAULT_CHAT_MAX_TOKENS,
                                         len(prompt_ids), max_len)
        sp = protocol.sampling(body, max_tokens, default_stop, vocab, logprobs=k_lp)
        stop = protocol.stop_strings(body)
        reqs, sink = await _submit(request, [prompt_ids], adapter, [sp], stop, n)
        rid, now, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body["model"]

        def chunk(k, text, finish, role=False, logprobs=None):
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
                    "choices": [{"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

        if body.get("stream"):
            sent = [0] * len(reqs)

            def on_delta(k, out, ids, text):
                lp = None
                if k_lp is not None and ids:
                    lp = {"content": logprobs_fmt.chat_content(token_text, ids, out.logprobs[sent[k]:sent[k] + len(ids)]),
                          "refusal": None}
                sent[k] += len(ids)
                return [chunk(k, text, None, logprobs=lp)] if text or lp is not None else []

            def on_done(k, out, result):
                return [chunk(k, None, result.finish_reason)]

            def usage(results):
                last = chunk(0, None, None)
                last["choices"], last["usage"] = [], _usage([prompt_ids], results)
                return last

            first = [chunk(k, "", None, role=True) for k in range(len(reqs))]
            return StreamingResponse(_stream(reqs, sink, first, on_delta, on_done,
                                             usage if _include_usage(body) else None),
                                     media_type="text/event-stream")
        results = await _wait(request, reqs, sink)
        if results is None:
            return _error(499, "client closed the request", "client_closed")
        choices = []
        for k, result in enumerate(results):
            lp = None
            if k_lp is not None:
                lp = {"content": logprobs_fmt.chat_content(token_text, result.tokens, result.logprobs), "refusal": None}
            choices.append({"index": k, "message": {"role": "assistant", "content": _text(result)},
                            "logprobs": lp, "finish_reason": result.finish_reason})
        return {"id": rid, "object": "chat.completion", "created": now, "model": model, "choices": choices,
                "usage": _usage([prompt_ids], results)}

    # ---- models and adapters -----------------------------------------------------------------
    def _model_entry(name: str, kind: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "preft_jax", "kind": kind,
                "root": model_id, "parent": None if kind == "base" else model_id}

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_api_key(config, request.headers)
        data = [_model_entry(model_id, "base")]
        data += [_model_entry(n, k) for n, k in sorted(engine.registry.names().items())]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{name}")
    async def get_model(name: str, request: Request):
        check_api_key(config, request.headers)
        if name == model_id:
            return _model_entry(model_id, "base")
        kinds = engine.registry.names()
        if name not in kinds:
            raise _unknown(name, None)
        return _model_entry(name, kinds[name])

    @app.post("/v1/adapters")
    async def load_adapter(request: Request):
        check_admin(config, request.headers)
        body = protocol.parse_json(await request.body())
        name = check_adapter_name(protocol.get(body, "name", str))
        path = protocol.get(body, "path", str)
        if name == model_id:
            raise BadRequest(f"adapter name must differ from the base model id {model_id!r}", "name")
        if name in engine.registry:
            raise AdapterExistsError(f"adapter {name!r} is already loaded; unload it first")
        real, rel = resolve_adapter_path(config, path)
        t0 = time.monotonic()
        try:
            kind = await anyio.to_thread.run_sync(engine.registry.load, name, real)
        except AdapterLoadError as e:
            http.adapter_loads["failed"] = http.adapter_loads.get("failed", 0) + 1
            root = os.path.realpath(config.adapter_root) + os.sep
            raise AdapterLoadError(str(e).replace(real, rel).replace(root, ""), "path") from None
        http.adapter_loads["ok"] = http.adapter_loads.get("ok", 0) + 1
        log.info("loaded adapter %r (%s) from %s in %.2f s", name, kind, rel, time.monotonic() - t0)
        return {"object": "adapter", "id": name, "name": name, "kind": kind, "path": rel}

    @app.delete("/v1/adapters/{name}")
    async def unload_adapter(name: str, request: Request):
        check_admin(config, request.headers)
        engine.registry.unload(name)           # UnknownAdapterError 404, AdapterInUseError 409
        return {"object": "adapter", "id": name, "deleted": True}

    # ---- operations --------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        h = engine.health()
        h.update(model=model_id, adapters=len(engine.registry.names()),
                 runtime=runtime_status())       # caches and native library; "degraded": one line per mode
        if h["wedged"] or not h["loop_running"]:
            return JSONResponse(dict(h, status="unhealthy"), status_code=503)
        if not h["accepting"]:
            return JSONResponse(dict(h, status="shutting_down"), status_code=503, headers=retry)
        return dict(h, status="ok")

    @app.get("/metrics")
    async def metrics():
        m, h = engine.metrics, engine.health()
        st, occ = engine.registry.stats, engine.registry.occupancy()
        with http.lock:
            responses = [({"path": p, "code": str(c)}, n) for (p, c), n in sorted(http.responses.items())]
        fams = [
            ("preft_http_responses_total", "counter", "HTTP responses by route and status code", responses),
            ("preft_client_disconnects_total", "counter", "requests cancelled because the client went away",
             [({}, http.disconnects)]),
            ("preft_requests_submitted_total", "counter", "requests accepted by the engine",
             [({}, m.requests_submitted)]),
            ("preft_requests_finished_total", "counter", "requests finished, by finish reason",
             [({"reason": r}, n) for r, n in sorted(m.requests_finished.items())]),
            ("preft_requests_failed_total", "counter", "requests failed after acceptance, by error code",
             [({"code": c}, n) for c, n in sorted(m.requests_failed.items())]),
            ("preft_step_failures_total", "counter", "failed engine steps, by phase",
             [({"phase": p}, n) for p, n in sorted(m.step_failures.items())]),
            ("preft_generated_tokens_total", "counter", "tokens generated", [({}, m.generated_tokens)]),
            ("preft_prompt_tokens_total", "counter", "prompt tokens prefilled", [({}, m.prompt_tokens)]),
            ("preft_generation_tokens_per_second", "gauge", "generated tokens/s over the last 10 s",
             [({}, m.tokens_per_s.rate())]),
            ("preft_queue_depth", "gauge", "requests waiting for a slot", [({}, h["queued"])]),
            ("preft_queue_capacity", "gauge", "max waiting requests before 429", [({}, h["max_queued"])]),
            ("preft_running_requests", "gauge", "requests holding a KV-cache slot", [({}, h["running"])]),
            ("preft_slots", "gauge", "KV-cache slots", [({}, h["slots"])]),
            ("preft_adapters_loaded", "gauge", "adapters loaded", [({}, len(engine.registry.names()))]),
            ("preft_adapter_loads_total", "counter", "run-time adapter loads, by outcome",
             [({"outcome": k}, n) for k, n in sorted(http.adapter_loads.items())]),
            ("preft_engine_wedged", "gauge", "1 when the engine loop is stuck or dead", [({}, int(h["wedged"]))]),
            ("preft_requests_by_mode_total", "counter", "requests accepted, by serving mode",
             [({"mode": k}, n) for k, n in sorted(m.by_mode.items())]),
            ("preft_kv_blocks", "gauge", "KV-cache blocks in the pool", [({}, h["kv_blocks"])]),
            ("preft_kv_blocks_used", "gauge", "KV-cache blocks held by sequences", [({}, h["kv_blocks_used"])]),
            ("preft_prefix_cache_hits_total", "counter", "KV blocks served from the prefix cache",
             [({}, engine.pool.stats.hits)]),
            ("preft_prefix_cache_misses_total", "counter", "cacheable KV blocks computed",
             [({}, engine.pool.stats.misses)]),
            ("preft_prefix_cache_evictions_total", "counter", "cached KV blocks evicted", [({}, engine.pool.stats.evictions)]),
            ("preft_preemptions_total", "counter", "sequences preempted (recomputed later) when the KV pool ran out",
             [({}, engine.scheduler.preemptions)]),
            ("preft_adapter_cache_hits_total", "counter", "adapter lookups by tier that found it resident",
             [({"tier": "host"}, st.host_hits), ({"tier": "device"}, st.device_hits)]),
            ("preft_adapter_cache_misses_total", "counter", "adapter lookups by tier that had to load it",
             [({"tier": "host"}, st.host_misses), ({"tier": "device"}, st.device_misses)]),
            ("preft_adapter_cache_evictions_total", "counter", "adapters evicted, by tier",
             [({"tier": "host"}, st.host_evictions), ({"tier": "device"}, st.device_evictions)]),
            ("preft_adapter_load_failures_total", "counter", "adapter loads that failed", [({}, st.load_failures)]),
            ("preft_adapter_load_seconds", "histogram", "disk -> host adapter load latency", [({}, st.load_seconds)]),
            ("preft_device_adapter_slots", "gauge", "device adapter bank slots", [({}, occ["device_slots"])]),
            ("preft_device_adapter_slots_pinned", "gauge", "device slots pinned by running prefills (PreFT) or requests",
             [({}, occ["device_pinned"])]),
            ("preft_device_adapter_slots_resident", "gauge", "device slots holding an adapter",
             [({}, occ["device_resident"])]),
            ("preft_host_adapter_bytes", "gauge", "host memory held by loaded adapters", [({}, occ["host_bytes"])]),
            ("preft_time_to_first_token_seconds", "histogram", "submit to first token", [({}, m.ttft)]),
            ("preft_inter_token_seconds", "histogram", "time between a request's tokens", [({}, m.inter_token)]),
        ]
        return PlainTextResponse(render(fams), media_type="text/plain; version=0.0.4")

    return app


def _unknown(name: str, known: str | None):
    from serve.errors import UnknownAdapterError
    return UnknownAdapterError(f"The model {name!r} does not exist" + (f" (available: {known})" if known else ""),
                               "model")


# ---- running it ----------------------------------------------------------------------------------
def _uvicorn_server(app: FastAPI, log_level: str):
    """A uvicorn Server whose exit signal starts the engine's drain at once (new requests get 503,
    running ones `shutdown_grace` seconds to finish, then fail), with uvicorn's own graceful
    shutdown bounded by the same grace as a backstop."""
    import uvicorn
    grace = app.state.config.shutdown_grace
    engine = app.state.engine

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                threading.Thread(target=engine.shutdown, kwargs={"grace": grace}, name="preft-drain",
                                 daemon=True).start()
            super().handle_exit(sig, frame)

    return _Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace + 5))


def serve_forever(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Runs uvicorn in this thread until SIGINT/SIGTERM, then shuts the engine down within its grace."""
    server = _uvicorn_server(app, log_level)
    server.config.host, server.config.port = host, port
    try:
        server.run()
    finally:
        app.state.engine.shutdown(grace=0.0)


class BackgroundServer:
    """uvicorn in a daemon thread on an already-bound socket (port 0 = a free port); for tests/tools.

        with BackgroundServer(app) as srv:  ...  srv.url  ->  "http://127.0.0.1:PORT"
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = _uvicorn_server(app, log_level)
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
