"""Exception handlers: every error is an OpenAI error envelope; a 500 never leaks internals."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.api.common import error_response, log, request_id
from serve.errors import EngineError, RequestError


def install_error_handlers(app: FastAPI, retry: dict) -> None:
    """`retry`: the Retry-After header sent with 429 and 503."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return error_response(exc.status, exc.public_message, exc.code, getattr(exc, "param", None),
                              retry if exc.status in (429, 503) else None)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError):
        return error_response(exc.status, str(exc), exc.code, None, retry if exc.status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        return error_response(400, "invalid request", "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        rid = request_id(request)
        log.error("request %s failed with an internal error", rid, exc_info=exc)
        return error_response(500, f"internal server error (request id {rid}); the server log has details",
                              "internal_error")
