"""Crash- and race-safe file and directory publication (write to a temporary name, then rename)."""
from __future__ import annotations

import os
import pathlib
import shutil
import uuid


def temp_sibling(path: pathlib.Path, tag: str = "tmp") -> pathlib.Path:
    """A unique hidden name next to `path` (same filesystem, so rename is atomic)."""
    return path.parent / f".{tag}-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the complete new one."""
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def publish_dir(tmp_dir: pathlib.Path, final: pathlib.Path) -> bool:
    """Rename a fully written `tmp_dir` to `final`. False (and `tmp_dir` removed) if `final` already
    exists, i.e. a concurrent writer published first; its entry is kept."""
    try:
        os.rename(tmp_dir, final)
        return True
    except OSError:
        if final.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
            return False
        raise


def discard_dir(path: pathlib.Path) -> None:
    """Remove a directory tree, first renaming it away so no reader ever sees it half-deleted."""
    trash = temp_sibling(path, "trash")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return                       # someone else removed it already
    shutil.rmtree(trash, ignore_errors=True)
