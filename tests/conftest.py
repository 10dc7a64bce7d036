"""Shared fixtures. Heavy ones (the real SmolLM2 model, the HF torch reference) are session-scoped."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests never touch the user's cache (~/.cache/preft_jax): load_model's weight cache goes to a temp dir.
if "PREFT_JAX_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["PREFT_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="preft_jax_test_cache_")
    atexit.register(shutil.rmtree, os.environ["PREFT_JAX_CACHE_DIR"], True)
# JAX's persistent compilation cache, shared by the run's processes (pytest-xdist workers and the
# servers / CLIs the tests start inherit PREFT_JAX_CACHE_DIR): a program compiled by one test module is
# loaded, not recompiled, by the next module (after its `jax.clear_caches()`), by another engine instance
# or by the other worker. PREFT_JAX_TEST_XLA_CACHE=DIR keeps it in DIR across runs (the inner loop's
# second run recompiles almost nothing); =off turns it off.
_xla_cache = os.environ.get("PREFT_JAX_TEST_XLA_CACHE", "")
if _xla_cache.lower() != "off":
    from preft_jax.cache.compilation import enable_compilation_cache
    enable_compilation_cache(_xla_cache or os.path.join(os.environ["PREFT_JAX_CACHE_DIR"], "jax"))


def _default_gguf_or_skip() -> str:
    from preft_jax.loading.default_model import default_model_path
    return str(default_model_path())


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    return _default_gguf_or_skip()


# `hf_reference` tests need the torch CPU reference; without it they skip, naming what is missing.
HF_REFERENCE_MODULES = ("torch", "transformers")


def hf_missing_reason(*names: str) -> str | None:
    """Why a test needing these reference packages cannot run here (None: it can)."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    return (f"HF reference: {', '.join(missing)} not installed (pip install -e '.[test]')") if missing else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test using the `hf_reference` / `hf_tokenizer` fixture is an hf_reference test, marked or not (so that
    `-m "not hf_reference"` deselects it)."""
    for item in items:
        uses_hf = {"hf_reference", "hf_tokenizer"} & set(getattr(item, "fixturenames", ()))
        if uses_hf and item.get_closest_marker("hf_reference") is None:
            item.add_marker(pytest.mark.hf_reference)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("hf_reference") is not None:
        reason = hf_missing_reason(*HF_REFERENCE_MODULES)
        if reason:
            pytest.skip(reason)


@pytest.fixture(scope="session")
def hf_tokenizer(default_gguf_path):
    """The HF tokenizer loaded from the GGUF file (~4 s; tokenizer tests need no HF model, ~13 s more)."""
    reason = hf_missing_reason(*HF_REFERENCE_MODULES)
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer
    folder, name = os.path.split(default_gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_reference(default_gguf_path, hf_tokenizer):
    """(transformers model in float32, HF tokenizer) loaded from the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(default_gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model, hf_tokenizer


@pytest.fixture(scope="session")
def default_model():
    """(ModelConfig, params dict of numpy arrays, Tokenizer) from the embedded GGUF."""
    from preft_jax.loading.gguf_loader import load_gguf
    return load_gguf(_default_gguf_or_skip())


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop jitted executables after each test module: the suite runs in one process and compiles
    thousands of programs (every engine bucket, every backend), which otherwise accumulate."""
    yield
    import gc
    import sys
    gc.unfreeze()          # an engine's warm-up froze the heap (EngineConfig.freeze_gc): collectable again
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def cheap_codegen():
    """XLA's CPU backend at optimization level 0 for this module (`jax_disable_most_optimizations`;
    `pytestmark = pytest.mark.usefixtures("cheap_codegen")`): compiling takes ~30% less, the code
    runs slower. For modules that compile many small programs and run them briefly (the tiny-model
    engine tests: test_paged_engine.py 173 s -> 121 s alone); the HLO passes are the same, and the
    persistent compilation cache keys programs by these options, so none is shared with the other
    modules' optimized builds."""
    import jax
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="module", params=["native", pytest.param("xla", marks=pytest.mark.slow)])
def cpu_decode(request) -> str:
    """The engine's CPU decode path (`EngineConfig.cpu_decode`): engine test modules run over both,
    "native" (the one-call native base decode step, what "auto" picks on CPU) and "xla" (marked slow:
    the fast suite keeps one run of each test)."""
    if request.param == "native":
        from pallas_kernels import cpu
        if not cpu.available():
            pytest.skip(f"native CPU decode unavailable: {cpu.unavailable_reason()}")
    return request.param


# pytest-xdist (`-n auto --dist loadfile`, pyproject.toml): the test files whose tests take the session
# `hf_reference` fixture (the HF model converted from the GGUF, ~13 s on an idle core) form one work
# unit, so one worker builds it instead of each. Found by reading the files, so a new such file joins.
# A worker that runs low takes the costliest unit left (tests/file_costs.py: the files' seconds in a
# recorded run), not xdist's next by number of tests, which left the one-test soak file for last.
_HF_MODEL_TEST = re.compile(r"def test_\w+\([^)]*\bhf_reference\b")


def _hf_model_files() -> frozenset[str]:
    here = pathlib.Path(__file__).parent
    return frozenset(str(f.relative_to(here.parent)) for f in here.rglob("test_*.py")
                     if _HF_MODEL_TEST.search(f.read_text(encoding="utf-8")))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    import file_costs
    hf_files = _hf_model_files()
    cost = file_costs.cost_of(file_costs.load())

    class HFGroupedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "hf_reference-files" if file in hf_files else file

        def _assign_work_unit(self, node) -> None:
            units = {scope: {nodeid.split("::")[0] for nodeid in tests} for scope, tests in self.workqueue.items()}
            self.workqueue.move_to_end(file_costs.heaviest(units, cost), last=False)   # xdist pops the first
            super()._assign_work_unit(node)

    return HFGroupedFileScheduling(config, log)
