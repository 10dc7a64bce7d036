"""`python -m preft_jax.cache [info|clear]`: show or delete preft_jax's caches."""
from __future__ import annotations

import argparse
import shutil
import sys

from preft_jax.cache.location import cache_root, compilation_dir, hashes_dir, weights_dir
from preft_jax.cache.weights import WeightStore


def _dir_size(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m preft_jax.cache", description=__doc__)
    ap.add_argument("action", nargs="?", default="info", choices=("info", "clear"))
    args = ap.parse_args(argv)
    stores = [WeightStore(d) for d in sorted(weights_dir().iterdir()) if d.is_dir()] if weights_dir().is_dir() else []
    if args.action == "clear":
        n = sum(s.clear() for s in stores)
        shutil.rmtree(compilation_dir(), ignore_errors=True)
        shutil.rmtree(hashes_dir(), ignore_errors=True)
        print(f"removed {n} weight entr{'y' if n == 1 else 'ies'}, the compilation cache and the hash memo "
              f"under {cache_root()}")
        return 0
    print(f"cache root: {cache_root()}")
    entries = [e for s in stores for e in s.entries()]
    print(f"weights ({weights_dir()}): {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    for key, size, meta in entries:
        print(f"  {size / 2**20:9.1f} MiB  {meta.get('source', '?')}  [{meta.get('dtype', '?')}]  {key[:16]}...")
    print(f"compilation ({compilation_dir()}): {_dir_size(compilation_dir()) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
