"""benchmarks/roofline.py runs on the tiny model (a few shapes, every section), its fractions are
plausible and its bytes figure equals an independent count of the model's weights + KV."""
from unittest import mock

import jax
import numpy as np
import pytest

from benchmarks import roofline as rf
from preft_jax.lowering import lower_for


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
    engine = next(r for r in rows if r.kind == "engine")
    assert "tok/s; decode attention gather" in engine.note           # the engine's own path, read from it
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


@pytest.mark.parametrize("kind, key, figures", [
    ("NVIDIA H100 80GB HBM3", "H100", (3.35e12, 989e12)),        # SXM
    ("NVIDIA H100 PCIe", "H100 PCIe", (2.0e12, 756e12)),
    ("NVIDIA H100 NVL", "H100 NVL", (3.9e12, 835e12)),
    ("NVIDIA H200", "H200", (4.8e12, 989e12)),
    ("NVIDIA H200 NVL", "H200 NVL", (4.8e12, 835e12)),
    ("NVIDIA GH200 480GB", "GH200 480GB", (4.0e12, 989e12)),    # contains "H200", is not one (96 GB HBM3)
    ("NVIDIA GH200 144G HBM3e", "GH200", (4.9e12, 989e12)),
    ("TPU v5 lite", "TPU v5 lite", (819e9, 197e12)),
])
def test_stated_hardware_takes_the_most_specific_kind(kind, key, figures):
    from benchmarks import cost_model as cm
    assert cm.stated_hardware(kind) == (key, figures)


def test_stated_hardware_unknown_kind_is_none():
    from benchmarks import cost_model as cm
    assert cm.stated_hardware("cpu") is None and cm.stated_hardware("NVIDIA A100-SXM4-80GB") is None


@pytest.mark.parametrize("rows, context, steps, factor", [(3, 20, 1, 1), (2, 47, 4, 1), (4, 16, 1, 3),
                                                          (2, 15, 1, 1), (2, 44, 4, 2)])     # context + steps = 16, 48
def test_decode_need_counts_the_arrays_a_case_allocates(rows, context, steps, factor):
    """decode_need's weights and KV pool against the arrays themselves: the model's state and the pool
    `decode_inputs` builds for the case (which is filled, not zero)."""
    runner, _ = rf.build("tiny", np.float32)
    need = rf.decode_need(runner, rows, context, np.float32, factor, steps)
    assert need["weights"] == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.state))
    _, batch, cache = rf.decode_inputs(runner.cfg, rows, context, np.float32, pool_factor=factor, steps=steps)
    assert need["KV pool"] == cache.k.nbytes + cache.v.nbytes
    assert batch.block_tables.shape[0] == rows and int(batch.block_tables.max()) < cache.num_blocks
    assert np.all(np.asarray(cache.k) == np.float32(0.1)) and np.all(np.asarray(cache.v) == np.float32(0.1))
    assert need["logits"] == 2 * rows * steps * runner.cfg.vocab_size * 4
    assert need["total"] == need["weights"] + need["KV pool"] + need["logits"] + rf.HEADROOM
    assert rf.over_memory(need, None) is None and rf.over_memory(need, need["total"]) is None
    why = rf.over_memory(need, need["total"] - 1)
    assert why.startswith(f"needs ~{need['total'] / rf.GiB:.1f} GiB (weights ") and "KV pool" in why
    assert why.endswith(f"> the device's {(need['total'] - 1) / rf.GiB:.1f} GiB")


def test_cases_over_the_device_memory_are_skipped_with_the_reason():
    """decode_rows measures the cases that fit `memory_limit` and names the others; the component
    pool-size case takes the largest pool that fits (4x, 3x, 2x), none below 2x."""
    runner, shape = rf.build("tiny", np.float32)
    args = rf.finish_args(rf.parser().parse_args(["--model", "tiny", "--dtype", "f32", "--rounds", "1",
                                                  "--round-s", "0.01"]))
    small, large = rf.decode_need(runner, 2, 16, np.float32), rf.decode_need(runner, 8, 256, np.float32)
    assert small["total"] < large["total"]
    args.memory_limit = small["total"]
    rows, skipped = rf.decode_rows(runner, shape, np.float32, [(2, 16, 0), (8, 256, 0)], args, lambda s: None)
    assert [(r.batch, r.context) for r in rows] == [(2, 16)]
    assert skipped == [f"decode B=8 context 256: {rf.over_memory(large, small['total'])}"]
    need = {f: rf.decode_need(runner, 8, 256, np.float32, f)["total"] for f in (2, 3, 4)}
    assert rf.pool_factor(runner, 8, 256, np.float32, None) == 4
    assert rf.pool_factor(runner, 8, 256, np.float32, need[4]) == 4
    assert rf.pool_factor(runner, 8, 256, np.float32, need[4] - 1) == 3
    assert rf.pool_factor(runner, 8, 256, np.float32, need[3] - 1) == 2
    assert rf.pool_factor(runner, 8, 256, np.float32, need[2] - 1) is None


def test_components_pool_case_fits_the_memory_and_may_fail_alone(monkeypatch):
    """The pool-size component takes the largest pool that fits; when it alone fails (out of memory on
    a device: a step that copies the pool) the other components stand and its row names the failure;
    when another case fails, the ablation is not reported at all."""
    runner, shape = rf.build("tiny", np.float32)
    args = rf.finish_args(rf.parser().parse_args(["--model", "tiny", "--dtype", "f32", "--rounds", "1",
                                                  "--round-s", "0.01", "--multi-steps", "2"]))
    args.memory_limit = rf.decode_need(runner, 2, 32, np.float32, 3)["total"] - 1     # 2x fits, 3x does not
    setup = rf.DecodeLoop.setup

    def failing(self, what):
        if what(self):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        setup(self)
    monkeypatch.setattr(rf.DecodeLoop, "setup", lambda self: failing(self, lambda s: s.args[3] > 1))
    comps = rf.component_rows(runner, shape, np.float32, (2, 32), args, lambda s: None)
    assert [c.label for c in comps][-1] == "pool 2x larger (same live context) - step"
    assert comps[-1].note.startswith("did not run: RuntimeError: RESOURCE_EXHAUSTED")
    assert "FAIL" not in comps[-1].note                  # an outcome the row reports (device_check's FAIL scan)
    assert all(np.isfinite(c.t) for c in comps[:-1]) and len(comps) == 9
    monkeypatch.setattr(rf.DecodeLoop, "setup", lambda self: failing(self, lambda s: s.sync))
    with pytest.raises(RuntimeError, match="decode components: step, host reads each step's tokens: FAIL"):
        rf.component_rows(runner, shape, np.float32, (2, 32), args, lambda s: None)


class FakeCase:
    """A time_round_robin case: counts its calls; raises MemoryError from call `fail_at` on; moves
    the fake `clock` ([seconds]) 10 s per call."""

    def __init__(self, fail_at=None, clock=None):
        self.calls, self.fail_at, self.clock = 0, fail_at, clock

    def setup(self):
        pass

    def teardown(self):
        pass

    def __call__(self, iters):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise MemoryError("out of memory in round 2")
        if self.clock is not None:
            self.clock[0] += 10.0
        return iters


def test_a_case_failing_in_a_later_round_is_dropped_alone():
    """time_round_robin: a case that passes its first calls and raises in a timed round (a device
    running out of memory later) is listed in `failed` and left out, rounds done included; the
    others keep every round."""
    cases = {"ok": FakeCase(), "late": FakeCase(fail_at=5)}            # 2 warm-up calls, then 2 per round
    failed = []
    times = rf.time_round_robin(cases, 3, 0.0, lambda s: None, max_iters=1, failed=failed)
    assert list(times) == ["ok"] and len(times["ok"]) == 3 and list(cases) == ["ok"]
    assert failed == ["late: FAIL MemoryError: out of memory in round 2"]
    with pytest.raises(MemoryError):
        rf.time_round_robin({"late": FakeCase(fail_at=5)}, 3, 0.0, lambda s: None, max_iters=1)


def test_kv_write_component_makes_the_steps_writes():
    """The components' KV-write case as each attention path writes: the kernel path's per-layer
    writes in a layer scan leave the same pool as the gather path's one scatter (random K/V, a
    dropped padding row), and lowered for cuda the scan takes the pool donated (no copy)."""
    from preft_jax.config import tiny_config
    from preft_jax.paged_kv import PagedKVCache
    cfg = tiny_config(n_layers=3)
    L, KV, hd, R, NB, bs = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 3, 7, 16
    rng = np.random.default_rng(5)
    pool = lambda: PagedKVCache(*(jax.numpy.asarray(rng.normal(size=(L, KV, NB, bs, hd)), np.float32)   # noqa: E731
                                  for _ in range(2)))
    new = jax.numpy.asarray(rng.normal(size=(L, R, 1, KV, hd)), np.float32)
    widx = jax.numpy.asarray([[2 * bs + 5], [5 * bs], [NB * bs]], np.int32)      # the last row: dropped
    base = pool()
    want_label, gather = rf.kv_writes("gather")
    got_label, kernel = rf.kv_writes("kernel:gpu")
    assert want_label == "KV writes (write_kv alone)" and "write_token_layer" in got_label
    copy = lambda c: jax.tree.map(lambda x: x.copy(), c)      # noqa: E731  (each call donates its pool)
    want, got = gather(copy(base), new, widx), kernel(copy(base), new, widx)
    for g, w, b in ((got.k, want.k, base.k), (got.v, want.v, base.v)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert not np.array_equal(np.asarray(g), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(got.k)[:, :, 2, 5], np.asarray(new)[:, 0, 0])
    sds = jax.ShapeDtypeStruct
    text = lower_for(kernel, PagedKVCache(*(sds((L, KV, NB, bs, hd), jax.numpy.bfloat16),) * 2),
                     sds((L, R, 1, KV, hd), jax.numpy.bfloat16), sds((R, 1), np.int32), platform="cuda").as_text()
    sig = text.split("func.func public @main(", 1)[1].split(") ->", 1)[0]
    pools = [a for a in sig.split("%arg")[1:] if f"{L}x{KV}x{NB}x" in a]
    assert len(pools) == 2 and all("tf.aliasing_output" in a for a in pools), sig


def test_cpu_plans_against_the_hosts_available_memory(tmp_path):
    """On CPU the cases are checked against HOST_MEMORY_SHARE of MemAvailable (a 24 GiB machine ran
    out of memory in the components' 4x pool case unchecked); unreadable: None, unchecked."""
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert rf.host_memory(str(info)) == int(0.8 * 20000000 * 1024)
    info.write_text("MemTotal:       24000000 kB\n")
    assert rf.host_memory(str(info)) is None
    assert rf.host_memory(str(tmp_path / "missing")) is None
    with mock.patch.object(rf, "host_memory", lambda: 5 * rf.GiB):     # MemAvailable moves between reads
        hw = rf.hardware(np.float32, bandwidth=1e10, peak=1e11, measure=False)
    assert hw.memory == 5 * rf.GiB and "host memory planned against 5.0 GiB" in hw.line()
    # what the 24 GiB machine's run needed: the components' pool 4x the live context at B=64,
    # context 2048 (SmolLM2-135M, float32) is refused at 16 GiB, 2x taken
    runner, _ = rf.build("smollm2-135m", np.float32)
    assert rf.pool_factor(runner, 64, 2048, np.float32, 16 * rf.GiB) == 2


def test_components_past_their_deadline_are_skipped_not_failed():
    """component_rows with its deadline already passed: no case is compiled, and it raises
    DeadlineSkipped (the device run reports "skipped (budget)"), not a plain failure."""
    import argparse
    runner, shape = rf.build("tiny", np.float32)
    args = argparse.Namespace(rounds=1, round_s=0.0, multi_steps=2, memory_limit=None)
    with pytest.raises(rf.DeadlineSkipped, match=r"^decode components: step: skipped \(deadline before its first "
                                                  r"call\)$"):
        rf.component_rows(runner, shape, np.float32, (2, 16), args, lambda s: None, deadline=0.0)


def test_no_case_is_warmed_after_the_deadline():
    """time_round_robin: a case whose warm-up (compilation) would start after `deadline` is not set
    up or called, only listed as skipped; the cases warmed before it keep their round."""
    now = [100.0]
    cases = {"first": FakeCase(clock=now), "late": FakeCase()}        # the first one's warm-up passes the deadline
    failed = []
    with mock.patch.object(rf.time, "perf_counter", lambda: now[0]):
        times = rf.time_round_robin(cases, 3, 0.0, lambda s: None, max_iters=1, deadline=105.0, failed=failed)
    assert list(times) == ["first"] and len(times["first"]) == 1 and list(cases) == ["first"]
    assert failed == ["late: skipped (deadline before its first call)"]


def test_run_skips_what_the_device_memory_cannot_hold():
    """run() with --device-memory-gib below every case's need: the decode cases, the components and
    the trace are listed as skipped with their needs, nothing is measured or allocated for them."""
    args = rf.finish_args(rf.parser().parse_args(
        ["--model", "tiny", "--dtype", "f32", "--batches", "2", "--contexts", "16", "--prefill", "",
         "--no-engine", "--no-cost-check", "--component-case", "2,16", "--trace", "--rounds", "1",
         "--round-s", "0.01", "--no-measure", "--bandwidth", "10", "--peak", "1", "--device-memory-gib", "0.5"]))
    res = rf.run(args, log=lambda s: None)
    assert args.memory_limit == rf.GiB // 2
    assert res["rows"] == [] and res["components"] == [] and res["trace"] == []
    runner, _ = rf.build("tiny", np.float32)
    why = rf.over_memory(rf.decode_need(runner, 2, 16, np.float32), rf.GiB // 2)
    assert res["skipped"] == [f"decode B=2 context 16: {why}", f"components and trace of decode B=2 context 16: {why}"]
