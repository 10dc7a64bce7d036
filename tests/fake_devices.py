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


def run_on_fake_devices(script: str, n_devices: int = 8, timeout: float = 900, cheap_codegen: bool = False) -> dict:
    """`cheap_codegen`: the script's XLA compiles at optimization level 0, as conftest's `cheap_codegen`
    fixture makes a module's (the same switch, `jax_disable_most_optimizations`, set through its
    environment variable): compiling takes ~30-40% less, the code runs slower; the HLO passes - sharding
    propagation, SPMD partitioning, buffer assignment - are the same, so placements, collectives and
    planned bytes are too. For scripts that compare results within the process, not for timing or for
    running a real model's programs long."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    if cheap_codegen:
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])
