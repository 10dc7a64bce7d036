"""Adapter loads belong to the registration and the requests that asked for them: a reload that
finishes after its name was unloaded and registered again from another folder puts nothing back; a
request whose adapter keeps failing to load fails with that error after a few spaced tries (not a
new load per engine step until its deadline); a request that gives up waiting for a load gets 504
and cancels nothing another request waits on."""
import os
import threading
import time

import httpx
import numpy as np
import pytest

from adapter_factory import random_lora
from preft_jax.adapters.peft_io import save_peft_lora
from preft_jax.config import tiny_config
from serve.errors import AdapterLoadError
from serve.registry import AdapterRegistry

CFG = tiny_config()


def _registry(**kw):
    return AdapterRegistry(CFG, 2, lora_targets=("q", "v"), lora_rank=4, reft_rank=4, **kw)


def _slowed(reg, delays: dict, gate: threading.Event | None = None):
    """Makes the catalog's folder reads of the named folders take `delays[name]` seconds (or wait
    for `gate`), as a large adapter on a slow disk would."""
    catalog = reg.catalog
    read = catalog._read_folder

    def slow(path, root):
        name = os.path.basename(path)
        if gate is not None and name in delays:
            gate.wait(30)
        time.sleep(delays.get(name, 0.0))
        return read(path, root)
    catalog._read_folder = slow


def test_a_reload_lands_only_in_its_own_registration(tmp_path):
    old, new = random_lora(CFG, 1, targets=("q",)), random_lora(CFG, 2, targets=("q",))
    save_peft_lora(tmp_path / "old", old, CFG)
    save_peft_lora(tmp_path / "new", new, CFG)
    reg = _registry(loader_threads=1)
    reg.load("dyn", str(tmp_path / "old"))
    gate = threading.Event()
    _slowed(reg, {"old": 0.0}, gate)
    f = next(p for p in (tmp_path / "old").iterdir() if p.is_file())
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10 ** 9))     # changed on disk: a reload
    reloading = reg.prepare("dyn")
    assert not reloading.done()
    assert reg.unload("dyn") == "unloaded"
    reg.load("dyn", str(tmp_path / "new"))                 # the name now serves another folder
    gate.set()
    reloading.result(30)                                   # the old folder's reload ends...
    reg.catalog._pool.submit(lambda: None).result(30)      # (and its done-callback, on the one loader thread)
    ref = reg.acquire("dyn")
    entry = reg.resolve(ref)                               # ...and the name still serves the new folder
    assert entry.path == str(tmp_path / "new")
    np.testing.assert_array_equal(np.asarray(entry.weights.A["q"]), np.asarray(new.A["q"]))
    reg.release(ref)


def _resolve_until_done(reg, ref, tries=60):
    for _ in range(tries):                                 # an engine step calls resolve about this often
        entry = reg.resolve(ref)
        if entry is not None:
            return entry
        time.sleep(0.05)
    raise AssertionError("the adapter neither loaded nor failed")


def test_a_failed_load_fails_the_request_after_a_few_tries(tmp_path):
    """A request's adapter that keeps failing to load fails it after LOAD_TRIES spaced loads (each
    engine step started a new load, and the request hung until its deadline); a folder repaired
    between two tries (caught mid-update) serves the request."""
    from serve.adapter_catalog import LOAD_TRIES
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    reg = _registry(adapter_dir=tmp_path)
    _slowed(reg, {"broken": 0.05})
    ref = reg.acquire("broken")
    with pytest.raises(AdapterLoadError, match="cannot load adapter 'broken'"):
        _resolve_until_done(reg, ref)
    assert reg.stats.load_failures == LOAD_TRIES == 3      # not one load per step
    reg.release(ref)
    ref = reg.acquire("broken")                            # the next request tries the folder again...
    assert reg.resolve(ref) is None
    time.sleep(0.2)                                        # ...whose first load fails; then it is repaired
    weights = random_lora(CFG, 4, targets=("q",))
    save_peft_lora(tmp_path / "fixed", weights, CFG)
    (tmp_path / "broken" / "adapter_config.json").unlink()
    for f in (tmp_path / "fixed").iterdir():
        f.rename(tmp_path / "broken" / f.name)
    entry = _resolve_until_done(reg, ref)
    np.testing.assert_array_equal(np.asarray(entry.weights.A["q"]), np.asarray(weights.A["q"]))
    assert LOAD_TRIES + 1 <= reg.stats.load_failures < 2 * LOAD_TRIES
    reg.release(ref)


@pytest.mark.slow
def test_a_request_that_gives_up_on_a_load_cancels_nothing(tmp_path):
    """One loader thread: "slow" takes 3.5 s, "d" waits behind it. With a 3 s request deadline the
    requests for "slow" and the first one for "d" get 504 deadline_exceeded (they were a 500, and the
    first one's timeout cancelled the queued load the second one waits on); the second one for "d",
    sent 2.8 s later, gets its completion."""
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from reference_llama import random_params
    from serve.engine import Engine, EngineConfig
    from serve.server import BackgroundServer, create_app
    from test_server import ByteTokenizer
    for name, seed in (("slow", 1), ("d", 2)):
        save_peft_lora(tmp_path / name, random_lora(CFG, seed, targets=("q",)), CFG)
    reg = _registry(adapter_dir=tmp_path, loader_threads=1)
    _slowed(reg, {"slow": 3.5, "d": 0.2})
    runner = ModelRunner(Llama.from_params(CFG, random_params(CFG)))
    tok = ByteTokenizer()
    engine = Engine(runner, reg, EngineConfig(max_num_seqs=4, max_model_len=64, max_prefill_seqs=2,
                                              max_num_batched_tokens=32, block_size=8, request_timeout=3.0), tok)
    server = BackgroundServer(create_app(engine, tok, model_id="base")).start()
    got = {}

    def post(key, model, after):
        time.sleep(after)
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3},
                       timeout=30)
        got[key] = (r.status_code, r.json(), time.monotonic() - t0)
    try:
        threads = [threading.Thread(target=post, args=a) for a in (("slow", "slow", 0.0), ("d1", "d", 0.1),
                                                                    ("d2", "d", 2.8))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.stop()
        engine.shutdown()
    for key, model in (("slow", "slow"), ("d1", "d")):
        status, body, _ = got[key]
        assert status == 504 and body["error"]["code"] == "deadline_exceeded", got[key]
        assert body["error"]["message"] == (f"adapter '{model}' did not load within this request's deadline (3 s); "
                                            f"it goes on loading: retry later")
    status, body, _ = got["d2"]
    assert status == 200 and len(body["choices"]) == 1, got["d2"]
