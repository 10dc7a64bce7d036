"""scripts/device_check.py runs end to end at tiny shapes in Pallas interpret mode (so it cannot rot):
every section runs, every check passes, the report is written."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_device_check_tiny(tmp_path):
    out = tmp_path / "device_check.md"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"), "--tiny", "--out", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    for heading in ("## 1. Kernels vs references", "## 2. Adapter op timing", "## 3. Serving benchmark"):
        assert heading in text
    assert "skipped" not in text and "FAIL" not in text
    for impl in ("pallas lora_sgmv", "pallas lora_bgmv", "pallas reft_apply", "xla ragged_dot"):
        assert f"| {impl} |" in text and "| PASS |" in text
    assert text.count("| PASS | PASS |") == 3                     # isolation: jnp, xla, pallas x gather, grouped
    assert "| 2 |" in text and "PreFT-ReFT / all-token" in text     # the serving table has its N=2 row
