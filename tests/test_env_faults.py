"""A new user's environment, hostile or odd: a home that cannot be written, a read-only cache, a
truncated or garbled compiled native library, no (working) C++ compiler, a stale dataset, and the
log noise and CLI friction around them. Every degraded mode runs on with ONE clear line on stderr,
never a traceback or a crash; each case runs the real command in a fresh process with the
environment (HOME, CXX, PATH, cache folder, capabilities) it is about.

As root, permission bits do not stop writes: the read-only cases then drop CAP_DAC_OVERRIDE with
`setpriv` (a non-root user needs nothing), and are skipped where that is impossible."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import stat
import subprocess
import sys
import time
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NATIVE_PROBE = ("from pallas_kernels import cpu; why = cpu.unavailable_reason(); "
                "import json; print(json.dumps(cpu.library_status()))")


def _env(**overrides) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFT_JAX_CACHE_DIR", "XDG_CACHE_HOME", "PREFT_JAX_NO_CACHE", "CXX", "PREFT_CPU_NATIVE")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def _run(args, env, prefix=(), timeout=600, cwd=ROOT):
    return subprocess.run([*prefix, sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _lines(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]


def _no_crash(r):
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def _unprivileged() -> list[str]:
    """A command prefix under which permission bits are enforced (root: drop the override capabilities)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a folder read-only for the test process")
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    probe = subprocess.run([*prefix, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr!r}")
    return prefix


def _read_only(path: pathlib.Path) -> None:
    for p in [path, *path.rglob("*")]:
        mode = p.stat().st_mode
        p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture
def writable_again():
    """Folders to make writable again at teardown (so tmp_path can be removed)."""
    paths = []
    yield paths
    for path in paths:
        for p in [path, *path.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


GENERATE = ["-m", "serve", "generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "3"]


# ------------------------------------------------------------------------------------- caches
def test_home_that_cannot_be_created_degrades_to_no_cache(tmp_path):
    """HOME is a file: no cache folder can ever be made there (the issue's HOME=/nonexistent as user nobody)."""
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    r = _run(GENERATE + ["--cpu-decode", "xla"], _env(HOME=home))
    _no_crash(r)
    assert r.stdout.strip()
    cache = home / ".cache" / "preft_jax"
    assert _lines(r.stderr, "preft_jax cache:") == [
        f"preft_jax cache: cannot create {cache} (Not a directory: {cache / 'jax'}): running without the persistent "
        f"caches (set PREFT_JAX_CACHE_DIR to a writable folder, or PREFT_JAX_NO_CACHE=1 to turn the caches off)"]
    assert "PermissionError" not in r.stderr and "Error writing persistent" not in r.stderr
    info = _run(["-m", "preft_jax.cache", "info"], _env(HOME=home))
    _no_crash(info)
    assert info.stdout.splitlines()[0] == (f"cache root: {cache} (cannot be created: {home} is not a folder; "
                                           f"no caches are used)")


def test_missing_home_under_a_read_only_folder(tmp_path, writable_again):
    prefix = _unprivileged()
    parent = tmp_path / "ro"
    parent.mkdir()
    _read_only(parent)
    writable_again.append(parent)
    home = parent / "nonexistent"
    r = _run(GENERATE + ["--cpu-decode", "xla"], _env(HOME=home), prefix)
    _no_crash(r)
    [line] = _lines(r.stderr, "preft_jax cache:")
    assert line.startswith(f"preft_jax cache: cannot create {home / '.cache' / 'preft_jax'} (Permission denied: ")
    assert not home.exists()


@pytest.mark.slow
def test_read_only_cache_is_reused_with_one_line(tmp_path, writable_again):
    """An existing read-only cache: entries are read, nothing is written, and JAX's per-program
    "Error writing persistent compilation cache entry" warnings (one per new program before) are gone."""
    prefix = _unprivileged()
    cache = tmp_path / "cache"
    r = _run(GENERATE + ["--cpu-decode", "xla"], _env(PREFT_JAX_CACHE_DIR=cache))
    _no_crash(r)
    programs = sorted(p.name for p in (cache / "jax").iterdir())
    assert any(p.startswith("jit__decode_steps-") for p in programs), programs
    assert any(p.startswith("jit__paged_step-") for p in programs), programs
    second = GENERATE + ["--cpu-decode", "xla", "--max-tokens", "5", "--prompt", "a longer prompt, new shapes"]
    writable = tmp_path / "writable-copy"           # the same second run against a writable copy saves new
    shutil.copytree(cache, writable)                # programs: so the read-only run below had writes to refuse
    _no_crash(_run(second, _env(PREFT_JAX_CACHE_DIR=writable)))
    assert set(p.name for p in (writable / "jax").iterdir()) > set(programs)
    _read_only(cache)
    writable_again.append(cache)
    again = _run(second, _env(PREFT_JAX_CACHE_DIR=cache), prefix)
    _no_crash(again)
    assert "Error writing persistent compilation cache" not in again.stderr
    [line] = _lines(again.stderr, "preft_jax cache:")
    assert line.startswith(f"preft_jax cache: {cache} is read-only (Permission denied: {cache / 'jax'}): entries "
                           f"already there are reused, new ones are not saved")
    assert sorted(p.name for p in (cache / "jax").iterdir()) == programs
    info = _run(["-m", "preft_jax.cache"], _env(PREFT_JAX_CACHE_DIR=cache), prefix)
    _no_crash(info)
    assert info.stdout.startswith(f"cache root: {cache} (read-only: Permission denied: {cache}; caches are only read)")


def test_weight_store_under_an_unwritable_root_reports_once(tmp_path, caplog):
    import logging

    import numpy as np

    from preft_jax.cache import WeightStore, status
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    store = WeightStore(blocker / "weights")
    with caplog.at_level(logging.WARNING, logger="preft_jax.cache"):
        assert store.store("k1", {"w": np.ones(3, np.float32)}) is None
        assert store.store("k2", {"w": np.ones(3, np.float32)}) is None
        assert store.load("k1") is None
    assert [r.getMessage() for r in caplog.records] == [
        f"preft_jax cache: cannot create {blocker / 'weights'} (Not a directory: {blocker / 'weights'}): running "
        f"without the persistent caches (set PREFT_JAX_CACHE_DIR to a writable folder, or PREFT_JAX_NO_CACHE=1 to "
        f"turn the caches off)"]
    assert f"cache {blocker / 'weights'} cannot be created: Not a directory: {blocker / 'weights'}" in status()["degraded"]


# ---------------------------------------------------------------------------- native library
@pytest.fixture(scope="module")
def built_library(tmp_path_factory):
    """A cache folder holding a good build of the native library (built once for this module)."""
    cache = tmp_path_factory.mktemp("native") / "cache"
    r = _run(["-c", NATIVE_PROBE], _env(PREFT_JAX_CACHE_DIR=cache))
    _no_crash(r)
    status = json.loads(r.stdout.splitlines()[-1])
    if status["state"] != "loaded":
        pytest.skip(f"the native library does not build here: {status['reason']}")
    [folder] = [p for p in (cache / "cpu_native").iterdir()]
    assert sorted(p.name for p in folder.iterdir()) == ["libpreft_cpu_native.so", "libpreft_cpu_native.so.sha256"]
    assert r.stderr.strip() == ""                     # a clean first build says nothing at WARNING
    return cache, folder.name


def _copy_cache(built, tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    cache, key = built
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    return copy, copy / "cpu_native" / key / "libpreft_cpu_native.so"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_corrupt_cached_library_is_rebuilt(built_library, tmp_path, damage):
    """Loading a truncated .so used to kill the process (bus error); a garbled one kept the native path
    off until deleted by hand. Both are now caught by the checksum and rebuilt, with one line."""
    cache, so = _copy_cache(built_library, tmp_path)
    good = so.read_bytes()
    so.write_bytes(good[:len(good) // 2] if damage == "truncate" else bytes(range(256)) * 40)
    info = _run(["-m", "preft_jax.cache", "info"], _env(PREFT_JAX_CACHE_DIR=cache))
    _no_crash(info)
    [line] = _lines(info.stdout, "libpreft_cpu_native.so")
    assert "this machine's, CORRUPT (libpreft_cpu_native.so (" in line and "does not match its checksum" in line

    damaged_size = so.stat().st_size
    r = _run(["-c", NATIVE_PROBE], _env(PREFT_JAX_CACHE_DIR=cache))
    _no_crash(r)
    assert json.loads(r.stdout.splitlines()[-1])["state"] == "loaded"
    assert r.stderr.splitlines() == [
        f"the cached native CPU library in {so.parent} was rejected (libpreft_cpu_native.so ({damaged_size} bytes) "
        f"does not match its checksum (truncated or overwritten?)); rebuilt it"]
    assert so.stat().st_size > damaged_size or damage == "garble"
    [line] = _lines(_run(["-m", "preft_jax.cache"], _env(PREFT_JAX_CACHE_DIR=cache)).stdout, "libpreft_cpu_native.so")
    assert line.endswith("[this machine's, ok]")
    again = _run(["-c", NATIVE_PROBE], _env(PREFT_JAX_CACHE_DIR=cache))       # the rebuilt copy is trusted
    _no_crash(again)
    assert again.stderr.strip() == ""


@pytest.mark.slow
def test_failing_compiler_falls_back_to_xla_with_one_line(tmp_path):
    """CXX=/bin/false: one line, no key folder left behind, generation runs on the XLA path with the
    same greedy tokens; --cpu-decode native refuses clearly."""
    cache = tmp_path / "cache"
    env = _env(PREFT_JAX_CACHE_DIR=cache, CXX="/bin/false")
    r = _run(GENERATE, env)
    _no_crash(r)
    assert r.stderr.splitlines() == ["cannot build the native CPU library: compiling decode.cc failed: "
                                     "$CXX=/bin/false exited with status 1; native CPU kernels are off in this process"]
    assert [p.name for p in (cache / "cpu_native").iterdir()] == []          # no empty key folder
    xla = _run(GENERATE + ["--cpu-decode", "xla"], _env(PREFT_JAX_CACHE_DIR=cache))
    _no_crash(xla)
    assert r.stdout == xla.stdout
    native = _run(GENERATE + ["--cpu-decode", "native"], env)
    assert native.returncode == 2
    assert native.stderr.splitlines() == [         # the library's line, then the refusal: no "falls back"
        r.stderr.splitlines()[0],
        "error: cpu_decode='native' is unavailable: cannot build the native CPU library: compiling decode.cc "
        "failed: $CXX=/bin/false exited with status 1"]


def test_hanging_compiler_is_killed_with_what_it_started(tmp_path):
    """A compiler wrapper that never returns (a stuck ccache / distcc) used to hang every first start;
    after $PREFT_CPU_NATIVE_BUILD_TIMEOUT it is killed with its children, with one line, and nothing is
    left in the cache."""
    cxx = tmp_path / "stuck-cxx"
    cxx.write_text("#!/bin/sh\nsleep 987\n")                  # the wrapper's child holds its pipes
    cxx.chmod(0o755)
    cache = tmp_path / "cache"
    t0 = time.monotonic()
    r = _run(["-c", NATIVE_PROBE], _env(PREFT_JAX_CACHE_DIR=cache, CXX=cxx, PREFT_CPU_NATIVE_BUILD_TIMEOUT="2"),
             timeout=120)
    _no_crash(r)
    assert time.monotonic() - t0 < 60
    assert json.loads(r.stdout.splitlines()[-1])["state"] == "unavailable"
    assert r.stderr.splitlines() == [f"cannot build the native CPU library: compiling decode.cc failed: $CXX={cxx} did "
                                     f"not finish in 2 s and was killed ($PREFT_CPU_NATIVE_BUILD_TIMEOUT); native "
                                     f"CPU kernels are off in this process"]
    assert [p.name for p in (cache / "cpu_native").iterdir()] == []
    left = subprocess.run(["pgrep", "-f", "sleep 987"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "the wrapper's child outlived the build"
    for raw in ("soon", "inf", "0", "1e300"):                 # inf used to overflow the wait: a traceback
        bad = _run(["-c", NATIVE_PROBE], _env(PREFT_JAX_CACHE_DIR=cache, CXX="/bin/false",
                                              PREFT_CPU_NATIVE_BUILD_TIMEOUT=raw))
        _no_crash(bad)
        assert bad.stderr.splitlines()[0] == (f"PREFT_CPU_NATIVE_BUILD_TIMEOUT={raw!r} is not a number of seconds in "
                                              f"(0, 86400]; using 300")


def test_a_cache_that_cannot_hold_a_loadable_library_builds_a_temporary_one(built_library, tmp_path, monkeypatch):
    """A library that builds in the cache but cannot be loaded from there (a cache on a noexec mount)
    used to be reported as an unwritable cache; it is left out of the cache and one is compiled into
    a temporary folder, which loads (or one error names both failures). A noexec mount seen up front
    skips the cache build."""
    from pallas_kernels.cpu import _build
    cache, so = _copy_cache(built_library, tmp_path)
    good = {p.name: p.read_bytes() for p in so.parent.iterdir()}
    compiles = []

    def copy_the_good_build(folder):                   # stands in for the compiler
        compiles.append(folder)
        for name, data in good.items():
            (folder / name).write_bytes(data)

    real_dlopen = _build._dlopen

    def no_exec_under_cache(path):
        if str(path).startswith(str(cache)):
            raise OSError(f"{path}: failed to map segment from shared object")
        return real_dlopen(path)
    monkeypatch.setenv("PREFT_JAX_CACHE_DIR", str(cache))
    monkeypatch.setattr(_build, "build_key", lambda: so.parent.name)
    monkeypatch.setattr(_build, "_compile_into", copy_the_good_build)
    monkeypatch.setattr(_build, "_dlopen", no_exec_under_cache)
    _, path, how, note = _build._open_library()
    assert how == "temporary" and not str(path).startswith(str(cache))
    assert note == (f"native CPU library: the library built in {so.parent} does not load ({so}: failed to map segment "
                    f"from shared object); compiled it into a temporary folder for this process only")
    assert len(compiles) == 2 and not so.parent.exists()     # the cached copy rejected, one cache build, one temporary

    def no_exec(path):
        raise OSError(f"{path}: failed to map segment from shared object")
    monkeypatch.setattr(_build, "_dlopen", no_exec)
    with pytest.raises(_build.BuildError) as e:
        _build._open_library()
    assert str(e.value).startswith(f"the library built in {so.parent} does not load ({so}: failed to map segment from "
                                   f"shared object); the one compiled into a temporary folder does not load either (")

    compiles.clear()
    monkeypatch.setattr(_build, "_dlopen", real_dlopen)
    monkeypatch.setattr(_build, "_noexec", lambda folder: f"{cache} is on a filesystem mounted noexec")
    _, _, how, note = _build._open_library()
    assert how == "temporary" and len(compiles) == 1 and not so.parent.exists()
    assert note == (f"native CPU library: {cache} is on a filesystem mounted noexec; compiled it into a temporary "
                    f"folder for this process only")


@pytest.mark.slow
def test_a_library_that_matches_its_checksum_but_does_not_load_is_rebuilt(built_library, tmp_path):
    """Garbage with its checksum recomputed (a copy from another system, a bad disk image): it used to
    keep the native path off with a message saying the build failed, though nothing was built."""
    import hashlib
    cache, so = _copy_cache(built_library, tmp_path)
    so.write_bytes(b"not an ELF file" * 100)
    (so.parent / "libpreft_cpu_native.so.sha256").write_text(
        f"{hashlib.sha256(so.read_bytes()).hexdigest()}  libpreft_cpu_native.so\n")
    r = _run(["-c", NATIVE_PROBE], _env(PREFT_JAX_CACHE_DIR=cache))
    _no_crash(r)
    assert json.loads(r.stdout.splitlines()[-1])["state"] == "loaded"
    [line] = r.stderr.splitlines()
    assert line.startswith(f"the cached native CPU library in {so.parent} was rejected (it matches its checksum but "
                           f"does not load: ") and line.endswith("); rebuilt it"), line
    again = _run(["-c", NATIVE_PROBE], _env(PREFT_JAX_CACHE_DIR=cache))
    _no_crash(again)
    assert again.stderr.strip() == ""


def test_no_compiler_on_path(tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    r = _run(["-c", NATIVE_PROBE], _env(PREFT_JAX_CACHE_DIR=tmp_path / "cache", PATH=empty_bin))
    _no_crash(r)
    assert json.loads(r.stdout.splitlines()[-1])["state"] == "unavailable"
    assert r.stderr.splitlines() == ["cannot build the native CPU library: no C++ compiler found ($CXX is unset "
                                     "and none of c++, clang++, g++ is on PATH); native CPU kernels are off in this process"]


def test_unwritable_cache_builds_a_temporary_library(built_library, tmp_path, writable_again):
    prefix = _unprivileged()
    cache = tmp_path / "cache"
    cache.mkdir()
    _read_only(cache)
    writable_again.append(cache)
    r = _run(["-c", NATIVE_PROBE], _env(PREFT_JAX_CACHE_DIR=cache), prefix)
    _no_crash(r)
    status = json.loads(r.stdout.splitlines()[-1])
    assert status["state"] == "temporary"
    assert r.stderr.splitlines() == [f"native CPU library: cannot write {cache / 'cpu_native'} (Permission denied); "
                                     f"compiled it into a temporary folder for this process only"]
    assert list(cache.iterdir()) == []


def test_cache_info_tells_an_unreadable_compilation_cache_from_an_empty_one(tmp_path, writable_again):
    prefix = _unprivileged()
    jax_dir = tmp_path / "cache" / "jax"
    jax_dir.mkdir(parents=True)
    (jax_dir / "entry").write_bytes(b"x" * 4096)
    jax_dir.chmod(0)
    writable_again.append(jax_dir)
    try:
        r = _run(["-m", "preft_jax.cache", "info"], _env(PREFT_JAX_CACHE_DIR=tmp_path / "cache"), prefix)
    finally:
        jax_dir.chmod(0o755)
    _no_crash(r)
    [line] = _lines(r.stdout, "compilation (")
    assert line == (f"compilation ({jax_dir}): 0.0 MiB (cannot be read: Permission denied: {jax_dir}; this process "
                    f"cannot use it)")
    ok = _run(["-m", "preft_jax.cache", "info"], _env(PREFT_JAX_CACHE_DIR=tmp_path / "cache"))
    assert _lines(ok.stdout, "compilation (") == [f"compilation ({jax_dir}): 0.0 MiB"]


def test_cache_clear_removes_the_native_library(built_library, tmp_path):
    cache, _ = _copy_cache(built_library, tmp_path)
    r = _run(["-m", "preft_jax.cache", "clear"], _env(PREFT_JAX_CACHE_DIR=cache))
    _no_crash(r)
    assert r.stdout.startswith("removed 0 weight entries, 1 native library build, ")
    assert list((cache / "cpu_native").iterdir()) == []


# ---------------------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_reports_degraded_modes_once_and_in_health(tmp_path):
    """No cache and no native library: one log line each at start, /health lists both, and the app
    reports the package version."""
    import httpx

    import preft_jax
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    env = _env(HOME=home, CXX="/bin/false", JAX_PLATFORMS=None)            # jax probes its optional backends
    proc = subprocess.Popen([sys.executable, "-m", "serve", "server", "--model", "tiny", "--port", str(port),
                             "--warmup", "none"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (log.seek(0), log.read())[1]
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.5)
        assert health.status_code == 200
        runtime = health.json()["runtime"]
        openapi = httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=10).json()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log.seek(0)
    text = log.read()
    cache = home / ".cache" / "preft_jax"
    assert runtime["compilation_cache"]["state"] == "unavailable"
    assert runtime["native_library"]["state"] == "unavailable"
    assert health.json()["cpu_decode"] == "xla" and health.json()["degraded"] == runtime["degraded"]
    assert len(_lines(text, "native CPU library")) == 1, text           # no second line from the engine
    assert runtime["degraded"] == [
        f"cache {cache} cannot be created: Not a directory: {cache / 'jax'}",
        "native CPU library unavailable: cannot build the native CPU library: compiling decode.cc failed: "
        "$CXX=/bin/false exited with status 1"]
    assert len(_lines(text, "WARNING preft_jax.cache preft_jax cache: cannot create")) == 1
    assert len(_lines(text, "WARNING pallas_kernels.cpu cannot build the native CPU library")) == 1
    assert len(_lines(text, "WARNING")) == 2, text
    assert "Unable to initialize backend" not in text and "Traceback" not in text
    assert openapi["info"]["version"] == preft_jax.__version__


# The real CLI server with two tasks added to serve.warmup's list: one fails once (then passes), one
# fails every time. Nothing else is changed; the log format and /health are the server's.
_FAILING_WARMUP = """
import sys
import serve.engine
real = serve.engine.warmup_tasks
def tasks(runner):
    left = [1]
    def flaky():
        if left[0]:
            left[0] -= 1
            raise RuntimeError("injected flaky failure\\nsecond line")
    def broken():
        raise RuntimeError("injected failure\\nsecond line")
    return [("injected flaky task", flaky)] + real(runner) + [("injected task", broken)]
serve.engine.warmup_tasks = tasks
from serve.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow            # a real server process per case (~16 s each)
@pytest.mark.parametrize("warmup", ["background", "full"])
def test_server_warmup_failure_is_retried_logged_once_and_in_health(tmp_path, warmup):
    """A warm-up task failing once is retried (one WARNING line), one failing twice is skipped (one
    WARNING, then one ERROR line); the server serves (a full warm-up no longer stops its start) and
    /health stays 200 with the skipped shape in warmup_skipped and in degraded."""
    import httpx

    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-c", _FAILING_WARMUP, "server", "--model", "tiny", "--port", str(port),
                             "--warmup", warmup, "--max-model-len", "32", "--max-num-seqs", "2",
                             "--max-prefill-seqs", "1", "--max-num-batched-tokens", "16", "--block-size", "16"],
                            cwd=ROOT, env=_env(PREFT_JAX_CACHE_DIR=tmp_path / "cache"), stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (log.seek(0), log.read())[1]
            try:
                health = httpx.get(f"{url}/health", timeout=5).json()
                if health["warmup_pending"] == 0:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start or warm up"
            time.sleep(0.5)
        r = httpx.get(f"{url}/health", timeout=5)
        completion = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                                timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log.seek(0)
    text = log.read()
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert completion.status_code == 200, completion.text
    health = r.json()
    assert health["warmup_failed"] == 1
    assert health["warmup_skipped"] == ["injected task (RuntimeError: injected failure)"]
    assert health["degraded"] == health["runtime"]["degraded"] + [
        "warm-up skipped injected task (RuntimeError: injected failure)"]
    kind = "background warm-up" if warmup == "background" else "warm-up"
    lines = [ln.split(" ", 2)[2] for ln in text.splitlines() if "warm-up of" in ln]
    assert [ln for ln in lines if "injected" in ln] == [
        f"WARNING serve.engine {kind} of 'injected flaky task' failed (RuntimeError: injected flaky failure); "
        f"retrying it once",
        f"WARNING serve.engine {kind} of 'injected task' failed (RuntimeError: injected failure); retrying it once",
        f"ERROR serve.engine {kind} of 'injected task' failed again (RuntimeError: injected failure); skipped, it "
        f"compiles on first use"]
    assert len(lines) == 3 and "Traceback" not in text and "second line" not in text, text


def test_backend_probe_line_is_dropped():
    code = ("import logging; logging.basicConfig(level=logging.INFO); import sys\n"
            "if sys.argv[1] == 'quiet':\n"
            "    from preft_jax.cache import quiet_backend_probe; quiet_backend_probe()\n"
            "import jax; print(jax.default_backend())")
    loud = _run(["-c", code, "loud"], _env(JAX_PLATFORMS=None))
    if "Unable to initialize backend" not in loud.stderr:
        pytest.skip("jax probes no missing optional backend on this machine")
    quiet = _run(["-c", code, "quiet"], _env(JAX_PLATFORMS=None))
    _no_crash(quiet)
    assert quiet.stdout == loud.stdout and "Unable to initialize backend" not in quiet.stderr


def test_version_comes_from_the_distribution():
    from importlib import metadata

    import preft_jax
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert preft_jax.__version__ == metadata.version("preft-jax") == pyproject["project"]["version"]


# ------------------------------------------------------------------------------ training data
def test_sft_data_defaults_under_out_and_checks_an_existing_dataset(tmp_path):
    from train import cli
    from train.data import DatasetMismatchError, generation_params, prepare_dataset
    from train.sft import _parse

    a = _parse(["--out", str(tmp_path / "run"), "--n-train", "40"])
    assert cli.data_dir(a) == tmp_path / "run" / "data"
    assert a.given == {"n_train": "--n-train 40"} and (a.n_eval, a.seed) == (64, 0)
    assert _parse(["--data", "d"]).given == {}

    folder = tmp_path / "data"
    assert prepare_dataset(folder, generation_params(16, 4, 0), {}) == (
        f"generated the dataset in {folder} (n_train=16, n_eval=4, seed=0, tasks=arithmetic,word, max_ops=3)")
    rows = (folder / "train.jsonl").read_text()
    assert len(rows.splitlines()) == 16
    # defaults differ, but the user set none of them: reused (and said so)
    assert prepare_dataset(folder, generation_params(512, 64, 0), {}).startswith(f"reusing the dataset in {folder}")
    assert prepare_dataset(folder, generation_params(16, 64, 0), {"n_train": "--n-train 16"}).startswith("reusing")
    with pytest.raises(DatasetMismatchError) as e:
        prepare_dataset(folder, generation_params(40, 4, 3), {"n_train": "--n-train 40", "seed": "--seed 3"})
    assert str(e.value) == (
        f"--data {folder} holds a dataset generated with other parameters: n_train=16 (this run: 40, from "
        f"--n-train 40); seed=0 (this run: 3, from --seed 3). Pick another --data (or --out), delete {folder} to "
        f"regenerate it, or drop those flags to reuse it")
    assert (folder / "train.jsonl").read_text() == rows                         # never overwritten

    own = tmp_path / "own"                                                      # a user's dataset: no meta.json
    own.mkdir()
    (own / "train.jsonl").write_text(rows)
    assert prepare_dataset(own, generation_params(512, 64, 0), {}).startswith(f"using the dataset in {own} as it is")
    with pytest.raises(DatasetMismatchError, match=r"holds a dataset without meta.json .*, so --n-eval 3 cannot apply"):
        prepare_dataset(own, generation_params(512, 3, 0), {"n_eval": "--n-eval 3"})
    # --data naming a file (it said "[Errno 17] File exists" from mkdir), nothing written beside it
    for name, hint in (("train.jsonl", f" (a dataset folder holds train.jsonl and eval.jsonl: pass --data {own})"),
                       ("notes.txt", "")):
        (own / name).write_text(rows)
        with pytest.raises(DatasetMismatchError) as e:
            prepare_dataset(own / name, generation_params(16, 4, 0), {})
        assert str(e.value) == f"--data {own / name}: not a folder{hint}"
    assert sorted(p.name for p in own.iterdir()) == ["notes.txt", "train.jsonl"]


def test_sft_cli_refuses_a_stale_dataset_before_loading_anything(tmp_path):
    from train.data import write_dataset
    run = tmp_path / "run"
    write_dataset(run / "data", 16, 4, seed=0)
    r = _run(["-m", "train.sft", "--out", run, "--n-train", "40", "--model", tmp_path / "no-model-needed"],
             _env(PREFT_JAX_CACHE_DIR=tmp_path / "cache"), timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"error: --data {run / 'data'} holds a dataset generated with other parameters: n_train=16 (this run: 40, "
        f"from --n-train 40). Pick another --data (or --out), delete {run / 'data'} to regenerate it, or drop "
        f"those flags to reuse it")
    assert sorted(p.name for p in run.iterdir()) == ["data"]                  # nothing else written


def test_a_malformed_dataset_is_one_line_naming_the_file_and_line(tmp_path):
    """A bad jsonl used to end in `datasets`' chained tracebacks (a bad line: DatasetGenerationError,
    an empty file: a bare StopIteration) or a KeyError at tokenization; now one error naming it."""
    from train.data import DatasetFormatError, load_split
    good = json.dumps({"question": "q", "response": "r", "answer": 1})
    cases = [
        ("bad-json", good + "\n" + '{"question": "unterminated\n',
         "{path}, line 2: not valid JSON (Unterminated string starting at, column 14)"),
        ("not-object", good + "\n\n7\n", "{path}, line 3: a row must be a JSON object, got int"),
        ("missing", good + "\n" + json.dumps({"question": "q"}) + "\n",
         "{path}, line 2: no 'response' field (each row needs 'question', 'response')"),
        ("empty", "\n", "{path} has no rows"),
        ("array", '[{"question": "q",\n "response": "r"}]\n', "{path}, line 1: not valid JSON (Expecting property "
         "name enclosed in double quotes, column 19); a .jsonl file holds one JSON object per line, not a JSON array"),
        ("array-line", '[{"question": "q", "response": "r"}]\n', "{path}, line 1: a row must be a JSON object, got "
         "list; a .jsonl file holds one JSON object per line"),
        ("null", good + "\n" + json.dumps({"question": None, "response": "r"}) + "\n",
         "{path}, line 2: field 'question' must be a string, got null"),
    ]
    for name, text, want in cases:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "train.jsonl").write_text(text)
        with pytest.raises(DatasetFormatError) as e:
            load_split(folder, "train", fields=("question", "response"))
        assert str(e.value) == want.format(path=folder / "train.jsonl"), name
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "train.jsonl").write_bytes(b'{"question": "caf\xe9", "response": "r"}\n')
    with pytest.raises(DatasetFormatError, match=r"train.jsonl: not UTF-8 text \(invalid continuation byte at byte "):
        load_split(tmp_path / "latin1", "train")
    for answer, ok in (([1, 2], True), ({"tests": 3}, True), (True, True), (7, True), (None, False)):
        (tmp_path / "grpo").mkdir(exist_ok=True)                               # a custom reward takes any answer
        (tmp_path / "grpo" / "train.jsonl").write_text(json.dumps({"question": "q", "answer": answer}) + "\n")
        if ok:
            assert len(load_split(tmp_path / "grpo", "train", fields=("question", "answer"),
                                  cache_dir=str(tmp_path / "hf"))) == 1
        else:
            with pytest.raises(DatasetFormatError, match=r"line 1: field 'answer' must be set \(not null\), got null$"):
                load_split(tmp_path / "grpo", "train", fields=("question", "answer"))
    (tmp_path / "bom").mkdir()                                                  # a BOM loads, as datasets allows
    (tmp_path / "bom" / "train.jsonl").write_bytes(b"\xef\xbb\xbf" + good.encode() + b"\n")
    assert len(load_split(tmp_path / "bom", "train", fields=("question", "response"), cache_dir=str(tmp_path / "hf"))) == 1
    (tmp_path / "no-eval").mkdir()
    (tmp_path / "no-eval" / "eval.jsonl").write_text("")
    assert load_split(tmp_path / "no-eval", "eval") == []                      # --n-eval 0: no evaluation
    # through the CLI: one line, before the model loads (the model path does not exist)
    run = tmp_path / "run"
    shutil.copytree(tmp_path / "missing", run / "data")
    (run / "data" / "eval.jsonl").write_text(good + "\n")
    r = _run(["-m", "train.sft", "--out", run, "--model", tmp_path / "no-model-needed"],
             _env(PREFT_JAX_CACHE_DIR=tmp_path / "cache"), timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == (f"error: {run / 'data' / 'train.jsonl'}, line 2: no 'response' field (each "
                                         f"row needs 'question', 'response')")


def test_an_out_folder_that_cannot_be_one_is_one_line(tmp_path, writable_again):
    """--out naming a file, a path under a file, or a read-only folder used to crash with a
    NotADirectoryError / PermissionError traceback at the first write."""
    from train import cli
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError) as e:
        cli.check_run_folder(afile)
    assert str(e.value) == f"--out {afile}: not a folder"
    with pytest.raises(ValueError) as e:
        cli.check_run_folder(afile / "run")
    assert str(e.value) == (f"--out {afile / 'run'}: the run folder cannot be created or written (Not a directory: "
                            f"{afile / 'run'})")
    assert cli.check_run_folder(tmp_path / "a" / "b") == tmp_path / "a" / "b" and list((tmp_path / "a" / "b").iterdir()) == []
    r = _run(["-m", "train.grpo", "--out", afile, "--steps", "1"], _env(PREFT_JAX_CACHE_DIR=tmp_path / "cache"),
             timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == f"error: --out {afile}: not a folder"
    prefix = _unprivileged()
    ro = tmp_path / "ro"
    ro.mkdir()
    _read_only(ro)
    writable_again.append(ro)
    code = f"from train.cli import check_run_folder; check_run_folder({str(ro)!r})"
    r = _run(["-c", code], _env(), prefix)
    assert r.stderr.splitlines()[-1] == (f"train.cli.RunFolderError: --out {ro}: the run folder cannot be created or "
                                         f"written (Permission denied: {ro})")
    sealed = tmp_path / "sealed"                            # a parent that cannot be searched: still the flag named
    sealed.mkdir()
    sealed.chmod(0o600)
    writable_again.append(sealed)
    code = f"from train.cli import check_run_folder; check_run_folder({str(sealed / 'run')!r})"
    r = _run(["-c", code], _env(), prefix)
    sealed.chmod(0o700)
    assert r.stderr.splitlines()[-1].startswith(f"train.cli.RunFolderError: --out {sealed / 'run'}: the run folder "
                                                f"cannot be created or written (Permission denied"), r.stderr


@pytest.mark.slow
def test_resuming_from_a_garbled_checkpoint_ends_in_its_error_line(tmp_path):
    """A garbled array file: the resume used to end in ~150 lines of Orbax / TensorStore traceback, then
    Orbax's threads printed hundreds more while the interpreter tore down; the error line is now last."""
    import numpy as np
    run = tmp_path / "run"
    flags = ["--batch-size", "2", "--eval-batch-size", "2", "--rank", "2", "--n-train", "8", "--n-eval", "2",
             "--quiet", "--out", run]
    env = _env(PREFT_JAX_CACHE_DIR=tmp_path / "cache")
    first = _run(["-m", "train.sft", "--steps", "1", *flags], env, timeout=600)
    _no_crash(first)
    files = [p for p in (run / "checkpoints" / "1" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    big = max(files, key=lambda p: p.stat().st_size)
    big.write_bytes(np.random.default_rng(0).integers(0, 256, big.stat().st_size, dtype=np.uint8).tobytes())
    r = _run(["-m", "train.sft", "--steps", "2", *flags], env, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.splitlines()[-1]
    assert last.startswith(f"error: cannot read checkpoint {run / 'checkpoints' / '1'} (Exception: Encountered error "
                           f"while reading array index: ") and last.endswith(
        "); it may be damaged (an interrupted save, a truncated or edited file): move it away to resume from the step "
        "before it, or use another output folder"), last
    assert "TensorStore details" not in last


def test_main_guard_makes_an_os_error_one_line(capsys):
    from train import cli

    def fails(argv):
        raise NotADirectoryError(20, "Not a directory", "/x/y")
    assert cli.main_guard(fails) == 2
    assert capsys.readouterr().err == ("error: [Errno 20] Not a directory: '/x/y' (NotADirectoryError; "
                                       "PREFT_TRACEBACK=1 shows where)\n")
    from train.grpo import RewardError
    from train.trainer import NonFiniteLossError
    for error in (NonFiniteLossError("step 2: loss nan; the run stopped", 2, "loss"), RewardError("the reward ...")):
        def stops(argv, error=error):
            raise error
        assert cli.main_guard(stops) == 2
        assert capsys.readouterr().err == f"error: {error}\n"          # says it all: no type, no hint


def test_datasets_progress_bars_only_on_a_terminal(tmp_path):
    from train.data import write_dataset
    write_dataset(tmp_path / "d", 8, 2, seed=0)
    code = (f"from train.data import load_split; print(len(load_split({str(tmp_path / 'd')!r}, 'train', "
            f"cache_dir={str(tmp_path / 'hf')!r})))")
    r = _run(["-c", code], _env())
    _no_crash(r)
    assert r.stdout.strip() == "8"
    assert "Generating train split" not in r.stderr and "%|" not in r.stderr, r.stderr


def test_datasets_cache_that_cannot_be_written(tmp_path):
    from train.data import write_dataset
    write_dataset(tmp_path / "d", 8, 2, seed=0)
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    code = f"from train.data import load_split; print(len(load_split({str(tmp_path / 'd')!r}, 'eval')))"
    r = _run(["-c", code], _env(HOME=home, HF_HOME=None, HF_DATASETS_CACHE=None, XDG_CACHE_HOME=None))
    _no_crash(r)
    assert r.stdout.strip() == "2"
    [line] = _lines(r.stderr, "datasets cache")
    assert line.startswith(f"datasets cache {home / '.cache' / 'huggingface' / 'datasets'} cannot be written "
                           f"(Not a directory: ")


# ---------------------------------------------------------------------------------- CLI help
def _parsers():
    import preft_jax.__main__ as chat
    import preft_jax.cache.__main__ as cache_cli
    import serve.__main__ as serve_cli
    from train import grpo, sft
    serve_parser = serve_cli.build_parser()
    subs = next(a for a in serve_parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {"python -m preft_jax": chat.build_parser(), "python -m preft_jax.cache": cache_cli.build_parser(),
            "python -m serve": serve_parser, "python -m serve generate": subs["generate"],
            "python -m serve server": subs["server"], "python -m train.sft": sft.build_parser(),
            "python -m train.grpo": grpo.build_parser()}


@pytest.mark.parametrize("prog", list(_parsers()))
def test_every_flag_has_help_and_shows_its_default(prog):
    parser = _parsers()[prog]
    assert parser.prog == prog
    text = parser.format_help()
    assert text.startswith(f"usage: {prog} ")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.help and action.help.strip(), f"{prog} {action.option_strings or action.dest}: no help"
        shown = action.default not in (None, False, [], argparse.SUPPRESS) and "version" not in action.dest
        if shown and action.option_strings:
            assert "default" in parser._get_formatter()._get_help_string(action), action.option_strings


@pytest.mark.slow
def test_help_names_the_python_m_form_and_the_console_scripts():
    r = _run(["-m", "train.sft", "--help"], _env())
    _no_crash(r)
    assert r.stdout.startswith("usage: python -m train.sft ")
    assert "--n-train N_TRAIN training rows to generate (default: 512)" in " ".join(r.stdout.split())
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"preft-jax": "preft_jax.__main__:console", "preft-serve": "serve.__main__:console",
                       "preft-train": "train.__main__:console"}
    for name, target in scripts.items():
        module, func = target.split(":")
        code = (f"import sys; sys.argv = [{name!r}] + sys.argv[1:]; from {module} import {func}; "
                f"sys.exit({func}())")
        args = ["sft", "--help"] if name == "preft-train" else ["--help"]
        r = _run(["-c", code, *args], _env())
        _no_crash(r)
        expected = "preft-train sft" if name == "preft-train" else name
        assert r.stdout.startswith(f"usage: {expected} "), r.stdout[:200]
    r = _run(["-m", "train"], _env())
    assert r.returncode == 2 and r.stderr.startswith("usage: python -m train {sft,grpo} [flags ...]")


def test_serve_generate_has_cpu_decode():
    parser = _parsers()["python -m serve generate"]
    assert parser.parse_args(["--prompt", "x", "--cpu-decode", "xla"]).cpu_decode == "xla"
    assert parser.parse_args(["--prompt", "x"]).cpu_decode == "auto"


@pytest.mark.parametrize("flag,value,words", [
    ("--reft-rank", "-1", "error: reft_rank (the largest rank a device slot holds; the server's --reft-rank) must be "
                          "an integer >= 1, got -1"),
    ("--lora-rank", "0", "error: lora_rank (the largest rank a device slot holds; the server's --lora-rank) must be "
                         "an integer >= 1, got 0"),
    ("--max-queued", "0", "error: max_queued must be >= 1 (every request waits in the queue first), got 0"),
    ("--host-cache-bytes", "-5", "error: host_cache_bytes (the server's --host-cache-bytes) must be >= 0, got -5"),
])
def test_server_flags_refused_at_startup(tmp_path, flag, value, words):
    """Flags that built a server which crashed (a negative rank: a JAX shape TypeError with a
    traceback) or refused every request (a queue of 0) are one line and status 2 before it listens."""
    r = _run(["-m", "serve", "server", "--model", "tiny", "--port", "1", "--no-warmup", flag, value],
             _env(HOME=tmp_path), timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == words, r.stderr[-2000:]


def test_a_hash_memo_of_another_json_shape_is_a_stale_memo(tmp_path):
    """A memo record that is valid JSON but not an object ([], null) crashed every later run
    (AttributeError); it is a stale memo: the digest is recomputed (hashlib, the reference) and the
    memo rewritten."""
    import hashlib

    from preft_jax.cache.content_hash import _memo_path, content_hash
    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom(4096))
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    memo = tmp_path / "memo"
    assert content_hash(f, memo_dir=memo) == want
    record = _memo_path(f.resolve(), memo)
    for junk in ("[]", "null", "1", '"x"'):
        record.write_text(junk)
        assert content_hash(f, memo_dir=memo) == want
        assert json.loads(record.read_text())["sha256"] == want


def test_cache_paths_that_cannot_be_looked_at_are_absent(tmp_path):
    """pathlib's is_dir() raises for a name too long or a folder above that cannot be entered; the
    cache reports such a root as one that cannot be created (one line), never a traceback."""
    from preft_jax.cache.location import is_folder
    from preft_jax.cache.status import report_unwritable
    long = tmp_path / ("a" * 300)
    assert is_folder(tmp_path) and not is_folder(long) and not is_folder(long / "x")
    r = _run(GENERATE + ["--cpu-decode", "xla"], _env(PREFT_JAX_CACHE_DIR=long))
    _no_crash(r)
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        f"preft_jax cache: cannot create {long} (File name too long: {long / 'jax'}): running without the persistent "
        f"caches (set PREFT_JAX_CACHE_DIR to a writable folder, or PREFT_JAX_NO_CACHE=1 to turn the caches off)"]
    assert report_unwritable(long / "weights", "test") in (True, False)     # in-process too: no exception


def test_an_unusable_jax_compilation_cache_dir_is_one_line(tmp_path):
    """The user's JAX_COMPILATION_CACHE_DIR is a file: the cache line, and not jax's warnings on every
    program it then failed to read."""
    afile = tmp_path / "jccd"
    afile.write_text("")
    r = _run(GENERATE + ["--cpu-decode", "xla"], _env(JAX_COMPILATION_CACHE_DIR=afile, PREFT_JAX_CACHE_DIR=tmp_path / "c"))
    _no_crash(r)
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        f"preft_jax cache: cannot create {afile} (File exists: {afile}): running without the persistent caches (set "
        f"PREFT_JAX_CACHE_DIR to a writable folder, or PREFT_JAX_NO_CACHE=1 to turn the caches off)"]


def test_a_cxx_that_is_not_a_command_line_falls_back_with_one_line(tmp_path):
    r = _run(GENERATE + ["--cpu-decode", "auto"], _env(CXX='g++ "', PREFT_JAX_CACHE_DIR=tmp_path / "c"))
    _no_crash(r)
    assert _lines(r.stderr, "native CPU library") == [
        "cannot build the native CPU library: $CXX='g++ \"' cannot be read as a command (No closing quotation); "
        "native CPU kernels are off in this process"]


@pytest.mark.parametrize("args,line", [
    (["-m", "preft_jax", "hi", "--top-p", "0"], "error: --top-p must be in (0, 1], got 0.0"),
    (["-m", "preft_jax", "hi", "--temperature", "nan"], "error: --temperature must be a finite number, got nan"),
    (["-m", "preft_jax", "hi", "--seed", str(2 ** 70)],
     f"error: --seed must fit in 64 bits (a signed integer), got {2 ** 70}"),
    (GENERATE[:-1] + ["99999999999"], "error: --max-tokens must be in [1, 2147483647], got 99999999999"),
    (GENERATE + ["--temperature", "inf"], "error: --temperature must be a finite number, got inf"),
    (["-m", "serve", "server", "--model", "tiny", "--port", "99999"], "error: --port must be in [0, 65535], got 99999"),
    (["-m", "serve", "server", "--model", "tiny", "--host", "192.0.2.1"],          # TEST-NET: not this machine's
     "error: --host 192.0.2.1 --port 8000: cannot listen there (Cannot assign requested address)"),
    (["-m", "benchmarks.decode_dispatch", "--calls", "0"],
     "decode_dispatch.py: error: argument --calls: must be >= 1, got 0"),
])
def test_bad_flag_values_are_one_line(tmp_path, args, line):
    """Sampling flags are checked before the model loads (they were SamplingError / OverflowError
    tracebacks), the server's port before it binds (99999 bound port 34463), a benchmark's counts by
    argparse (a StatisticsError traceback)."""
    r = _run(args, _env(HOME=tmp_path), timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == line, r.stderr[-2000:]


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    """The server binds its port first (it bound after loading the model and warming up: minutes, then
    uvicorn's "address already in use" and exit 3)."""
    import socket
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()                                      # another server on it
    port = held.getsockname()[1]
    try:
        r = _run(["-m", "serve", "server", "--model", str(tmp_path / "no-such-model"), "--port", str(port)],
                 _env(HOME=tmp_path), timeout=300)
    finally:
        held.close()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [          # the model (which does not exist) was never looked at
        f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)"]
