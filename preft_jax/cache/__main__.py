"""`python -m preft_jax.cache [info|clear]` (or `preft-jax cache ...`): show or delete preft_jax's caches:
dequantized weights, JAX's compiled programs, the content-hash memo and the compiled native CPU library."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from preft_jax.cache.location import cache_root, compilation_dir, hashes_dir, native_dir, weights_dir, writable_reason
from preft_jax.cache.weights import WeightStore


def _dir_size(path) -> tuple[int, str]:
    """(bytes of the files under `path`, "" or what could not be read: an unreadable folder is not
    an empty one)."""
    if not os.path.isdir(path):
        return 0, ""
    errors, total = [], 0
    for folder, _, files in os.walk(path, onerror=errors.append):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:       # evicted since it was listed
                pass
            except OSError as e:
                errors.append(e)
    if not errors:
        return total, ""
    e = errors[0]
    more = f" and {len(errors) - 1} more" if len(errors) > 1 else ""
    return total, f"{e.strerror or e}: {e.filename}{more}"


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _clear(stores) -> int:
    from pallas_kernels.cpu import clear_cached_libraries
    try:
        n = sum(s.clear() for s in stores)
        n_native = clear_cached_libraries()
        for d in (compilation_dir(), hashes_dir()):
            shutil.rmtree(d, ignore_errors=True)
    except OSError as e:
        print(f"error: cannot clear the cache under {cache_root()}: {e}", file=sys.stderr)
        return 1
    left = [str(d) for d in (compilation_dir(), hashes_dir()) if d.exists()]
    print(f"removed {_plural(n, 'weight entry', 'weight entries')}, {_plural(n_native, 'native library build', 'native library builds')}, "
          f"the compilation cache and the hash memo under {cache_root()}")
    if left:
        print(f"error: could not remove {', '.join(left)}", file=sys.stderr)
        return 1
    return 0


def _root_state(root) -> str:
    """Whether the cache root can be written, without creating it."""
    if root.is_dir():
        why = writable_reason(root)
        return f"read-only: {why}; caches are only read" if why else "writable"
    parent = root
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    why = f"{parent} is not a folder" if not parent.is_dir() else writable_reason(parent)
    return f"cannot be created: {why}; no caches are used" if why else "missing (created on first use)"


def _info(stores) -> int:
    from pallas_kernels.cpu import cached_libraries
    root = cache_root()
    state = _root_state(root)
    print(f"cache root: {root} ({state})")
    entries = [e for s in stores for e in s.entries()]
    print(f"weights ({weights_dir()}): {_plural(len(entries), 'entry', 'entries')}")
    for key, size, meta in entries:
        print(f"  {size / 2**20:9.1f} MiB  {meta.get('source', '?')}  [{meta.get('dtype', '?')}]  {key[:16]}...")
    size, unreadable = _dir_size(compilation_dir())
    print(f"compilation ({compilation_dir()}): {size / 2**20:.1f} MiB"
          + (f" (cannot be read: {unreadable}; this process cannot use it)" if unreadable else ""))
    libs = cached_libraries()
    print(f"native CPU library ({native_dir()}): {_plural(len(libs), 'build', 'builds')}")
    for lib in libs:
        status = "ok" if lib["status"] == "ok" else f"CORRUPT ({lib['status']}; rebuilt on next use)"
        which = "this machine's" if lib["current"] else "stale (other source, jaxlib or CPU)"
        print(f"  {lib['size'] / 2**20:9.2f} MiB  {lib['path']}  [{which}, {status}]")
    return 0


def build_parser(prog: str = "python -m preft_jax.cache") -> argparse.ArgumentParser:
    from preft_jax.cli_help import HelpFormatter
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("action", nargs="?", default="info", choices=("info", "clear"),
                    help="info: list the caches, their sizes and state; clear: delete them")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    stores = [WeightStore(d) for d in sorted(weights_dir().iterdir()) if d.is_dir()] if weights_dir().is_dir() else []
    return _clear(stores) if args.action == "clear" else _info(stores)


if __name__ == "__main__":
    sys.exit(main())
