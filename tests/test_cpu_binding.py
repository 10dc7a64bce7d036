"""serve/cpu_binding.py: the engine's stepping thread on a core of its own, the runtime's threads on
the others (EngineConfig.cpu_binding). Thread placement is process-wide, so every engine case runs in
a fresh interpreter and reports what it saw; the reference for the tokens is an unbound engine."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from serve.cpu_binding import split
from serve.engine_config import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r'''
    import json, logging, os, sys, threading
    import numpy as np
    from flax import nnx
    from preft_jax.config import tiny_config
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from preft_jax.sampling import SamplingParams
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry

    lines = []
    class Keep(logging.Handler):
        def emit(self, record):
            if record.name == "serve.cpu_binding":
                lines.append(f"{record.levelname} {record.getMessage()}")
    logging.getLogger().addHandler(Keep()); logging.getLogger().setLevel(logging.INFO)
    case = sys.argv[1]
    if case == "refused":
        def refuse(*a):
            raise PermissionError(1, "Operation not permitted")
        os.sched_setaffinity = refuse
    if case == "noproc":                                   # /proc not mounted (some sandboxes)
        listdir = os.listdir
        def no_proc(path="."):
            if str(path).startswith("/proc/self/task"):
                raise FileNotFoundError(2, "No such file or directory", str(path))
            return listdir(path)
        os.listdir = no_proc
    runner = ModelRunner(Llama(tiny_config(max_seq_len=256), rngs=nnx.Rngs(0), dtype="float32"))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(4, 20, 6)]
    sp = SamplingParams(max_new_tokens=12, stop_token_ids=())

    def engine(binding):
        return Engine(runner, AdapterRegistry(runner.cfg, 0), EngineConfig(
            max_num_seqs=4, max_model_len=64, max_prefill_seqs=2, max_num_batched_tokens=64,
            cpu_binding=binding))

    def placement():
        if case == "noproc":
            return "no /proc"
        me, python = threading.get_native_id(), {t.native_id for t in threading.enumerate()}
        out = {"native": set(), "python": set()}
        for tid in map(int, os.listdir("/proc/self/task")):
            cores = sorted(os.sched_getaffinity(tid))
            if tid == me:
                out["me"] = cores
            else:
                out["python" if tid in python else "native"].add(tuple(cores))
        return {k: sorted(map(list, v)) if isinstance(v, set) else v for k, v in out.items()}

    original = sorted(os.sched_getaffinity(0))
    reference = [r.tokens for r in engine("off").generate([(p, None, sp) for p in prompts])]
    report = {"original": original, "before": placement()}
    if case in ("on", "refused", "noproc"):
        eng = engine("on")
        report["tokens_equal"] = [r.tokens for r in eng.generate([(p, None, sp) for p in prompts])] == reference
        report["health"] = eng.health()["cpu_binding"]
        report["bound"] = placement()
        for _ in range(3):                                 # further steps try nothing again
            eng.generate([(prompts[0], None, sp)])
        other = engine("on")                               # another thread steps a second engine
        box = {}
        t = threading.Thread(target=lambda: box.update(tokens=[r.tokens for r in other.generate(
            [(p, None, sp) for p in prompts])], health=other.health()["cpu_binding"]))
        t.start(); t.join()
        report["other"] = {"tokens_equal": box["tokens"] == reference, "health": box["health"]}
        eng.shutdown()
        report["released"] = placement()
    elif case == "loop":
        default = Engine(runner, AdapterRegistry(runner.cfg, 0), EngineConfig(
            max_num_seqs=4, max_model_len=64, max_prefill_seqs=2, max_num_batched_tokens=64))
        report["tokens_equal"] = [r.tokens for r in default.generate([(p, None, sp) for p in prompts])] == reference
        report["caller"] = {"health": default.health()["cpu_binding"], "placement": placement()}
        eng = engine("on")
        eng.start()                                        # the engine's own loop thread steps it: bound
        handles = [eng.submit(p, None, sp) for p in prompts]
        for h in handles:
            h.wait(timeout=60)
        loop = eng._thread.native_id
        report["loop"] = {"health": eng.health()["cpu_binding"], "cores": sorted(os.sched_getaffinity(loop)),
                          "tokens_equal": [list(h.result.tokens) for h in handles] == reference,
                          "placement": placement()}
        eng.shutdown()
        report["released"] = placement()
    report["lines"] = lines
    print("REPORT " + json.dumps(report))
''')


def run_case(case: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("REPORT "))[7:])


def test_split_gives_the_highest_core_to_the_stepping_thread():
    assert split([]) is None and split({3}) is None
    assert split({0, 1}) == ({1}, {0})
    assert split([5, 0, 2]) == ({5}, {0, 2})


def test_config_refuses_an_unknown_binding():
    assert EngineConfig().cpu_binding == "off"
    with pytest.raises(ValueError, match=r"cpu_binding must be one of \('off', 'on'\), got 'auto'"):
        EngineConfig(cpu_binding="auto")


needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one usable core: nothing to split")


@needs_two
def test_on_binds_the_stepping_thread_apart_and_shutdown_puts_every_thread_back():
    r = run_case("on")
    host, compute = [max(r["original"])], [c for c in r["original"] if c != max(r["original"])]
    assert r["before"]["me"] == r["original"] and r["before"]["native"] == [r["original"]]
    assert r["tokens_equal"] and r["health"] == "bound"
    assert r["bound"]["me"] == host and r["bound"]["native"] == [compute]
    assert r["other"] == {"tokens_equal": True, "health": "unbound"}   # the core is held: served, not bound
    assert r["released"]["me"] == r["original"] and r["released"]["native"] == [r["original"]]
    assert r["released"]["python"] in ([], [r["original"]])
    cores = (f"{compute[0]}-{compute[-1]}" if len(compute) > 2 and compute[-1] - compute[0] == len(compute) - 1
             else ",".join(map(str, compute)))
    assert len(r["lines"]) == 2, r["lines"]
    assert re.fullmatch(rf"INFO cpu binding: the engine's stepping thread on core {host[0]}, \d+ runtime threads "
                        rf"on cores {cores}", r["lines"][0]), r["lines"]
    assert re.fullmatch(r"INFO cpu binding: thread \d+ already holds the host core; thread \d+ that steps "
                        r"another engine is not bound", r["lines"][1]), r["lines"]


@needs_two
def test_the_default_leaves_threads_alone_and_on_binds_the_engines_own_loop_thread():
    r = run_case("loop")
    host = [max(r["original"])]
    assert r["tokens_equal"] and r["caller"]["health"] == "unbound"
    assert r["caller"]["placement"]["me"] == r["original"] and r["caller"]["placement"]["native"] == [r["original"]]
    assert r["loop"]["health"] == "bound" and r["loop"]["cores"] == host and r["loop"]["tokens_equal"]
    assert r["loop"]["placement"]["native"] == [[c for c in r["original"] if c not in host]]
    assert r["loop"]["placement"]["me"] == r["original"]              # the caller's thread is left alone
    assert r["released"]["native"] == [r["original"]] and r["released"]["me"] == r["original"]


@needs_two
def test_a_refused_binding_serves_unbound_with_one_line():
    r = run_case("refused")
    assert r["tokens_equal"] and r["health"] == "unbound" and r["other"] == {"tokens_equal": True,
                                                                             "health": "unbound"}
    assert r["bound"] == r["before"] == r["released"]
    assert r["lines"] == ["WARNING cpu binding unavailable (PermissionError: [Errno 1] Operation not permitted); "
                          "threads are not bound"]


@needs_two
def test_no_proc_serves_unbound_with_one_line():
    r = run_case("noproc")
    assert r["tokens_equal"] and r["health"] == "unbound" and r["other"] == {"tokens_equal": True,
                                                                             "health": "unbound"}
    assert r["lines"] == ["WARNING cpu binding unavailable (FileNotFoundError: [Errno 2] No such file or "
                          "directory: '/proc/self/task'); threads are not bound"]
