"""What every route shares: the app's `ApiContext` (engine, tokenizer, limits, metrics) with the
steps of serving a request (resolve the model, pre-check and tokenize off the event loop, submit,
wait or stream the engine's events), and the OpenAI error envelope."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from preft_jax.sampling import SamplingParams
from serve import protocol, validation
from serve.access import ServerConfig, check_api_key
from serve.api.formatting import SSE_DONE, sse
from serve.bridge import AsyncSink, ClientGone, TaggedSink, collect_many
from serve.errors import DeadlineExceededError, EngineError, PromptTooLongError, RequestError, UnknownAdapterError
from serve.logprobs import TokenText
from serve.metrics import ServerMetrics
from serve.protocol import BadRequest
from serve.request import GenerationRequest

log = logging.getLogger("serve.server")


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
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


def request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex


def unknown_model(name: str, known: str | None) -> UnknownAdapterError:
    return UnknownAdapterError(f"The model {name!r} does not exist" + (f" (available: {known})" if known else ""),
                               "model")


@dataclasses.dataclass
class ApiContext:
    engine: object
    tokenizer: object
    model_id: str
    config: ServerConfig
    metrics: ServerMetrics
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        tok = self.tokenizer
        self.default_stop = tuple(int(i) for i in getattr(tok, "eos_token_ids", ()) or ()) or (-1,)
        self.max_len = self.engine.config.max_model_len
        self.vocab = self.engine.runner.cfg.vocab_size
        self.tok_limiter = anyio.CapacityLimiter(self.config.tokenizer_threads)
        self.max_token_bytes = getattr(tok, "max_token_bytes", None)
        self.retry = {"Retry-After": str(self.config.retry_after_s)}
        self.token_text = TokenText(tok)

    @property
    def registry(self):
        return self.engine.registry

    async def read(self, request: Request) -> tuple[dict, str | None]:
        """A generation request's body, after the API key check, parsed, with the adapter its `model`
        names (None: the base model) and the fields every generation endpoint shares checked."""
        check_api_key(self.config, request.headers)
        body = protocol.parse_json(await request.body())
        adapter = self.adapter_for(body)
        protocol.common_checks(body)
        return body, adapter

    async def respond(self, request: Request, reqs, sink, fmt, body: dict):
        """The submitted requests' answer: an SSE stream when `body["stream"]`, else the whole body
        once every choice is done (499 when the client went away first)."""
        if body.get("stream"):
            return StreamingResponse(self.stream(reqs, sink, fmt, include_usage(body)), media_type="text/event-stream")
        results = await self.wait(request, reqs, sink)
        if results is None:
            return error_response(499, "client closed the request", "client_closed")
        return fmt.response(reqs, results)

    def adapter_for(self, body: dict) -> str | None:
        """The adapter `body["model"]` names (None: the base model). Raises UnknownAdapterError."""
        model = protocol.get(body, "model", str)
        if model == self.model_id:
            return None
        if model not in self.registry:
            raise unknown_model(model, ", ".join([self.model_id] + sorted(self.registry.names())))
        return model

    def precheck(self, n_bytes: int, what: str, overhead_tokens: int = 0) -> None:
        """Refuses text that cannot fit the context whatever it tokenizes to (no tokenization)."""
        if self.max_token_bytes and n_bytes > (self.max_len - 1 + overhead_tokens) * self.max_token_bytes:
            raise PromptTooLongError(f"{what} is {n_bytes} bytes; it cannot fit the context length of {self.max_len} "
                                     f"tokens", "prompt" if what == "prompt" else "messages")

    async def tokenize(self, fn, *args):
        """`fn(*args)` on the tokenizer threads (off the event loop)."""
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self.tok_limiter)
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad roles, ...)
            raise BadRequest(f"could not apply the chat template: {e}"[:500], "messages") from None

    async def submit(self, request: Request, prompts: list[list[int]], adapter: str | None,
                     sps: list[SamplingParams], stop: tuple[str, ...], n: int):
        """Every prompt x n completions, all or nothing: (requests in choice order, their shared sink).
        Choice k is prompt k // n, sample k % n (OpenAI's order)."""
        engine = self.engine
        validation.check_request_group(engine.limits, [len(p) for p in prompts], n,
                                       any(sp.prompt_logprobs is not None for sp in sps))
        timeout, started = engine.config.request_timeout, time.monotonic()
        if adapter is not None:        # load it (disk -> host) before anything starts: errors are 4xx
            loading = engine.registry.prepare(adapter)       # shared by every request waiting for it:
            try:                                             # shielded, so a request that gives up
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(loading)), timeout)   # cancels no load
            except asyncio.TimeoutError:                    # (TimeoutError from Python 3.11)
                raise DeadlineExceededError(f"adapter {adapter!r} did not load within this request's deadline "
                                            f"({timeout:g} s); it goes on loading: retry later") from None
        left = None if timeout is None else max(timeout - (time.monotonic() - started), 1e-3)   # one deadline
        sink = AsyncSink()
        rid = request_id(request)
        items = [GenerationRequest(ids, adapter, sp, stop, n, [TaggedSink(sink, i * n + j) for j in range(n)],
                                   rid if len(prompts) == 1 else f"{rid}-p{i}", left, rid)
                 for i, (ids, sp) in enumerate(zip(prompts, sps))]
        return [r for reqs in engine.submit_many(items) for r in reqs], sink      # all or nothing

    async def wait(self, request: Request, reqs, sink):
        """The requests' Results in order; None when the client went away (they are cancelled)."""
        try:
            return await collect_many(self.engine, reqs, sink, request.is_disconnected)
        except ClientGone:
            self.metrics.disconnects.inc()
            return None

    async def stream(self, reqs, sink, fmt, include_usage: bool):
        """SSE over the requests' events, formatted by `fmt` (serve/api/formatting.py). A client
        disconnect cancels the generator (Starlette), and `finally` cancels the requests. With
        `include_usage` every chunk carries "usage": null and a last chunk the usage (OpenAI's form)."""
        def send(chunk: dict) -> str:
            return sse(dict(chunk, usage=None) if include_usage else chunk)
        outs = [r.output() for r in reqs]
        deadline = max((r.deadline for r in reqs if r.deadline is not None), default=None)
        results = [None] * len(reqs)
        try:
            for chunk in fmt.first_chunks():
                yield send(chunk)
            left = len(reqs)
            while left:
                tag, event = await sink.get(deadline)
                for kind, payload in outs[tag].handle(event):
                    if kind == "delta":
                        for chunk in fmt.delta_chunks(tag, outs[tag], *payload):
                            yield send(chunk)
                    elif kind == "done":
                        results[tag] = payload
                        left -= 1
                        for chunk in fmt.done_chunks(tag, outs[tag], payload):
                            yield send(chunk)
                    else:
                        raise payload
            if include_usage:
                yield sse(fmt.usage_chunk(results))
        except EngineError as e:            # the engine failed a request: tell the client, end cleanly
            yield sse({"error": {"message": str(e), "type": "server_error", "code": e.code}})
        finally:
            live = [r for r, out in zip(reqs, outs) if not out.done]
            if live and not any(out.done and res is None for out, res in zip(outs, results)):
                self.metrics.disconnects.inc()     # gone before the end (not ended by an engine error)
            for r in live:
                self.engine.cancel(r)
        yield SSE_DONE


def api_context(request: Request) -> ApiContext:
    return request.app.state.api


def include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))
