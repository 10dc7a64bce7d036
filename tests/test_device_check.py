"""scripts/device_check.py runs end to end at tiny shapes in Pallas interpret mode (so it cannot rot):
the prepared device run (roofline, serving, training) and the kernel checks, every section runs,
every check passes, the report is written between its markers and earlier runs are kept."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD = "# Device check\n\nintro kept\n\n<!-- device_check:latest -->\nold block\n<!-- /device_check:latest -->\n\n# Run 1\nkept too\n"


def _run(tmp_path, *extra):
    out = tmp_path / "device_check.md"
    out.write_text(OLD)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"), "--dry-run", "--out", str(out),
                        *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# Device check\n\nintro kept\n\n<!-- device_check:latest -->\n## Latest run")
    assert text.endswith("<!-- /device_check:latest -->\n\n# Run 1\nkept too\n") and "old block" not in text
    assert "skipped" not in text and "FAIL" not in text
    assert "### Warnings this run raised\n\n- " in text
    assert re.search(r"- device: cpu / cpu x 1; python [\d.]+, jax [\d.]+, jaxlib [\d.]+, flax [\d.]+", text)
    return text


@pytest.mark.slow
def test_device_check_prepared_run_dry(tmp_path):
    text = _run(tmp_path)
    for heading in ("### 1. Roofline: decode, prefill, components", "### 2. Serving benchmark",
                    "### 3. Training MFU (SFT step, GRPO update)"):
        assert heading in text
    figures = text.split("```")[1]
    # one line per decode figure: model, B=, context, fraction of the bound
    assert re.search(r"^tiny f32 decode B=4 context 16: [\d.]+ ms \(bound [\d.]+ ms\): \d+% of (memory bound|peak "
                     r"FLOPs)$", figures, re.M)
    assert re.search(r"^tiny f32 decode B=4 context 16, 2 steps per call: ", figures, re.M)
    assert re.search(r"^tiny f32 decode B=1 context 16: ", figures, re.M)                 # the further cases
    assert re.search(r"^SmolLM2-135M f32 decode B=2 context 16: ", figures, re.M)          # the second model
    assert "tiny decode step at B=4, context 16, by component" in text                    # components
    assert "| host time between device calls" in text
    assert "| op (host threads; decode B=4 context 16) | ms per step | calls per step |" in text      # the op trace
    assert re.search(r"^tiny f32 prefill 32 tokens \(2 x 16\) PreFT-LoRA N=3: ", figures, re.M)
    assert "tiny serving base, 2 requests x 4 -> 2 tokens" in figures and "of the roofline" in figures
    assert re.search(r"^tiny f32 sft step \(SFTTrainer.step\), batch 2 x seq 32: \d+ ms, MFU \d+%$", figures, re.M)
    # the tiny model's backward is within its timing noise under load (a dry run measured -0.08x once)
    assert re.search(r"^tiny grpo: backward / forward = -?[\d.]+x \(per round -?[\d.]+--?[\d.]+x", figures, re.M)
    assert "| 2 |" in text and "PreFT-ReFT / all-token" in text      # the serving table has its N=2 row
    # PreFT's cost over base broken down on the timed engines (issue 25.4): PreFT decodes on the base
    # weights, so no decode call carries a bank
    assert "PreFT vs base broken down, N=2" in text
    for k in ("base", "PreFT-LoRA", "PreFT-ReFT"):
        assert re.search(rf"^\| {k} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| -?[\d.]+ \| \d+ / \d+ \| 0 \|$", text, re.M), k
    assert re.search(r"^- PreFT-LoRA - base: wall [+-][\d.]+ ms = prefill [+-][\d.]+ \+ decode [+-][\d.]+ "
                     r"\+ host [+-][\d.]+$", text, re.M)


@pytest.mark.slow
def test_device_check_kernels_dry(tmp_path):
    text = _run(tmp_path, "--sections", "kernels,timing")
    for heading in ("### 1. Kernels vs references", "### 2. Adapter op timing"):
        assert heading in text
    for impl in ("pallas lora_sgmv", "pallas lora_bgmv", "pallas reft_apply", "xla ragged_dot"):
        assert f"| {impl} |" in text and "| PASS |" in text
    assert text.count("| PASS | PASS |") == 3                     # isolation: jnp, xla, pallas x gather, grouped
    assert "| LoRA decode (BGMV) | tiny | 2 |" in text


def _device_check_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("device_check_under_test", ROOT / "scripts" / "device_check.py")
    mod = sys.modules["device_check_under_test"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_warning_log_keeps_hidden_deprecations_for_the_report(tmp_path, monkeypatch):
    """A DeprecationWarning raised in a library module (hidden by Python's default filters, as jax
    0.11's Pallas Triton deprecation is) reaches the report once per message, with the number of
    places and the first; a UserWarning too; the filters and showwarning are restored afterwards."""
    import warnings
    dc = _device_check_module()
    lib = tmp_path / "fake_lib_for_warnings.py"
    lib.write_text("import warnings\n"
                   "def lower(i):\n"
                   "    warnings.warn('The Triton backend is deprecated.', DeprecationWarning, stacklevel=1)\n"
                   "def other():\n"
                   "    warnings.warn('The Triton backend is deprecated.', DeprecationWarning, stacklevel=1)\n"
                   "    warnings.warn('shape odd', UserWarning, stacklevel=1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_lib_for_warnings as fake
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)     # as Python does outside __main__
        filters, show = list(warnings.filters), warnings.showwarning
        with dc.WarningLog() as log:
            for i in range(5):
                fake.lower(i)
            fake.other()
        assert warnings.filters == filters and warnings.showwarning is show
    assert log.lines() == [
        "- DeprecationWarning (2 places, first " + str(lib) + ":3): The Triton backend is deprecated.",
        "- UserWarning (1 place, first " + str(lib) + ":6): shape odd"]
    rep = dc.Report(tmp_path / "r.md", 10.0)
    rep.warnings = log
    assert "### Warnings this run raised\n\n- DeprecationWarning (2 places" in rep.block()
    rep.warnings = dc.WarningLog()
    assert "### Warnings this run raised\n\n- none\n" in rep.block()
    assert dc._short_path("/usr/lib/python3.12/site-packages/jax/_src/pallas/pallas_call.py") == \
        "jax/_src/pallas/pallas_call.py"
    assert dc._short_path(str(ROOT / "preft_jax" / "paged_kv.py")) == "preft_jax/paged_kv.py"
    assert dc._short_path("<frozen importlib._bootstrap>") == "<frozen importlib._bootstrap>"
