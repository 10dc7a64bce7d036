"""Weight cache (content-addressed, verified, concurrent-safe), content hash memo, compilation cache."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from preft_jax.cache import content_hash, sha256_file
from preft_jax.cache.weights import MANIFEST, PARAMS, CorruptEntryError, WeightStore, read_entry
from preft_jax.config import ModelConfig, RopeScaling, tiny_config
from preft_jax.loading import cached as cached_mod
from preft_jax.loading import load_model
from preft_jax.loading.gguf_loader import load_gguf
from tiny_gguf import write_tiny_gguf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PREFT_JAX_CACHE_DIR", str(root))
    monkeypatch.delenv("PREFT_JAX_NO_CACHE", raising=False)
    return root


@pytest.fixture
def gguf_path(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=3)
    return path


def _entries(root):
    store_root = cached_mod.default_store().root
    return [p for p in store_root.iterdir() if not p.name.startswith(".")] if store_root.is_dir() else []


def _assert_same_model(a, b):
    (c1, p1, t1), (c2, p2, t2) = a, b
    assert c1 == c2
    assert set(p1) == set(p2)
    for k in p1:
        assert p1[k].dtype == p2[k].dtype and p1[k].shape == p2[k].shape, k
        np.testing.assert_array_equal(p1[k], p2[k], err_msg=k)
    msgs = [{"role": "user", "content": "the theme, 12 ünïcode <|im_end|>"}]
    assert t1.encode_chat(msgs) == t2.encode_chat(msgs)
    assert (t1.bos_token_id, t1.eos_token_ids, t1.pad_token_id) == (t2.bos_token_id, t2.eos_token_ids, t2.pad_token_id)


def _forbid_gguf_loading(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("cache miss: the GGUF was dequantized again")
    monkeypatch.setattr("preft_jax.loading.gguf_loader.load_gguf", boom)


# ------------------------------------------------------------------------------------------ hits
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_cache_hit_gives_identical_model(cache_env, gguf_path, monkeypatch, dtype):
    import ml_dtypes
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    reference = load_gguf(gguf_path, dtype=dt)
    first = load_model(gguf_path, dtype=dt)                 # miss: dequantize + write
    assert len(_entries(cache_env)) == 1
    _forbid_gguf_loading(monkeypatch)
    second = load_model(gguf_path, dtype=dt)                # hit
    _assert_same_model(reference, first)
    _assert_same_model(reference, second)
    assert second[1]["wq"].dtype == np.dtype(dt)
    second[1]["wq"][0, 0, 0] = 123.0                         # copy-on-write: the entry stays intact
    _assert_same_model(reference, load_model(gguf_path, dtype=dt))


def test_dtype_is_part_of_the_key(cache_env, gguf_path):
    import ml_dtypes
    load_model(gguf_path, dtype=np.float32)
    load_model(gguf_path, dtype=ml_dtypes.bfloat16)
    assert len(_entries(cache_env)) == 2


def test_no_cache_writes_nothing(cache_env, gguf_path, monkeypatch):
    load_model(gguf_path, cache=False)
    assert not cache_env.exists()
    monkeypatch.setenv("PREFT_JAX_NO_CACHE", "1")
    load_model(gguf_path)
    assert not cache_env.exists()


# ------------------------------------------------------------------------------------ corruption
def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "params_bitflip": lambda e: _flip_byte(e / PARAMS, (e / PARAMS).stat().st_size // 2),
    "params_truncated": lambda e: os.truncate(e / PARAMS, (e / PARAMS).stat().st_size - 100),
    "params_missing": lambda e: (e / PARAMS).unlink(),
    "manifest_truncated": lambda e: os.truncate(e / MANIFEST, (e / MANIFEST).stat().st_size // 2),
    "manifest_edited": lambda e: (e / MANIFEST).write_text(
        (e / MANIFEST).read_text().replace('"shape": [2, 64, 64]', '"shape": [2, 64, 32]', 1)),
    "manifest_missing": lambda e: (e / MANIFEST).unlink(),
    "tokenizer_bitflip": lambda e: _flip_byte(e / "tokenizer.json", 100),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_entry_is_detected_deleted_and_rebuilt(cache_env, gguf_path, kind, caplog):
    reference = load_gguf(gguf_path)
    load_model(gguf_path)
    (entry,) = _entries(cache_env)
    read_entry(entry)                                          # valid before
    CORRUPTIONS[kind](entry)
    with pytest.raises(CorruptEntryError):
        read_entry(entry)
    with caplog.at_level(logging.WARNING, logger="preft_jax.cache"):
        got = load_model(gguf_path)
    [line] = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert line.startswith(f"preft_jax cache entry {entry} is corrupt (") and line.endswith("): deleted it; rebuilding it")
    _assert_same_model(reference, got)
    (rebuilt,) = _entries(cache_env)
    read_entry(rebuilt)                                        # valid again
    leftovers = [p.name for p in rebuilt.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_store_round_trip_and_edge_cases(tmp_path, caplog):
    store = WeightStore(tmp_path / "s")
    arrays = {"a": np.arange(7, dtype=np.int16), "empty": np.zeros((0, 3), np.float32),
              "b": np.random.default_rng(0).standard_normal((3, 5)).astype(np.float64)}
    assert store.store("k1", arrays, files={"x.txt": b"hello"}, meta={"m": 1}) is not None
    hit = store.load("k1")
    assert hit.meta == {"m": 1} and hit.files == {"x.txt": b"hello"}
    for k, v in arrays.items():
        assert hit.arrays[k].dtype == v.dtype and hit.arrays[k].shape == v.shape
        np.testing.assert_array_equal(hit.arrays[k], v)
    assert store.load("missing") is None
    with pytest.raises(ValueError):
        store.entry_path("../evil")
    # an entry published under another key name is rejected
    os.rename(store.entry_path("k1"), store.entry_path("k2"))
    with caplog.at_level(logging.WARNING, logger="preft_jax.cache"):
        assert store.load("k2") is None
    assert "expected 'k2'" in caplog.text and not store.entry_path("k2").exists()


# ---------------------------------------------------------------------------- concurrent writers
_WRITER = textwrap.dedent("""
    import os, sys, time, pathlib
    sys.path.insert(0, {repo!r})
    import numpy as np
    import preft_jax.cache.weights as w
    from preft_jax.cache import atomic
    me, other = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    real_publish = atomic.publish_dir
    def publish_after_both_wrote(tmp, final):
        me.touch()                                   # my temp entry is complete
        deadline = time.time() + 60
        while not other.exists() and time.time() < deadline:
            time.sleep(0.01)
        return real_publish(tmp, final)
    w.publish_dir = publish_after_both_wrote
    arrays = {{"x": np.arange(200_000, dtype=np.float32) * float(sys.argv[3])}}
    path = w.WeightStore(sys.argv[4]).store("key", arrays, meta={{"writer": sys.argv[3]}})
    print(path)
""")


def test_two_concurrent_writers_leave_one_valid_entry(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(repo=REPO))
    root = tmp_path / "store"
    a, b = tmp_path / "a.ready", tmp_path / "b.ready"
    procs = [subprocess.Popen([sys.executable, str(script), str(me), str(other), str(i + 1), str(root)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, (me, other) in enumerate(((a, b), (b, a)))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert a.exists() and b.exists()                        # both really wrote before publishing
    entry = WeightStore(root).load("key")
    writer = entry.meta["writer"]
    np.testing.assert_array_equal(entry.arrays["x"], np.arange(200_000, dtype=np.float32) * float(writer))
    assert sorted(p.name for p in root.iterdir()) == ["key"]   # loser's temp dir removed


def test_two_processes_load_the_same_model_concurrently(cache_env, gguf_path):
    code = (f"import sys; sys.path.insert(0, {REPO!r}); from preft_jax.loading import load_model; "
            f"c, p, t = load_model({str(gguf_path)!r}); print(float(p['wq'].sum()))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ}) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    want = float(load_gguf(gguf_path)[1]["wq"].sum())
    assert [float(o[0]) for o in outs] == [want, want]
    (entry,) = _entries(cache_env)
    read_entry(entry)


# ------------------------------------------------------------------------------------------ keys
def test_key_is_the_content_hash(cache_env, tmp_path, gguf_path):
    k1 = cached_mod.gguf_cache_key(gguf_path, np.float32)
    assert k1.startswith(sha256_file(gguf_path))
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(gguf_path.read_bytes())
    assert cached_mod.gguf_cache_key(copy, np.float32) == k1        # same bytes, other path: same key
    write_tiny_gguf(gguf_path, seed=4)                                # new content
    k2 = cached_mod.gguf_cache_key(gguf_path, np.float32)
    assert k2 != k1 and k2.startswith(sha256_file(gguf_path))
    load_model(gguf_path)
    _assert_same_model(load_gguf(gguf_path), load_model(gguf_path))


def test_hash_memo_is_invalidated_by_a_same_size_edit(tmp_path):
    f = tmp_path / "m.bin"
    f.write_bytes(b"a" * 1000)
    memo = tmp_path / "memo"
    h1 = content_hash(f, memo_dir=memo)
    assert len(list(memo.iterdir())) == 1
    assert content_hash(f, memo_dir=memo) == h1
    st = f.stat()
    f.write_bytes(b"b" * 1000)                                       # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert content_hash(f, memo_dir=memo) == sha256_file(f) != h1
    # a forged memo record for a different stat is ignored
    rec = next(memo.iterdir())
    data = json.loads(rec.read_text())
    data["sha256"] = "0" * 64
    data["size"] += 1
    rec.write_text(json.dumps(data))
    assert content_hash(f, memo_dir=memo) == sha256_file(f)


# --------------------------------------------------------------------------------- serialization
def test_model_config_dict_round_trip():
    for cfg in (tiny_config(), tiny_config(rope_scaling=RopeScaling(factor=4.0), qkv_bias=True,
                                           tie_embeddings=False, eos_token_ids=(2, 5))):
        d = json.loads(json.dumps(cfg.to_dict()))
        assert ModelConfig.from_dict(d) == cfg
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.from_dict({**tiny_config().to_dict(), "bogus": 1})


def test_tokenizer_json_round_trip(gguf_path):
    from preft_jax.tokenizer import Tokenizer
    _, _, tok = load_gguf(gguf_path)
    tok2 = Tokenizer.from_json(tok.to_json())
    for text in ("the theme", "<|im_start|>user\nhé 42<|im_end|>", ""):
        assert tok.encode(text) == tok2.encode(text)
        assert tok2.decode(tok2.encode(text), skip_special_tokens=False) == text
    assert tok2.chat_template == tok.chat_template and tok2.special_token_ids == tok.special_token_ids


# --------------------------------------------------------------------------------- compilation
def test_compilation_cache_persists_small_programs(tmp_path):
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {REPO!r})
        import jax, jax.numpy as jnp
        from preft_jax.cache import enable_compilation_cache
        print(enable_compilation_cache({str(tmp_path / 'jc')!r}))
        jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "jc").is_dir() and any((tmp_path / "jc").iterdir())


def test_import_flax_quickly_does_not_import_ipython():
    code = ("import sys; sys.path.insert(0, %r); from preft_jax.cache.startup import import_flax_quickly; "
            "import_flax_quickly(); import flax.nnx; print('IPython' in sys.modules)" % REPO)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_corrupt_entry_that_cannot_be_deleted_says_so_in_one_line(tmp_path, caplog, monkeypatch):
    """In a read-only cache the entry stays: the line used to say "deleting it and rebuilding" (as a
    two-line UserWarning) though nothing was deleted."""
    import preft_jax.cache.weights as weights
    store = WeightStore(tmp_path / "s")
    store.store("k", {"a": np.arange(4, dtype=np.float32)})
    entry = store.entry_path("k")
    _flip_byte(entry / weights.PARAMS, 3)

    def read_only(path):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(weights, "discard_dir", read_only)
    with caplog.at_level(logging.WARNING, logger="preft_jax.cache"):
        assert store.load("k") is None
    [line] = caplog.messages
    assert line.startswith(f"preft_jax cache entry {entry} is corrupt (") and line.endswith(
        ") and cannot be deleted (Permission denied): loading from the source instead, as every run will until the "
        "entry is removed")
    assert entry.is_dir()


@pytest.mark.parametrize("home, xdg", [("", None), (".", None), ("relative/dir", ""), ("/h", "rel"), ("/h", "/x"),
                                       (None, None)])
def test_cache_root_never_lands_in_the_working_folder(monkeypatch, tmp_path, home, xdg):
    """An empty or relative HOME (or a relative XDG_CACHE_HOME, which the XDG spec says to ignore) used to
    put the caches under whatever folder the command ran in; the native library's mirror of the root
    (pallas_kernels cannot import preft_jax) gives the same folder."""
    import pwd

    from pallas_kernels.cpu import _build
    from preft_jax.cache import location
    monkeypatch.delenv("PREFT_JAX_CACHE_DIR", raising=False)
    for key, value in (("HOME", home), ("XDG_CACHE_HOME", xdg)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    root = location.cache_root()
    assert root.is_absolute()
    want = ("/x" if xdg == "/x" else
            f"{'/h' if home == '/h' else pwd.getpwuid(os.getuid()).pw_dir}/.cache") + "/preft_jax"
    assert str(root) == want
    assert _build.libraries_dir() == root / "cpu_native"


def test_a_truncated_gguf_says_so(tmp_path):
    """A GGUF cut short used to fail with only numpy's reshape error, no hint at the file."""
    from preft_jax.loading.gguf_loader import load_gguf
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole, seed=3)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 2 // 3])
    with pytest.raises(ValueError) as e:
        load_gguf(cut)
    assert str(e.value).startswith(f"Could not parse GGUF file {cut} ({cut.stat().st_size} bytes: truncated or "
                                   f"damaged?): ")


def test_without_any_home_the_cache_is_a_private_temporary_folder_or_none(monkeypatch, tmp_path):
    """No usable HOME and no password-database entry: `<tmp>/preft_jax-<uid>`, made mode 0700; when that
    folder is someone else's or writable by others (a planted one), a path that cannot be created (the
    caches then run without persistence) - never a folder another user controls."""
    import pwd
    import stat
    import tempfile

    from pallas_kernels.cpu import _build
    from preft_jax.cache import location
    monkeypatch.delenv("PREFT_JAX_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "")

    def no_entry(uid):
        raise KeyError(uid)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    private = tmp_path / f"preft_jax-{os.getuid()}"
    assert location.cache_root() == private / ".cache" / "preft_jax"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert _build.libraries_dir() == location.cache_root() / "cpu_native"
    private.chmod(0o777)                                    # as a folder another user made for us would be
    root = location.cache_root()
    assert str(root).startswith(os.devnull + "/") and _build.libraries_dir() == root / "cpu_native"
    assert location.writable_reason(root)                   # cannot be created: no persistent caches


def test_a_file_where_an_entry_belongs_is_replaced_and_cleared(tmp_path, caplog):
    """A stray file at an entry's path made every store silently drop the entry (the path existed):
    each run converted the model again and said nothing. It is removed with one line and the entry
    written; `clear` removes stray files too."""
    store = WeightStore(tmp_path / "s")
    arrays = {"a": np.arange(5, dtype=np.float32)}
    store.root.mkdir(parents=True)
    store.entry_path("k").write_bytes(b"junk")
    assert store.load("k") is None
    with caplog.at_level(logging.WARNING, logger="preft_jax.cache"):
        assert store.store("k", arrays) == store.entry_path("k")
    assert [r.getMessage() for r in caplog.records if "not a cache entry" in r.getMessage()] == [
        f"preft_jax cache: {store.entry_path('k')} was not a cache entry (a file): removed it"]
    np.testing.assert_array_equal(store.load("k").arrays["a"], arrays["a"])
    (store.root / "stray").write_bytes(b"x")
    assert store.clear() == 1 and list(store.root.iterdir()) == []
