"""Run a test script in a fresh Python process with N fake CPU devices (XLA_FLAGS must be set before
jax is imported, so multi-device tests run out of process). The script prints one line
`RESULT<json>`; its parsed JSON is returned."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


# Cheaper LLVM codegen (XLA's CPU backend at optimization level 0): compiling takes ~30-40% less, the
# compiled code runs slower. The HLO passes - sharding propagation, SPMD partitioning, buffer
# assignment - are the same, so placements, collectives and planned bytes are too. For scripts that
# compile many small programs and compare them with each other in the same process; not for timing or
# for running a real model's programs long.
CHEAP_CODEGEN = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def run_on_fake_devices(script: str, n_devices: int = 8, timeout: float = 900, cheap_codegen: bool = False) -> dict:
    flags = f"--xla_force_host_platform_device_count={n_devices}" + (f" {CHEAP_CODEGEN}" if cheap_codegen else "")
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])
