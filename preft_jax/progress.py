"""tqdm progress bars for long loops (weight loading, training, experiments, benchmarks), quiet when
stderr is not a terminal or when asked (`--quiet` on the CLIs).

    for x in progress(items, "loading", total=len(items), quiet=args.quiet): ...
    bar = progress(None, "training", total=steps); bar.update(1); bar.set_postfix(loss=...); bar.close()

`quiet=None` means: show a bar only when stderr is an interactive terminal (and `set_quiet(True)`,
which the training CLIs call for `--quiet`, was not called).
"""
from __future__ import annotations

import sys
from typing import Iterable, TypeVar

T = TypeVar("T")
_QUIET: bool = False


def set_quiet(quiet: bool) -> None:
    """Process-wide default for `quiet=None` callers (a CLI's `--quiet`)."""
    global _QUIET
    _QUIET = bool(quiet)


def enabled(quiet: bool | None = None) -> bool:
    if quiet is None:
        quiet = _QUIET
    return not quiet and bool(getattr(sys.stderr, "isatty", lambda: False)())


class _NoBar:
    """What `progress` returns for a manual bar when quiet: every tqdm method used here, doing nothing."""

    def __init__(self, iterable=None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def set_description(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def progress(iterable: Iterable[T] | None = None, desc: str | None = None, total: int | None = None,
             quiet: bool | None = None, **kwargs):
    """A tqdm bar over `iterable` (or a manual one when None), or the iterable itself / a no-op bar
    when quiet. Extra kwargs go to tqdm (`initial`, `unit`, `leave`, ...)."""
    if not enabled(quiet):
        return iterable if iterable is not None else _NoBar()
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, dynamic_ncols=True, **kwargs)
