"""Tests of the vLLM peer harness (plain Python; no vLLM needed except the opt-in real-engine test).

    python -m pytest -q -p no:cacheprovider benchmarks/vllm_peer/test_vllm_peer.py

The client is driven against a fake worker script that speaks the same JSON-lines protocol, so
startup, replies, errors, worker death, timeouts and process cleanup are checked without vLLM.
The real-engine test runs only when VLLM_PEER_BENCH_DIR names a prepare.py output folder and the
vLLM venv exists (it starts real vLLM workers: minutes).
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import textwrap
import time

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from client import VllmPeer, VllmPeerError, worker_env  # noqa: E402
from workload import Workload, digest  # noqa: E402

FAKE = textwrap.dedent('''
    import json, os, sys, time
    mode = os.environ.get("FAKE_MODE", "ok")
    engine = sys.argv[sys.argv.index("--engine") + 1]
    if mode == "fail_start":
        print("boom: cannot build engine", file=sys.stderr); sys.stderr.flush()
        print(json.dumps({"ready": False, "error": "RuntimeError: no engine"}), flush=True); sys.exit(1)
    print("some library log line", file=sys.stderr)
    print(json.dumps({"ready": True, "engine": engine, "startup": {"import_s": 0.0}, "pid": os.getpid(),
                      "argv": sys.argv[1:]}), flush=True)
    if mode == "ignore_eof":
        import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("die"):
            print("fatal: worker crashed", file=sys.stderr); sys.stderr.flush(); os._exit(3)
        if cmd.get("hang"):
            time.sleep(60)
        if cmd.get("n_adapters", 0) and engine != "lora":
            print(json.dumps({"ok": False, "error": "ValueError: needs lora"}), flush=True); continue
        n = cmd.get("n_requests", 32) * cmd.get("max_tokens", 32)
        print(json.dumps({"ok": True, "engine": engine, "tok_per_s": 100.0, "generated_tokens": n,
                          "wall_s": n / 100.0, "echo": cmd}), flush=True)
    if mode == "ignore_eof":
        time.sleep(120)
''')


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    adapters = tmp_path / "adapters"
    adapters.mkdir()

    def make(mode="ok", variants=("base", "lora"), **kw):
        return VllmPeer(model, adapters_dir=adapters, variants=variants, python=sys.executable,
                        worker_script=script, env=dict(os.environ, FAKE_MODE=mode),
                        log_dir=tmp_path / "logs", **kw)
    return make


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0): look at its state
    stat = pathlib.Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split()[2] == "Z"


# ------------------------------------------------------------------------------------------ workload
def test_workload_follows_serve_benchmark_rules():
    """Prompts and adapter picks are the ones experiments.serve_benchmark draws (recomputed here by its rule)."""
    w = Workload(n_requests=7, prompt_len=5, n_adapters=8, seed=0, vocab_size=1000)
    rng = np.random.default_rng(0)
    want_prompts = [rng.integers(0, 1000, 5).tolist() for _ in range(7)]
    rng = np.random.default_rng(1000 + 8)
    want_picks = [int(rng.integers(0, 8)) for _ in range(7)]
    assert w.prompts() == want_prompts
    assert w.adapter_ids() == want_picks
    assert all(0 <= t < 1000 for p in w.prompts() for t in p)
    assert Workload(n_requests=3).adapter_ids() == [None, None, None]
    assert Workload(seed=1).prompts() != Workload(seed=0).prompts()
    assert Workload().expected_generated_tokens == 32 * 32


@pytest.mark.parametrize("bad", [{"n_requests": 0}, {"prompt_len": -1}, {"n_adapters": -2}, {"seed": -1},
                                 {"max_tokens": 1.5}, {"n_requests": True}])
def test_workload_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Workload(**bad)


def test_workload_from_dict_names_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown workload field\(s\) \['temperature'\].*supported"):
        Workload.from_dict({"temperature": 1.0})


def test_digest_is_order_and_value_sensitive():
    assert digest([[1, 2], [3]]) == digest([np.array([1, 2]), [3]])
    assert digest([[1, 2], [3]]) != digest([[3], [1, 2]])
    assert digest([[1, 2]]) != digest([[1, 3]])


# ------------------------------------------------------------------------------------------- client
def test_worker_env_sets_vllm_switches_and_drops_caller_python_paths():
    env = worker_env("/nonexistent/bin/python", preload=False,
                     base={"PYTHONPATH": "/x", "JAX_PLATFORMS": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "1",
                           "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert "PYTHONPATH" not in env and "JAX_PLATFORMS" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"            # a caller's binding wins
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"       # the in-process engine is required
    assert env["HF_HUB_OFFLINE"] == "1" and "LD_PRELOAD" not in env
    assert worker_env("/x/bin/python", base={})["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")


def test_client_runs_variants_and_cleans_up(fake):
    peer = fake()
    pids = [w.proc.pid for w in peer.workers.values()]
    assert peer.variants == ("base", "lora")
    assert peer.ready["lora"]["engine"] == "lora" and peer.ready["base"]["startup"]["total_s"] >= 0
    argv = peer.ready["lora"]["argv"]
    assert argv[argv.index("--max-loras") + 1] == "32" and "--adapters" not in peer.ready["base"]["argv"]
    r = peer.run("lora", n_adapters=8, seed=3, n_requests=4, max_tokens=2)
    assert r["ok"] and r["engine"] == "lora" and r["generated_tokens"] == 8 and r["roundtrip_s"] >= 0
    assert r["echo"] == {"op": "run", "n_adapters": 8, "seed": 3, "n_requests": 4, "max_tokens": 2}
    assert peer.run("base")["engine"] == "base"
    with pytest.raises(VllmPeerError, match="needs lora"):
        peer.run("base", n_adapters=8)
    assert peer.run("base")["ok"]                               # still serving after an error reply
    with pytest.raises(ValueError, match=r"unknown variant 'base_eager'; started: \('base', 'lora'\)"):
        peer.run("base_eager")
    peer.close()
    peer.close()                                                # idempotent
    assert all(_gone(p) for p in pids)
    assert all(w.proc.returncode == 0 for w in peer.workers.values())


def test_client_reports_worker_death_with_log_tail(fake):
    with fake(variants=("base",)) as peer:
        with pytest.raises(VllmPeerError, match=r"(?s)exited \(code 3\).*fatal: worker crashed"):
            peer.run("base", die=True)
        with pytest.raises(VllmPeerError, match="gone|exited"):
            peer.run("base")


def test_client_times_out_and_kills_a_stuck_worker(fake):
    peer = fake(mode="ignore_eof", variants=("base",), run_timeout=1.0)
    pid = peer.workers["base"].proc.pid
    with pytest.raises(VllmPeerError, match="no reply within 1 s"):
        peer.run("base", hang=True)
    t0 = time.monotonic()
    for w in peer.workers.values():
        w.close(timeout=1.0)                                    # EOF ignored, SIGTERM ignored -> SIGKILL
    assert time.monotonic() - t0 < 30 and _gone(pid)
    peer.close()


def test_client_failed_start_raises_with_error_and_log(fake):
    with pytest.raises(VllmPeerError, match=r"(?s)failed to start: RuntimeError: no engine.*boom"):
        fake(mode="fail_start")


def test_client_validates_arguments(fake, tmp_path):
    with pytest.raises(ValueError, match="variants must be distinct names from"):
        fake(variants=("base", "gpu"))
    with pytest.raises(FileNotFoundError, match="vLLM venv python not found"):
        VllmPeer(tmp_path, python=str(tmp_path / "nope" / "python"))
    with pytest.raises(FileNotFoundError, match="without config.json"):
        VllmPeer(tmp_path / "empty", python=sys.executable)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="variant 'lora' needs adapters_dir"):
        VllmPeer(tmp_path / "m", variants=("lora",), python=sys.executable)


# ------------------------------------------------------------------------------ real vLLM (opt-in)
BENCH = os.environ.get("VLLM_PEER_BENCH_DIR")


@pytest.mark.skipif(not BENCH, reason="set VLLM_PEER_BENCH_DIR to a prepare.py output folder to run vLLM")
def test_real_vllm_lora_changes_outputs_and_no_adapter_matches_base():
    bench = pathlib.Path(BENCH)
    work = dict(n_requests=8, prompt_len=16, max_tokens=8, seed=5)
    with VllmPeer(bench / "smollm2_hf", adapters_dir=bench / "adapters" / "r8",
                  variants=("base_eager", "lora"), max_loras=8, max_lora_rank=8) as peer:
        base = peer.run("base_eager", **work)
        plain = peer.run("lora", n_adapters=0, **work)
        lora = peer.run("lora", n_adapters=8, **work)
        again = peer.run("lora", n_adapters=8, **work)
    assert base["generated_tokens"] == base["expected_tokens"] == 64
    assert plain["digest"] == base["digest"]          # LoRA engine without adapters = base model
    assert lora["digest"] != base["digest"]           # the adapters change greedy outputs
    assert again["digest"] == lora["digest"]          # greedy is deterministic
    assert lora["distinct_adapters"] > 1
