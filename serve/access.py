"""Who may do what: API keys for inference, an admin key for adapter management, and the one
folder adapters may be loaded from at run time.

* `api_key`: when set, every /v1 endpoint needs `Authorization: Bearer <api_key>` (as vLLM's
  `--api-key`); /health and /metrics stay open for probes and scrapers.
* `admin_key`: POST /v1/adapters and DELETE /v1/adapters/{name} need `Authorization: Bearer
  <admin_key>`. Without an admin key they are refused (403) unless `allow_unauthenticated_admin`.
* `adapter_root`: run-time loads read only folders under this directory (resolved with symlinks, no
  `~` expansion); a path outside it gets the same answer whether or not it exists. Every file and
  folder inside an adapter folder must resolve inside the root too (`check_files_inside`, run by the
  catalog before and after each load from the root or from `--adapter-dir`), so a symlinked
  `adapter_config.json` or weights file cannot make a loader read elsewhere.
"""
from __future__ import annotations

import dataclasses
import hmac
import math
import os

from serve.errors import AuthenticationError, PermissionDeniedError, RequestError

MAX_ADAPTER_FILES = 10_000           # entries an adapter folder may hold (an Orbax run holds a few per step)


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
    # connections (serve/connections.py, serve/middleware.py; uvicorn's own where it has one)
    header_timeout: float = 10.0         # a request's headers must arrive within this (slowloris)
    body_timeout: float = 60.0           # ... and its body within this after them (408 beyond)
    keep_alive_timeout: float = 5.0      # an idle keep-alive connection is closed after this
    max_header_bytes: int = 16 * 1024    # request line + headers (400 beyond)
    limit_concurrency: int | None = None  # connections + tasks before uvicorn answers 503 (None: no limit)

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
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0 seconds, got {v}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
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


class OutsideRootError(ValueError):
    """A file or folder inside an adapter folder resolves outside the root it must stay in. The
    message names the entry (relative to the adapter folder), never where it points."""


def _inside(root: str, real: str) -> bool:
    return real == root or os.path.commonpath([root, real]) == root


def check_files_inside(folder: str, root: str, max_entries: int = MAX_ADAPTER_FILES) -> None:
    """Raises OutsideRootError unless `folder` and every file and folder under it (symlinks followed,
    each resolved) lie inside `root`. The loaders read only files under the folder, so none of their
    reads leaves the root. Symlinks that stay inside (a Hugging Face cache's snapshot -> blob links)
    are fine. A symlink loop is visited once; more than `max_entries` entries is refused."""
    root = os.path.realpath(root)
    top = os.path.realpath(folder)
    if not _inside(root, top):
        raise OutsideRootError("the adapter folder resolves outside the adapter root")
    seen, stack, count = {top}, [(top, "")], 0
    while stack:
        real_dir, rel_dir = stack.pop()
        try:
            entries = sorted(os.scandir(real_dir), key=lambda e: e.name)
        except OSError as e:
            raise OutsideRootError(f"cannot list {rel_dir or 'the adapter folder'}: {e.strerror}") from None
        for entry in entries:
            count += 1
            if count > max_entries:
                raise OutsideRootError(f"the adapter folder holds more than {max_entries} files")
            rel = os.path.join(rel_dir, entry.name)
            real = os.path.realpath(entry.path)
            if not _inside(root, real):
                raise OutsideRootError(f"{rel!r} in the adapter folder resolves outside the adapter root")
            if os.path.isdir(real) and real not in seen:
                seen.add(real)
                stack.append((real, rel))
