"""benchmarks/roofline.py runs on the tiny model (a few shapes, every section), its fractions are
plausible and its bytes figure equals an independent count of the model's weights + KV."""
import jax
import numpy as np
import pytest

from benchmarks import roofline as rf


@pytest.mark.slow
def test_roofline_tiny_smoke():
    args = rf.finish_args(rf.parser().parse_args(
        ["--model", "tiny", "--dtype", "f32", "--batches", "1,4", "--contexts", "16,64", "--prefill", "64",
         "--prefill-rows", "2", "--adapters", "3", "--engine-requests", "4", "--engine-prompt", "8",
         "--engine-tokens", "4", "--component-case", "4,64", "--multi-steps", "2", "--rounds", "2",
         "--round-s", "0.05"]))
    res = rf.run(args, log=lambda s: None)
    rows = res["rows"]
    assert [r.kind for r in rows].count("decode") == 4 and [r.kind for r in rows].count("prefill") == 2
    assert [r.kind for r in rows].count("engine") == 1
    hw = res["hardware"]
    assert hw.bandwidth > 1e8 and hw.peak > 1e8                     # measured here
    for r in rows:
        f = rf.engine_bound(r, hw) / r.t if r.kind == "engine" else r.fraction(hw)
        assert 0 < f <= 1.5, (r.label, f)
    # bytes of a decode step = every weight array of the (tied) model + the K/V read and written,
    # counted here from the model's own arrays and the cache geometry
    runner, _ = rf.build("tiny", np.float32)
    cfg = runner.cfg
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.state))
    for r in (r for r in rows if r.kind == "decode"):
        per_token = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4
        kv = r.batch * (r.context + 1) * per_token + r.batch * per_token        # read context + new, write new
        assert abs(r.bytes - (weights + kv)) <= 0.001 * (weights + kv), (r.label, r.bytes, weights + kv)
    # components: every one measured; the cost-analysis cross-check's FLOPs agree with the analytic count
    assert len(res["components"]) == 9 and all(np.isfinite(c.t) for c in res["components"])
    xla, ana, _ = res["cost_check"]
    assert 0.8 <= xla["flops"] / ana["flops"] <= 1.6
    text = "\n".join(rf.report(args, res))
    assert "tiny f32 decode B=4 context 64:" in text and "% of memory bound" in text
    assert "| host time between device calls" in text
