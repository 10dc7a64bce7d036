"""A content-addressed on-disk store of named numpy arrays (dequantized model weights) plus small files.

One entry is a directory `<root>/<key>/`:

    manifest.json   {"body": {...}, "crc32": CRC-32 of the body's canonical JSON}
                    body: format, version, key, meta (small JSON), files {name: {size, crc32}},
                    arrays {size, tensors: [{name, dtype, shape, offset, nbytes, crc32}]}
    params.bin      all arrays, each at a 64-byte aligned offset (read back memory-mapped, copy-on-write)
    <name>          extra files (e.g. tokenizer.json)

Writers build the entry in a hidden temporary directory and publish it with one atomic rename; if
another process published the same key first, the later copy is dropped. Readers verify everything
(manifest checksum, sizes, per-array and per-file CRC-32) before returning arrays; an entry that fails
is removed (renamed away first) and reported as a miss, so the caller rebuilds it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import shutil
import logging
import time
import zlib
from typing import Mapping

import numpy as np

from preft_jax.cache.atomic import discard_dir, publish_dir, temp_sibling
from preft_jax.cache.location import is_folder, weights_dir, writable_reason
from preft_jax.cache.status import report_unwritable, unwritable_reason

log = logging.getLogger("preft_jax.cache")

FORMAT = "preft_jax.weights"
VERSION = 1
MANIFEST = "manifest.json"
PARAMS = "params.bin"
_ALIGN = 64
_STALE_TEMP_SECS = 3600.0
_DISK_MARGIN = 256 << 20


class CorruptEntryError(Exception):
    """A cache entry failed verification (the message says which check)."""


@dataclasses.dataclass
class CacheEntry:
    path: pathlib.Path
    arrays: dict[str, np.ndarray]
    files: dict[str, bytes]
    meta: dict


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def dtype_from_name(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _crc(buf) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


def _body_crc(body: dict) -> int:
    return _crc(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def _parallel_crcs(views: list) -> list[int]:
    """CRC-32 of each buffer; zlib releases the GIL, so threads use all cores."""
    if len(views) < 2:
        return [_crc(v) for v in views]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_crc, views))


class WeightStore:
    """Entries keyed by a caller-chosen string (a content hash + dtype); see the module docstring."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = pathlib.Path(root) if root is not None else weights_dir() / f"v{VERSION}"

    def entry_path(self, key: str) -> pathlib.Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"invalid cache key {key!r}")
        return self.root / key

    # ------------------------------------------------------------------------------------------ read
    def load(self, key: str) -> CacheEntry | None:
        """The verified entry, or None on a miss. A corrupt entry is deleted (with a warning)."""
        path = self.entry_path(key)
        if not is_folder(path):
            return None
        try:
            return read_entry(path, key)
        except CorruptEntryError as e:
            try:
                discard_dir(path)
                log.warning("preft_jax cache entry %s is corrupt (%s): deleted it; rebuilding it", path, e)
            except OSError as gone:     # a read-only cache: the entry stays, and is never used
                log.warning("preft_jax cache entry %s is corrupt (%s) and cannot be deleted (%s): loading from the "
                            "source instead, as every run will until the entry is removed", path, e,
                            gone.strerror or gone)
            return None

    # ----------------------------------------------------------------------------------------- write
    def store(self, key: str, arrays: Mapping[str, np.ndarray], files: Mapping[str, bytes] | None = None,
              meta: dict | None = None) -> pathlib.Path | None:
        """Write an entry (atomically). Returns its path, or None when it could not be written (the
        reason is warned, or logged once per process for a cache root that cannot be written; the
        caller just goes on uncached)."""
        final = self.entry_path(key)
        files = dict(files or {})
        for name in files:
            if name in (MANIFEST, PARAMS) or "/" in name or name.startswith("."):
                raise ValueError(f"invalid extra file name {name!r}")
        tmp = None
        if unwritable_reason(self.root):
            return None                 # already reported (preft_jax.cache.status)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temps()
            if final.is_dir():
                return final
            if os.path.lexists(final):        # a stray file (or link) where the entry belongs: else every
                os.unlink(final)              # run would convert again and never say why
                log.warning("preft_jax cache: %s was not a cache entry (a file): removed it", final)
            need = sum(np.asarray(a).nbytes for a in arrays.values()) + sum(len(b) for b in files.values())
            free = shutil.disk_usage(self.root).free
            if free < need + _DISK_MARGIN:
                log.warning("preft_jax cache: not caching %s (%d MiB) in %s: only %d MiB free", key, need >> 20,
                            self.root, free >> 20)
                return None
            tmp = temp_sibling(final)
            tmp.mkdir()
            write_entry(tmp, key, arrays, files, meta or {})
            publish_dir(tmp, final)
            tmp = None
            return final
        except OSError as e:
            why = writable_reason(self.root)
            if why:
                report_unwritable(self.root, why)
            else:
                log.warning("preft_jax cache: could not write %s: %s", final, e)
            return None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _remove_stale_temps(self) -> None:
        """Temporary directories left by crashed writers (older than an hour)."""
        now = time.time()
        for p in self.root.iterdir():
            if p.name.startswith((".tmp-", ".trash-")):
                try:
                    if now - p.stat().st_mtime > _STALE_TEMP_SECS:
                        shutil.rmtree(p, ignore_errors=True)
                except OSError:
                    pass

    # ---------------------------------------------------------------------------------------- manage
    def entries(self) -> list[tuple[str, int, dict]]:
        """(key, size in bytes, meta) of every published entry (not verified)."""
        out = []
        if not self.root.is_dir():
            return out
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(".") or not p.is_dir():
                continue
            size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
            try:
                meta = json.loads((p / MANIFEST).read_text(encoding="utf-8"))["body"].get("meta", {})
            except (OSError, ValueError, KeyError, AttributeError):
                meta = {}
            out.append((p.name, size, meta))
        return out

    def clear(self) -> int:
        """Delete every entry; returns how many were removed."""
        n = 0
        if self.root.is_dir():
            for p in list(self.root.iterdir()):
                if p.is_dir() and not p.is_symlink():
                    discard_dir(p)
                    n += not p.name.startswith(".")
                else:                         # stray files (and a writer's leftovers) go too
                    p.unlink(missing_ok=True)
        return n


def write_entry(folder: pathlib.Path, key: str, arrays: Mapping[str, np.ndarray], files: Mapping[str, bytes],
                meta: dict) -> None:
    """Write params.bin, extra files and (last) the manifest into an existing empty folder."""
    tensors, offset = [], 0
    with open(folder / PARAMS, "wb") as f:
        for name, arr in arrays.items():
            arr = np.ascontiguousarray(arr)
            pad = (-offset) % _ALIGN
            f.write(b"\0" * pad)
            offset += pad
            buf = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
            f.write(buf)
            tensors.append({"name": name, "dtype": dtype_name(arr.dtype), "shape": list(arr.shape),
                            "offset": offset, "nbytes": arr.nbytes, "crc32": _crc(buf)})
            offset += arr.nbytes
    file_info = {}
    for name, data in files.items():
        (folder / name).write_bytes(data)
        file_info[name] = {"size": len(data), "crc32": _crc(data)}
    body = {"format": FORMAT, "version": VERSION, "key": key, "meta": meta, "files": file_info,
            "arrays": {"size": offset, "tensors": tensors}}
    (folder / MANIFEST).write_text(json.dumps({"body": body, "crc32": _body_crc(body)}), encoding="utf-8")


def read_entry(folder: pathlib.Path, key: str | None = None) -> CacheEntry:
    """Read and verify an entry; CorruptEntryError names the first failed check."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        body, crc = manifest["body"], manifest["crc32"]
    except FileNotFoundError:
        raise CorruptEntryError(f"{MANIFEST} missing") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptEntryError(f"unreadable {MANIFEST}: {e}") from None
    if not isinstance(body, dict) or _body_crc(body) != crc:
        raise CorruptEntryError(f"{MANIFEST} checksum mismatch")
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CorruptEntryError(f"format {body.get('format')!r} v{body.get('version')!r}, expected {FORMAT} v{VERSION}")
    if key is not None and body.get("key") != key:
        raise CorruptEntryError(f"entry holds key {body.get('key')!r}, expected {key!r}")

    files = {}
    for name, info in body["files"].items():
        try:
            data = (folder / name).read_bytes()
        except OSError as e:
            raise CorruptEntryError(f"file {name}: {e}") from None
        if len(data) != info["size"] or _crc(data) != info["crc32"]:
            raise CorruptEntryError(f"file {name}: size or checksum mismatch")
        files[name] = data

    spec = body["arrays"]
    params_path = folder / PARAMS
    try:
        size = params_path.stat().st_size
    except OSError as e:
        raise CorruptEntryError(f"{PARAMS}: {e}") from None
    if size != spec["size"]:
        raise CorruptEntryError(f"{PARAMS} has {size} bytes, manifest says {spec['size']} (truncated?)")
    # Copy-on-write map: no up-front copy (callers usually copy into device buffers anyway); the
    # arrays are writable, and writes stay private to this process.
    raw = np.memmap(params_path, dtype=np.uint8, mode="c", shape=(size,)) if size else np.zeros(0, np.uint8)
    views = []
    for t in spec["tensors"]:
        lo, n = int(t["offset"]), int(t["nbytes"])
        if lo < 0 or lo + n > size:
            raise CorruptEntryError(f"tensor {t['name']} lies outside {PARAMS}")
        views.append(raw[lo:lo + n])
    for t, got in zip(spec["tensors"], _parallel_crcs(views)):
        if got != t["crc32"]:
            raise CorruptEntryError(f"tensor {t['name']}: checksum mismatch")
    arrays = {}
    for t, v in zip(spec["tensors"], views):
        dt = dtype_from_name(t["dtype"])
        shape = tuple(int(s) for s in t["shape"])
        if int(np.prod(shape, dtype=np.int64)) * dt.itemsize != v.size:
            raise CorruptEntryError(f"tensor {t['name']}: {v.size} bytes do not fit shape {shape} {dt}")
        arrays[t["name"]] = v.view(dt).reshape(shape)
    return CacheEntry(folder, arrays, files, body.get("meta", {}))
