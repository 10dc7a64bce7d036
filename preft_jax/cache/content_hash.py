"""SHA-256 of a file's content, memoized per (path, size, mtime_ns, inode, device).

The memo only avoids re-reading an unchanged file; cache keys are always the content hash. A memo
record whose stat fields differ from the file's current ones is ignored and rewritten.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

from preft_jax.cache.atomic import atomic_write_bytes
from preft_jax.cache.location import hashes_dir

_CHUNK = 8 << 20


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file's bytes (no memo)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stat_fields(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


def _memo_path(path: pathlib.Path, memo_dir: pathlib.Path) -> pathlib.Path:
    return memo_dir / (hashlib.sha256(str(path).encode("utf-8")).hexdigest()[:40] + ".json")


def content_hash(path: str | os.PathLike, *, memo: bool = True,
                 memo_dir: str | os.PathLike | None = None) -> str:
    """Hex SHA-256 of the file at `path`, reusing a memo record when the file is unchanged."""
    path = pathlib.Path(path).expanduser().resolve()
    st = path.stat()
    if not memo:
        return sha256_file(path)
    mdir = pathlib.Path(memo_dir) if memo_dir is not None else hashes_dir()
    record_path = _memo_path(path, mdir)
    fields = _stat_fields(st)
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        if not isinstance(record, dict):           # valid JSON of another shape ([], null): a stale memo
            raise ValueError("not a memo record")
        if record.get("path") == str(path) and all(record.get(k) == v for k, v in fields.items()):
            digest = record.get("sha256")
            if isinstance(digest, str) and len(digest) == 64:
                return digest
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    if _stat_fields(path.stat()) == fields:       # unchanged while we read it: safe to memoize
        try:
            mdir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(record_path, json.dumps({"path": str(path), **fields, "sha256": digest}).encode())
        except OSError:
            pass                                    # read-only cache dir: no memo, still correct
    return digest
