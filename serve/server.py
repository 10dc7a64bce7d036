"""OpenAI-compatible HTTP server over the continuous-batching Engine.

    app = create_app(engine, tokenizer, model_id="smollm2-135m-instruct", config=ServerConfig(...))
    serve_forever(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as SSE),
GET /v1/models, GET /v1/models/{id}, POST /v1/adapters, DELETE /v1/adapters/{name} (admin),
GET /health, GET /metrics (Prometheus, the app's own prometheus_client registry). `model` is an
adapter name (PreFT adapter applied at prefill) or `model_id` (the base model).

`create_app` assembles: the routes (serve/api/: completions, chat, models + adapter admin, health and
metrics), their shared context (serve/api/common.py), response formatting (serve/api/formatting.py),
error handlers (serve/api/errors.py), metrics (serve/metrics.py) and the limits middleware.

Hardening (docs/serving.md lists every limit):
* bodies are parsed and validated here (serve/protocol.py): every malformed body is a 400 naming the
  field; bad requests are refused before they reach the engine, so they never touch running ones;
* keys and the adapter root (serve/access.py), body size, body deadline and request ids
  (serve/middleware.py), header deadline (serve/connections.py), keep-alive and header size limits;
  with an API key, /openapi.json needs it and /docs, /redoc are off;
* tokenization runs off the event loop, after a length pre-check that needs no tokenization;
* waiting and streaming handlers hold no thread (serve/bridge.py); a client that disconnects has
  its request cancelled within one engine step; every wait has a deadline;
* a full queue is a 429 with Retry-After; a shutting-down engine a 503; a 500 never leaks internals
  (the log has the traceback and the request id).

Shutdown (SIGTERM / SIGINT, `serve_forever`): the engine stops accepting (generation requests get
503, /health 503 `shutting_down`) and drains: running and queued requests get `shutdown_grace`
seconds to finish, then fail; only then does the HTTP server close its socket and exit, so probes
see the 503 the whole time. A second signal exits at once.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import preft_jax
from serve.access import ServerConfig, check_api_key
from serve.api import chat, completions, models, ops
from serve.api.common import ApiContext
from serve.connections import guarded_h11
from serve.api.errors import install_error_handlers
from serve.metrics import ServerMetrics
from serve.middleware import LimitsMiddleware
from serve.protocol import BadRequest

__all__ = ["create_app", "serve_forever", "BackgroundServer", "ServerConfig", "BadRequest"]

ROUTERS = (completions.router, chat.router, models.router, ops.router)
log = logging.getLogger("serve.server")


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

    locked = config.api_key is not None            # the schema is behind the key, the browser docs are off
    app = FastAPI(title="preft_jax server", version=preft_jax.__version__, lifespan=lifespan,
                  **(dict(docs_url=None, redoc_url=None, openapi_url=None) if locked else {}))
    if locked:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request):
            check_api_key(config, request.headers)
            return JSONResponse(app.openapi())
    metrics = ServerMetrics(engine)
    app.add_middleware(LimitsMiddleware, max_body_bytes=config.max_body_bytes, body_timeout=config.body_timeout,
                       max_header_bytes=config.max_header_bytes, on_response=metrics.on_response)
    app.state.engine, app.state.tokenizer, app.state.model_id, app.state.config = engine, tokenizer, model_id, config
    app.state.api = ApiContext(engine, tokenizer, model_id, config, metrics)
    install_error_handlers(app, app.state.api.retry)
    for router in ROUTERS:
        app.include_router(router)
    return app


# ---- running it ----------------------------------------------------------------------------------
def _uvicorn_server(app: FastAPI, log_level: str):
    """A uvicorn Server with the connection limits of the app's ServerConfig, whose first exit
    signal drains the engine while HTTP keeps answering (generation 503, /health 503), then exits;
    a second signal exits at once. uvicorn's own graceful shutdown is bounded as a backstop."""
    import uvicorn
    config: ServerConfig = app.state.config
    grace = config.shutdown_grace
    engine = app.state.engine

    class _Server(uvicorn.Server):
        draining = None

        def handle_exit(self, sig, frame):
            if self.draining is None and not self.should_exit:
                if hasattr(self, "_captured_signals"):
                    self._captured_signals.append(sig)        # uvicorn (>= 0.29) re-raises it after its shutdown
                log.info("received %s: draining (no new requests; running ones get %.0f s), then exiting",
                         signal.Signals(sig).name, grace)
                self.draining = threading.Thread(target=self._drain, name="preft-drain", daemon=True)
                self.draining.start()
                return
            super().handle_exit(sig, frame)                   # a second signal: exit now

        def _drain(self):
            try:
                engine.shutdown(grace=grace)
            finally:
                self.should_exit = True

    return _Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace + 5,
                                  http=guarded_h11(config.header_timeout), timeout_keep_alive=config.keep_alive_timeout,
                                  h11_max_incomplete_event_size=config.max_header_bytes,
                                  limit_concurrency=config.limit_concurrency))


class ListenError(ValueError):
    """The server's address cannot be listened on (the message names the flags and why)."""


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the model loads, as vLLM binds its port
    first: a host name that does not resolve or a port in use is one ListenError at once instead of
    after minutes of loading, and the port stays this process's meanwhile (connections are refused,
    not queued, until uvicorn listens)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ListenError(f"--host {host}: does not resolve ({getattr(e, 'strerror', None) or e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ListenError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def serve_forever(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  sock: socket.socket | None = None) -> None:
    """Runs uvicorn in this thread until SIGINT/SIGTERM, then shuts the engine down within its grace.
    `sock`: the socket `listen_socket(host, port)` bound earlier (None: bound here)."""
    sock = sock or listen_socket(host, port)
    server = _uvicorn_server(app, log_level)
    server.config.host, server.config.port = host, sock.getsockname()[1]
    try:
        server.run(sockets=[sock])
    finally:
        app.state.engine.shutdown(grace=0.0)


class BackgroundServer:
    """uvicorn in a daemon thread on an already-bound socket (port 0 = a free port); for tests/tools.

        with BackgroundServer(app) as srv:  ...  srv.url  ->  "http://127.0.0.1:PORT"
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = listen_socket(host, port)
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
