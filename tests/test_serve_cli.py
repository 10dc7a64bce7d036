"""`python -m serve` command line: generation on the real default model, and user errors -> exit 2."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=300, **env_extra):
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), **env_extra}
    return subprocess.run([sys.executable, "-m", "serve", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.real_model
def test_generate_real_model(default_gguf_path):
    r = run_cli("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.slow
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


@pytest.mark.slow
def test_mesh_flag(tmp_path):
    """--mesh shards generation over every device (8 fake CPU devices: same greedy text as unsharded);
    a mesh that does not match the device count, or a malformed one, exits 2."""
    eight = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    args = ("generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "6")
    plain = run_cli(*args, **eight)
    sharded = run_cli(*args, "--mesh", "data=2,tensor=4", **eight)
    assert plain.returncode == 0 and sharded.returncode == 0, sharded.stderr
    assert sharded.stdout == plain.stdout
    r = run_cli(*args, "--mesh", "tensor=2", **eight)
    assert r.returncode == 2 and "--mesh" in r.stderr and "8 are available" in r.stderr
    r = run_cli(*args, "--mesh", "pipe=2")
    assert r.returncode == 2 and "AXIS=N" in r.stderr


def test_bad_adapter_spec_exits_2():
    r = run_cli("generate", "--prompt", "hi", "--adapter", "no-equals-sign")
    assert r.returncode == 2 and "NAME=FOLDER" in r.stderr


@pytest.mark.slow
@pytest.mark.real_model
def test_generate_with_adapter_matches_reference(default_model, tmp_path):
    """`generate --adapter ft=FOLDER` (a PEFT LoRA folder) prints what ModelRunner.generate gives alone."""
    from adapter_factory import random_lora
    from preft_jax.adapters.bank import build_bank
    from preft_jax.adapters.peft_io import load_peft_lora, save_peft_lora
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from preft_jax.sampling import SamplingParams
    cfg, params, tok = default_model
    folder = tmp_path / "ft"
    save_peft_lora(folder, random_lora(cfg, 5, rank=4, targets=("q", "v"), scale=0.1), cfg)
    prompt = "Name a color."
    r = run_cli("generate", "--prompt", prompt, "--adapter", f"ft={folder}", "--adapter-name", "ft",
                "--max-tokens", "10")
    assert r.returncode == 0, r.stderr
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    sp = SamplingParams(max_new_tokens=10, stop_token_ids=tuple(tok.eos_token_ids))
    runner = ModelRunner(Llama.from_params(cfg, params))
    bank = build_bank(cfg, [load_peft_lora(folder, cfg)])
    adapted = runner.generate([ids], sp, bank=bank, adapter_ids=[1])[0].tokens
    assert r.stdout.rstrip("\n") == tok.decode(adapted).rstrip("\n")
    assert adapted != runner.generate([ids], sp)[0].tokens      # the adapter changes the answer


@pytest.mark.slow
@pytest.mark.real_model
def test_generate_bf16_on_xla_backend(default_gguf_path):
    r = run_cli("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12",
                "--backend", "xla", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_unknown_backend_or_dtype_exits_2():
    r = run_cli("generate", "--prompt", "hi", "--backend", "cuda")
    assert r.returncode == 2 and "'auto', 'jnp', 'xla', 'pallas'" in r.stderr
    r = run_cli("server", "--dtype", "float16")
    assert r.returncode == 2 and "'float32', 'bfloat16'" in r.stderr


def test_adapter_errors_name_the_real_problem(tmp_path):
    """Issue 23: NaN weights or a bad adapter name are reported as such, not blamed on --lora-rank;
    only an adapter that does not fit the bank names --lora-rank."""
    import numpy as np
    from adapter_factory import random_lora
    from preft_jax.adapters.peft_io import save_peft_lora
    from preft_jax.config import tiny_config
    cfg = tiny_config(max_seq_len=1024)
    nan = random_lora(cfg, 1, rank=4, targets=("q",))
    nan.A["q"][0, 1, 2] = np.nan
    save_peft_lora(tmp_path / "nan", nan, cfg)
    save_peft_lora(tmp_path / "ok", random_lora(cfg, 2, rank=4, targets=("q",)), cfg)
    args = ("generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "2")
    r = run_cli(*args, "--adapter", f"a={tmp_path / 'nan'}")
    assert r.returncode == 2 and "error: cannot load adapter 'a': LoRA A[q] holds NaN or Inf values" in r.stderr, r.stderr
    assert "--lora-rank" not in r.stderr
    r = run_cli(*args, "--adapter", f"bad name={tmp_path / 'ok'}")
    assert r.returncode == 2 and "adapter name must match" in r.stderr and "--lora-rank" not in r.stderr, r.stderr
    r = run_cli("server", "--model", "tiny", "--lora-rank", "2", "--port", "0", "--adapter", f"a={tmp_path / 'ok'}")
    assert r.returncode == 2 and "LoRA rank 4 exceeds the bank's rank 2" in r.stderr and "--lora-rank" in r.stderr, \
        r.stderr
