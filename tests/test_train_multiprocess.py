"""Multi-process training through the CLIs: 2 processes x 2 fake CPU devices (jax.distributed on
127.0.0.1, gloo collectives) against 1 process x 4 devices, a SIGKILL after a checkpoint and a
resume, and the launch errors (unreachable coordinator, mesh / device mismatch, a checkpoint of
another adapter or process count).

What this proves: the per-process batch assembly (each process pads only its rows and the global
batch is built with make_array_from_process_local_data), the cross-process bucketing, the SPMD
rollouts (identical in every process), Orbax's multi-process save/restore and exact resume,
process-0-only metrics/export, and the error paths. What it does not: real network / accelerator
collectives, performance, or more than one host's filesystem (all processes share /tmp here).
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from preft_jax.adapters.config import LoraWeights
from preft_jax.adapters.reft_io import load_adapter
from tiny_hf_model import tiny_hf_config, write_tiny_hf_model
from train.data import write_dataset

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = tiny_hf_config()
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
               # cheaper CPU compiles (~25% less time); the reference and the multi-process runs share them
               XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    for k in ("PREFT_COORDINATOR", "PREFT_NUM_PROCESSES", "PREFT_PROCESS_ID", "PREFT_LOCAL_DEVICE_COUNT"):
        env.pop(k, None)
    return env


def launch(module, args, n_procs, devices, logs: pathlib.Path, timeout=240, process_ids=None, extra=None):
    """Runs `python -m module args` as n_procs processes (jax.distributed when > 1); returns
    [(returncode, output)]. Every process is killed if any is still running at the deadline.
    extra: {process id: more args for that process alone}."""
    logs.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    ids = list(range(n_procs)) if process_ids is None else process_ids
    procs, files = [], []
    try:
        for i in ids:
            cmd = [sys.executable, "-m", module, *map(str, args), *map(str, (extra or {}).get(i, ())),
                   "--local-device-count", str(devices)]
            if n_procs > 1 or process_ids is not None:
                cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n_procs), "--process-id", str(i)]
            f = open(logs / f"p{i}-{time.monotonic_ns()}.log", "w+")
            files.append(f)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for p, f in zip(procs, files):
        f.seek(0)
        out.append((p.returncode, f.read()))
        f.close()
    return out


def _ok(results):
    for rc, text in results:
        assert rc == 0, text[-3000:]


def _metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _steps(run):
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def _leaves(w):
    if isinstance(w, LoraWeights):
        return [w.A[t] for t in sorted(w.A)] + [w.B[t] for t in sorted(w.B)]
    return [w.R, w.W, w.b]


def _assert_weights(a, b, atol):
    assert a.config == b.config
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def _snapshot(run):
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp")
    write_tiny_hf_model(root / "model")
    write_dataset(root / "sft_data", 16, 8, seed=0)
    write_dataset(root / "grpo_data", 8, 1, seed=1, tasks=("arithmetic",), max_ops=1)
    return root


SFT = ["--steps", 3, "--batch-size", 4, "--eval-batch-size", 4, "--rank", 2, "--targets", "q,v,down", "--lr", 1e-2,
       "--warmup-steps", 0, "--checkpoint-every", 1, "--pad-multiple", 64, "--mesh", "2,1,2"]


def test_sft_two_processes_equal_one_and_resume_after_kill(world):
    m = ["--model", world / "model", "--data", world / "sft_data"]
    ref, mp = world / "sft_ref", world / "sft_mp"
    _ok(launch("train.sft", m + SFT + ["--out", ref], 1, 4, world / "logs"))

    # 2 processes, both SIGKILLed right after the step-2 checkpoint
    crashed = launch("train.sft", m + SFT + ["--out", mp, "--fault-after-step", 2], 2, 2, world / "logs")
    assert all(rc != 0 for rc, _ in crashed), [rc for rc, _ in crashed]
    assert _steps(mp) == [1, 2] and [r["step"] for r in _metrics(mp)] == [1, 2]
    assert not (mp / "adapter").exists()
    # restart: resumes from step 2 and trains step 3
    resumed = launch("train.sft", m + SFT + ["--out", mp], 2, 2, world / "logs")
    _ok(resumed)
    assert "resumed from" in resumed[0][1] and "step 3/3" in resumed[0][1]
    assert "step 3/3" not in resumed[1][1]                      # logs from process 0 only

    a, b = _metrics(ref), _metrics(mp)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"]
        np.testing.assert_allclose(y["loss"], x["loss"], rtol=1e-5)
    np.testing.assert_allclose(b[-1]["eval_loss"], a[-1]["eval_loss"], rtol=1e-5)
    w_ref, w_mp = load_adapter(ref / "adapter", CFG), load_adapter(mp / "adapter", CFG)
    assert max(float(np.abs(x).max()) for x in _leaves(w_ref)) > 0.01
    _assert_weights(w_mp, w_ref, atol=1e-5)
    # the Orbax checkpoint the two processes wrote serves directly: exactly the exported weights
    _assert_weights(load_adapter(mp, CFG), w_mp, atol=0)

    # resuming with another process count or another adapter is refused, and nothing is written
    before = _snapshot(mp), _snapshot(ref)
    (rc, text), = launch("train.sft", m + SFT + ["--out", mp, "--steps", 4], 1, 4, world / "logs")
    assert rc == 2 and "written by 2 process(es), this run has 1" in text, text[-2000:]
    (rc, text), = launch("train.sft", m + SFT + ["--out", ref, "--steps", 4, "--rank", 4], 1, 4, world / "logs")
    assert rc == 2 and "holds another adapter" in text and "rank=2 (this run: 4)" in text, text[-2000:]
    assert (_snapshot(mp), _snapshot(ref)) == before


GRPO = ["--steps", 2, "--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 4, "--rank", 2,
        "--targets", "q,v", "--lr", 5e-2, "--kl-coef", 0.05, "--checkpoint-every", 1, "--pad-multiple", 64,
        "--reward", "tiny_hf_model:even_token_reward", "--mesh", "2,1,2"]


def test_grpo_two_processes_equal_one_and_resume_after_kill(world):
    m = ["--model", world / "model", "--data", world / "grpo_data"]
    ref, mp = world / "grpo_ref", world / "grpo_mp"
    _ok(launch("train.grpo", m + GRPO + ["--out", ref], 1, 4, world / "logs"))
    crashed = launch("train.grpo", m + GRPO + ["--out", mp, "--fault-after-step", 1], 2, 2, world / "logs")
    assert all(rc != 0 for rc, _ in crashed) and _steps(mp) == [1]
    _ok(launch("train.grpo", m + GRPO + ["--out", mp], 2, 2, world / "logs"))

    a, b = _metrics(ref), _metrics(mp)
    assert [r["step"] for r in b] == [1, 2]
    assert any(r["reward_std"] > 0 for r in a)                  # the update had a signal
    for x, y in zip(a, b):
        assert (x["reward_mean"], x["reward_std"], x["response_len"]) == \
               (y["reward_mean"], y["reward_std"], y["response_len"])          # identical rollouts
        np.testing.assert_allclose(y["loss"], x["loss"], rtol=1e-4, atol=1e-6)
    w_ref, w_mp = load_adapter(ref / "adapter", CFG), load_adapter(mp / "adapter", CFG)
    assert max(float(np.abs(w_ref.B[t]).max()) for t in w_ref.B) > 1e-3
    _assert_weights(w_mp, w_ref, atol=1e-5)


def test_launch_errors_are_clear_and_write_nothing(world):
    m = ["--model", world / "model", "--data", world / "sft_data"]
    # a coordinator nobody listens on: bounded wait, then one clear line (jax itself would abort)
    out = world / "never"
    t0 = time.monotonic()
    (rc, text), = launch("train.sft", m + SFT + ["--out", out, "--init-timeout", 3], 2, 2, world / "logs",
                         timeout=90, process_ids=[1])
    assert rc == 2 and "could not reach the coordinator" in text and time.monotonic() - t0 < 60, text[-2000:]
    # a mesh that does not use every device of the 2 processes
    res = launch("train.sft", m + SFT + ["--out", out, "--mesh", "2,1,1"], 2, 2, world / "logs", timeout=120)
    for rc, text in res:
        assert rc == 2 and "must use all of them" in text, text[-2000:]
    assert not out.exists()


def test_a_process_that_stops_stops_the_others_with_one_line(world):
    """A refusal only process 0 finds (its dataset check) ends every process with an `error:` line and
    status 2 (not a barrier timeout's traceback); a process killed mid-run ends the others at their
    next collective with one line and status 1 (not the shutdown barrier's wait and SIGABRT)."""
    m = ["--model", world / "model", "--data", world / "sft_data"]
    out = world / "mismatch"
    res = launch("train.sft", m + SFT + ["--out", out, "--n-train", 40], 2, 2, world / "logs", timeout=150)
    for i, (rc, text) in enumerate(res):
        assert rc == 2 and "Traceback" not in text, (i, text[-3000:])
        assert "holds a dataset generated with other parameters: n_train=16 (this run: 40" in text, text[-2000:]
    assert "error: process 0 stopped while preparing the dataset: --data" in res[1][1], res[1][1][-2000:]

    out = world / "lost"
    res = launch("train.sft", m + SFT + ["--out", out, "--steps", 40], 2, 2, world / "logs", timeout=150,
                 extra={1: ["--fault-after-step", 1]})
    (rc0, text0), (rc1, _) = res
    assert rc1 == -9                                              # killed itself after checkpoint 1
    assert rc0 == 1, text0[-3000:]
    assert "error: process 0 lost contact with another process of this run" in text0, text0[-3000:]
    assert "Check failure" not in text0 and "Traceback" not in text0, text0[-3000:]
    assert _steps(out)[:1] == [1] and not (out / "adapter").exists()


def test_sigterm_stops_at_one_saved_step_and_the_same_command_resumes(world):
    # a preemption notice (SIGTERM) mid-run: before, one process died at once (its steps since the last
    # checkpoint lost) and a multi-process run ignored it (jax.distributed's notifier takes SIGTERM)
    m = ["--model", world / "model", "--data", world / "sft_data"]
    args = SFT + ["--steps", 8, "--checkpoint-every", 100]             # no regular checkpoint before the end
    for n, devices, mesh in ((1, 4, "1,1,4"), (2, 2, "2,1,2")):
        run = world / f"sigterm_{n}"
        res = launch("train.sft", m + args + ["--out", run, "--mesh", mesh], n, devices, world / "logs",
                     extra={n - 1: ["--sigterm-after-step", 2]})           # the notice reaches one process
        assert [rc for rc, _ in res] == [143] * n, [(rc, text[-1500:]) for rc, text in res]
        saved = _steps(run)
        assert len(saved) == 1 and 3 <= saved[0] < 8, saved                # one step every process agreed on
        step = saved[0]
        assert (f"stopped: preempted (SIGTERM) after step {step} of 8: checkpoint of step {step} saved in "
                f"{run / 'checkpoints'}; the same command resumes from it") in res[0][1], res[0][1][-1500:]
        assert all("stopped: preempted" not in text for _, text in res[1:])      # said once, by process 0
        assert [r["step"] for r in _metrics(run)] == list(range(1, step + 1)) and not (run / "adapter").exists()
        if n == 1:
            continue                            # a one-process resume is test_train_checkpoint's
        resumed = launch("train.sft", m + args + ["--out", run, "--mesh", mesh], n, devices, world / "logs")
        _ok(resumed)
        assert f"resumed from checkpoint {run / 'checkpoints' / str(step)}" in resumed[0][1] and "step 8/8" in resumed[0][1]
        assert [r["step"] for r in _metrics(run)] == list(range(1, 9)) and (run / "adapter").is_dir()
