"""tqdm progress bars for slow first-run work, quiet when stderr is not a terminal (see preft_jax.progress)."""
from __future__ import annotations

from typing import Iterable, TypeVar

from preft_jax.progress import enabled

T = TypeVar("T")


def progress_enabled(progress: bool | None) -> bool:
    """`None` means: show a bar only when stderr is an interactive terminal (and not set quiet)."""
    if progress is None:
        return enabled(None)
    return bool(progress)


def progress_bar(items: Iterable[T], progress: bool | None, **kwargs) -> Iterable[T]:
    if not progress_enabled(progress):
        return items
    from tqdm import tqdm
    return tqdm(items, leave=False, dynamic_ncols=True, **kwargs)
