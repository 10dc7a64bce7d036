"""Pure-ASGI middleware: request ids, the request body size limit and the body deadline.

* `X-Request-ID`: taken from the request when it is 1-64 characters of [A-Za-z0-9._-], else a new
  one is made; it is stored in `scope["state"]["request_id"]`, echoed in the response header and
  used in the engine's logs.
* Bodies larger than `max_body_bytes` get a 413 before the handler reads them: from Content-Length
  when given, else counted as chunks arrive (chunked uploads).
* A body must arrive within `body_timeout` seconds of its headers (a client that trickles it in is
  a 408 and the connection closes); the headers' own deadline is serve/connections.py's.
* Request line + headers larger than `max_header_bytes` are a 431 (uvicorn's h11 limit, set to the
  same size, only bounds headers that arrive in pieces).
"""
from __future__ import annotations

import asyncio
import json
import time
import re
import uuid

from serve.errors import PayloadTooLargeError, RequestError

_RID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


async def _send_error(send, status: int, message: str, code: str, request_id: str):
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code,
                                 "param": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"x-request-id", request_id.encode())]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(PayloadTooLargeError):
    """Raised from receive(): the app's RequestError handler answers 413 (or this middleware does)."""


class _BodyTimeout(RequestError):
    """Raised from receive(): the body did not arrive in time (the app's handler answers 408)."""
    status = 408
    code = "request_timeout"


class LimitsMiddleware:
    def __init__(self, app, max_body_bytes: int, body_timeout: float = 60.0, max_header_bytes: int = 16 * 1024,
                 on_response=None):
        self.app, self.max_body_bytes, self.on_response = app, max_body_bytes, on_response
        self.body_timeout, self.max_header_bytes = body_timeout, max_header_bytes

    async def _reject(self, scope, send, status, message, code, rid):
        if self.on_response is not None:
            self.on_response(scope, status)
        await _send_error(send, status, message, code, rid)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = (_header(scope, b"x-request-id") or b"").decode("latin-1")
        rid = given if _RID_RE.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
            len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
        if head > self.max_header_bytes:
            return await self._reject(scope, send, 431, f"request headers are larger than {self.max_header_bytes} "
                                      f"bytes", "headers_too_large", rid)
        limit = self.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                too_large = int(length) > limit
            except ValueError:
                return await self._reject(scope, send, 400, "invalid Content-Length header", "invalid_request", rid)
            if too_large:
                return await self._reject(scope, send, 413, f"request body is larger than {limit} bytes",
                                          "payload_too_large", rid)
        seen = 0
        started = False
        body_done = False
        body_deadline = time.monotonic() + self.body_timeout

        async def counting_receive():
            nonlocal seen, body_done
            if body_done:                             # later receives wait for a disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, body_deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise _BodyTimeout(f"the request body did not arrive within {self.body_timeout:g} s") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(f"request body is larger than {limit} bytes")
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.on_response is not None:
                    self.on_response(scope, message["status"])
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = dict(message, headers=headers + [(b"x-request-id", rid.encode())])
            await send(message)

        try:
            await self.app(scope, counting_receive, send_with_id)
        except (_TooLarge, _BodyTimeout) as e:
            if not started:
                await send_with_id({"type": "http.response.start", "status": e.status, "headers": []})
                await send({"type": "http.response.body", "body": b""})
