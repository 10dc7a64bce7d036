"""`python -m serve` command line: generation on the real default model, and user errors -> exit 2."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    return subprocess.run([sys.executable, "-m", "serve", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.real_model
def test_generate_real_model(default_gguf_path):
    r = run_cli("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_adapter_folder_exits_2(tmp_path):
    missing = tmp_path / "missing"
    r = run_cli("generate", "--prompt", "hi", "--adapter", f"a={missing}", "--use", "a")
    assert r.returncode == 2
    assert "adapter folder" in r.stderr and str(missing) in r.stderr
    r = run_cli("server", "--adapter", f"a={tmp_path}", "--port", "0")    # a folder without an adapter
    assert r.returncode == 2
    assert "could not load adapter 'a'" in r.stderr and "not an adapter folder" in r.stderr


def test_missing_model_exits_2(tmp_path):
    r = run_cli("generate", "--prompt", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2 and "model not found" in r.stderr


def test_bad_adapter_spec_exits_2():
    r = run_cli("generate", "--prompt", "hi", "--adapter", "no-equals-sign")
    assert r.returncode == 2 and "NAME=FOLDER" in r.stderr
