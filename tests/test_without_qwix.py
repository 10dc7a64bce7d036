"""Where qwix does not import (the accelerator image: jax, flax, optax, orbax-checkpoint and
prometheus_client, no qwix; docs/device_check.md): scripts/device_check.py and the modules its
sections use import; the float model computes what it computes with qwix, and the engine serves the
same tokens; asking for quantized weights is one error naming qwix (the CLIs: `error: ...`, exit
status 2)."""
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
HIDE = 'raise ImportError("No module named \'qwix\' (hidden by tests/test_without_qwix.py)")\n'

SCRIPT = r"""
import json, sys
import jax.numpy as jnp, numpy as np
import importlib.util
spec = importlib.util.spec_from_file_location("device_check", "scripts/device_check.py")
sys.modules["device_check"] = dc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dc)                                                    # and what it imports
import train.sft, train.grpo, benchmarks.roofline, benchmarks.train_mfu, experiments.serve_benchmark
from serve.engine import Engine, EngineConfig
from serve.registry import AdapterRegistry
from preft_jax import quantize
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params
assert quantize.qwix is None and "qwix" not in sys.modules, "qwix was importable"
cfg = tiny_config()
params = random_params(cfg, seed=3)
r = ModelRunner(Llama.from_params(cfg, params))
tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
logits = np.asarray(sequence_logits(r.graphdef, r.state, tokens, jnp.asarray([3, 9], jnp.int32)))
sp = SamplingParams(max_new_tokens=6, stop_token_ids=(-1,))
out = [g.tokens for g in r.generate([[5, 6, 7], [9, 10]], sp)]
eng = Engine(r, AdapterRegistry(cfg, 0), EngineConfig(max_num_seqs=2, max_model_len=32))
served = [list(x.tokens) for x in eng.generate([([5, 6, 7], None, sp), ([9, 10], None, sp)])]
try:
    quantize.quantize_params(cfg, params, "int8")
    err = None
except ValueError as e:                                  # the CLIs' usage-error path catches ValueError
    err = [type(e).__name__, isinstance(e, ImportError), str(e)]
print(json.dumps({"logits": logits.tolist(), "tokens": out, "served": served, "error": err,
                  "missing": quantize.QWIX_MISSING}))
"""


def _env(tmp_path) -> dict:
    hidden = tmp_path / "hide_qwix" / "qwix"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(HIDE)
    path = [str(tmp_path / "hide_qwix"), str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def test_float_model_and_engine_work_without_qwix(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # the same computations here, where qwix imports
    from preft_jax import quantize
    from preft_jax.config import tiny_config
    from preft_jax.generation import ModelRunner, sequence_logits
    from preft_jax.model import Llama
    from preft_jax.sampling import SamplingParams
    from reference_llama import random_params
    assert quantize.qwix is not None
    cfg = tiny_config()
    run = ModelRunner(Llama.from_params(cfg, random_params(cfg, seed=3)))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    want = np.asarray(sequence_logits(run.graphdef, run.state, tokens, jnp.asarray([3, 9], jnp.int32)))
    np.testing.assert_array_equal(np.asarray(got["logits"], np.float32), want)
    want_tokens = [g.tokens for g in run.generate([[5, 6, 7], [9, 10]],
                                                  SamplingParams(max_new_tokens=6, stop_token_ids=(-1,)))]
    assert got["tokens"] == want_tokens and got["served"] == want_tokens    # the engine serves the same
    assert got["missing"] == "ImportError: No module named 'qwix' (hidden by tests/test_without_qwix.py)"
    assert got["error"] == ["QwixMissingError", True,
                            "quantized base weights need qwix (pip install 'qwix==0.1.8'), which does not import "
                            "here (ImportError: No module named 'qwix' (hidden by tests/test_without_qwix.py)); the "
                            "float model does not need it"]


def test_serve_cli_quantize_without_qwix_is_one_error_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "serve", "generate", "--model", "tiny", "--prompt", "hello",
                        "--max-tokens", "4", "--quantize", "int8", "--no-cache", "--quiet"],
                       cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    assert "error: quantized base weights need qwix (pip install 'qwix==0.1.8')" in r.stderr, r.stderr[-2000:]
