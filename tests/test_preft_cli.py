"""`python -m preft_jax`: chat with the default model; --backend / --dtype; bad flags exit 2."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    return subprocess.run([sys.executable, "-m", "preft_jax", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.real_model
def test_chat_bf16_xla_backend(default_gguf_path):
    # raw text whose next token f32 and bf16 both put >5 logits above the rest (a chat prompt's first
    # token can be a near-tie that bf16 flips on some CPUs: tests/test_bf16.py)
    r = run_cli("The capital of France is the city of", "--raw", "--max-tokens", "3", "--backend", "xla",
                "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris"), r.stdout


def test_bad_backend_and_dtype_exit_2():
    r = run_cli("hi", "--backend", "triton")
    assert r.returncode == 2 and "'auto', 'jnp', 'xla', 'pallas'" in r.stderr
    r = run_cli("hi", "--dtype", "float16")
    assert r.returncode == 2 and "'float32', 'bfloat16'" in r.stderr
