"""Pure-ASGI middleware: request ids and the request body size limit.

* `X-Request-ID`: taken from the request when it is 1-64 characters of [A-Za-z0-9._-], else a new
  one is made; it is stored in `scope["state"]["request_id"]`, echoed in the response header and
  used in the engine's logs.
* Bodies larger than `max_body_bytes` get a 413 before the handler reads them: from Content-Length
  when given, else counted as chunks arrive (chunked uploads).
"""
from __future__ import annotations

import json
import re
import uuid

from serve.errors import PayloadTooLargeError

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


class LimitsMiddleware:
    def __init__(self, app, max_body_bytes: int, on_response=None):
        self.app, self.max_body_bytes, self.on_response = app, max_body_bytes, on_response

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

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(f"request body is larger than {limit} bytes")
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
        except _TooLarge:
            if not started:
                await send_with_id({"type": "http.response.start", "status": 413, "headers": []})
                await send({"type": "http.response.body", "body": b""})
