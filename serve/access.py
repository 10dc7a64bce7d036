"""Who may do what: API keys for inference, an admin key for adapter management, and the one
folder adapters may be loaded from at run time.

* `api_key`: when set, every /v1 endpoint needs `Authorization: Bearer <api_key>` (as vLLM's
  `--api-key`); /health and /metrics stay open for probes and scrapers.
* `admin_key`: POST /v1/adapters and DELETE /v1/adapters/{name} need `Authorization: Bearer
  <admin_key>`. Without an admin key they are refused (403) unless `allow_unauthenticated_admin`.
* `adapter_root`: run-time loads read only folders under this directory (resolved with symlinks, no
  `~` expansion); a path outside it gets the same answer whether or not it exists.
"""
from __future__ import annotations

import dataclasses
import hmac
import math
import os

from serve.errors import AuthenticationError, PermissionDeniedError, RequestError


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    admin_key: str | None = None
    allow_unauthenticated_admin: bool = False
    adapter_root: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_grace: float = 10.0         # seconds in-flight requests get to finish on shutdown
    tokenizer_threads: int = 2           # concurrent tokenizations off the event loop
    retry_after_s: int = 1               # Retry-After on 429 / 503

    def __post_init__(self):
        for name in ("api_key", "admin_key"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string or None")
        if self.api_key is not None and self.api_key == self.admin_key:
            raise ValueError("admin_key must differ from api_key")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not (math.isfinite(self.shutdown_grace) and self.shutdown_grace >= 0):
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")
        if self.tokenizer_threads < 1 or self.retry_after_s < 0:
            raise ValueError("tokenizer_threads must be >= 1 and retry_after_s >= 0")
        if self.adapter_root is not None and not os.path.isdir(self.adapter_root):
            raise ValueError(f"adapter_root is not a folder: {self.adapter_root}")


def _bearer(headers) -> str | None:
    value = headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                                     expected.encode("utf-8"))


def check_api_key(config: ServerConfig, headers) -> None:
    if config.api_key is None:
        return
    given = _bearer(headers)
    if not (_matches(given, config.api_key) or (config.admin_key and _matches(given, config.admin_key))):
        raise AuthenticationError("missing or invalid API key (send 'Authorization: Bearer <key>')")


def check_admin(config: ServerConfig, headers) -> None:
    if config.admin_key is None:
        if config.allow_unauthenticated_admin:
            return
        raise PermissionDeniedError("adapter management is disabled: start the server with --admin-key "
                                    "(or --allow-unauthenticated-admin on a trusted network)")
    if not _matches(_bearer(headers), config.admin_key):
        raise AuthenticationError("adapter management needs the admin key ('Authorization: Bearer <admin key>')")


def resolve_adapter_path(config: ServerConfig, path: str) -> tuple[str, str]:
    """(real path, path relative to the root) of a run-time adapter load, or a 400/403.

    `path` is relative to the adapter root (an absolute path is accepted only inside it). The answer
    for a path outside the root never depends on whether it exists."""
    if config.adapter_root is None:
        raise PermissionDeniedError("loading adapters at run time needs the server to be started with "
                                    "--adapter-root DIR")
    if not path or "\x00" in path:
        raise RequestError("'path' must be a non-empty folder path under the adapter root", "path")
    root = os.path.realpath(config.adapter_root)
    real = os.path.realpath(os.path.join(root, path))          # no expanduser: '~' is just a name
    if os.path.commonpath([root, real]) != root or real == root:
        raise RequestError("'path' must name a folder inside the server's adapter root", "path")
    return real, os.path.relpath(real, root)
