"""benchmarks.memory_plan: plans compiled from abstract shapes, what they prove about the sharded steps,
and their figures against docs/memory.md and against a real run's peak RSS.

Plans on several fake CPU devices run in subprocesses (the device count is fixed when jax starts).
"""
import re
import textwrap

import pytest
from fake_devices import ROOT, run_on_fake_devices

from benchmarks import memory_plan as mp

GiB = 1 << 30

# Weight-heavy small Llama (per layer 24 MiB of bf16 weights, 8 layers) planned on fake devices.
# Plans compile with run_on_fake_devices(cheap_codegen=True) (the buffer assignment, hence every byte figure, is made
# before the codegen it makes cheaper; plans never run the code).
SMALL = textwrap.dedent(r"""
    import json
    from benchmarks import memory_plan as mp
    from preft_jax.config import tiny_config
    cfg = tiny_config(vocab_size=2048, d_model=1024, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=128,
                      ffn_dim=4096, max_seq_len=4096)
    layer_weights = {"wq": 1024 * 1024, "wk": 1024 * 512, "wv": 1024 * 512, "wo": 1024 * 1024,
                     "w_gate": 1024 * 4096, "w_up": 1024 * 4096, "w_down": 4096 * 1024}
    out = {"largest_layer_weight": 2 * max(layer_weights.values()),
           "model_weights": 2 * (8 * sum(layer_weights.values()) + 2048 * 1024)}
""")


@pytest.fixture(scope="module")
def small_plans():
    script = SMALL + textwrap.dedent(r"""
        sft = mp.plan(mp.PlanSpec(task="sft", mesh=(1, 4, 1), batch=4, seq=64), cfg=cfg)
        q = sft.programs[0]
        out["fsdp"] = {"gathered": q.gathered, "temp": q.temp, "alias": q.alias, "parts": sft.parts}
        serve = {}
        for kv in (4096, 16384):
            p = mp.plan(mp.PlanSpec(task="serve", adapters=8, kv_tokens=kv, max_num_seqs=8, max_model_len=512,
                                    max_num_batched_tokens=256, max_prefill_seqs=2, mode="all"), cfg=cfg)
            serve[kv] = {"parts": p.parts, "programs": [{"name": x.name, "temp": x.temp, "alias": x.alias,
                                                         "output": x.output} for x in p.programs]}
        out["serve"] = serve
        import jax
        from preft_jax import sharding as shd
        from preft_jax.adapters.bank import empty_bank
        from preft_jax.adapters.config import LORA_TARGETS
        bank = jax.eval_shape(lambda: empty_bank(cfg, 33, LORA_TARGETS, 16))
        placed = {t: mp.attach(bank, shd.bank_shardings(bank, shd.make_mesh(1, 1, t), cfg)) for t in (1, 4)}
        out["bank"] = {t: mp.shard_bytes((b.lora_A, b.lora_B)) for t, b in placed.items()}   # per-slot policies aside
        out["compile_s"] = [q.compile_s for q in sft.programs + p.programs]
        print("RESULT" + json.dumps(out))
    """)
    return run_on_fake_devices(script, n_devices=4, cheap_codegen=True)


@pytest.mark.slow          # the module's plans compile in ~30 s
def test_fsdp_gathers_one_layer_at_a_time(small_plans):
    """fsdp=4 training: every all-gather inside the step makes at most one layer's weight (the scan
    gathers layer by layer), never a layer-stacked array; the temporaries stay far below the model."""
    r = small_plans
    f = r["fsdp"]
    assert 0 < f["gathered"] <= r["largest_layer_weight"], f
    assert f["temp"] < r["model_weights"] / 2, f
    assert f["parts"]["weights"] == pytest.approx(r["model_weights"] / 4, rel=0.01)   # stored split 4 ways
    state = f["parts"]["adapter_params"] + f["parts"]["optimizer_state"] + 4          # + the int32 step
    assert f["alias"] == state                                                          # train state donated


@pytest.mark.slow          # the module's plans compile in ~30 s
def test_serve_temporaries_do_not_grow_with_the_kv_pool(small_plans):
    """The pool is donated and written in place: 4x the pool gives the same temporaries, and the
    whole pool is reused as the output (alias bytes = pool bytes)."""
    small, big = small_plans["serve"]["4096"], small_plans["serve"]["16384"]
    assert big["parts"]["kv_pool"] > 3.9 * small["parts"]["kv_pool"]
    for a, b in zip(small["programs"], big["programs"]):
        assert a["name"] == b["name"]
        assert b["temp"] <= a["temp"] * 1.02 + (1 << 20), (a, b)
        assert a["alias"] == small["parts"]["kv_pool"] and b["alias"] == big["parts"]["kv_pool"]
        assert b["output"] - b["alias"] < (1 << 20)           # the sampled tokens / last logits only


@pytest.mark.slow          # the module's plans compile in ~30 s
def test_adapter_bank_is_split_over_tensor(small_plans):
    """A bank of 32 adapters at tensor=4 holds a quarter of the bank per device (every LoRA array is
    split: its rank takes the mesh axis its projection dimension leaves)."""
    b = small_plans["bank"]
    assert b["4"] * 4 == b["1"], b


def test_parse_bytes():
    assert mp.parse_bytes("80GiB") == 80 * GiB
    assert mp.parse_bytes("24GB") == 24 * 10 ** 9
    assert mp.parse_bytes("24g") == 24 * GiB
    assert mp.parse_bytes("1.5TiB") == int(1.5 * 1024 * GiB)
    assert mp.parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="not a byte size: 'lots'"):
        mp.parse_bytes("lots")


def test_all_gathers_parses_hlo():
    text = ("%all-gather.1 = f16[8192,28672]{1,0} all-gather(%p), dimensions={0}\n"
            "%ag = (f32[2,16]{1,0}, bf16[4]{0}) all-gather(%a, %b)\n"
            "%x = f32[8]{0} add(%y, %z)\n")
    assert mp.all_gathers(text) == [8192 * 28672 * 2, 2 * 16 * 4, 4 * 2]


# ---------------------------------------------------------------------------- docs/memory.md
def table_rows() -> dict:
    """{row name: (argv, per-device peak GiB)} from the plan table of docs/memory.md."""
    rows = {}
    text = (ROOT / "docs" / "memory.md").read_text(encoding="utf-8")
    for line in text.splitlines():
        m = re.match(r"\|\s*(\w[\w.-]*)\s*\|.*\|\s*([\d.]+)\s*\|[^|]*\|\s*`([^`]*)`\s*\|\s*$", line)
        if m and "benchmarks.memory_plan" in m.group(3):
            rows[m.group(1)] = (m.group(3).split("benchmarks.memory_plan", 1)[1].split(), float(m.group(2)))
    return rows


ROWS = table_rows()


def test_docs_table_is_parsed():
    assert {"serve-8b-1x80", "serve-70b-tp4", "serve-70b-tp8", "sft-8b-1x80", "sft-70b-fsdp8",
            "grpo-8b-1x80"} <= set(ROWS), sorted(ROWS)


@pytest.fixture(scope="module")
def planned_peaks(tmp_path_factory) -> dict:
    """{row: per-device peak bytes, or the error} of every docs/memory.md row, planned in ONE process
    (a process per row paid jax's start-up 13 times) with cheaper codegen (`cheap_codegen=True`:
    the same peaks; 2026-12-07, the grpo-8b-1x80 and sft-smollm2-f32 rows to the byte)."""
    folder = tmp_path_factory.mktemp("plans")
    rows = {row: argv + ["--json", str(folder / f"{row}.json")] for row, (argv, _) in ROWS.items()}
    script = textwrap.dedent(f"""
        import json, traceback
        from benchmarks import memory_plan as mp
        mp.set_fake_devices(8)                  # the largest mesh; a smaller plan takes the first devices
        out = {{}}
        for row, argv in {rows!r}.items():
            try:
                out[row] = ["peak", max(p["peak"] for p in json.load(open(argv[-1])))] if mp.main(argv) == 0 else \
                    ["error", "exit status != 0"]
            except BaseException:
                out[row] = ["error", traceback.format_exc()[-2000:]]
        print("RESULT" + json.dumps(out))
    """)
    return run_on_fake_devices(script, n_devices=8, timeout=3600, cheap_codegen=True)


@pytest.mark.slow
@pytest.mark.parametrize("row", sorted(ROWS))
def test_plan_within_10pct_of_docs_table(row, planned_peaks):
    """A plan's per-device peak must not grow past docs/memory.md's figure by more than 10% (a change
    that makes a step hold more - a lost donation, a hoisted all-gather, remat off - fails here)."""
    want = ROWS[row][1]
    kind, got = planned_peaks[row]
    assert kind == "peak", got
    assert got / GiB <= want * 1.10, f"{row}: plan {got / GiB:.2f} GiB vs docs/memory.md {want} GiB"


@pytest.mark.slow
def test_smollm2_plan_matches_measured_peak_rss():
    """The SmolLM2-135M float32 serving prefill call and SFT step, compiled as the plan compiles them,
    run for real on zero inputs: the process's peak RSS growth is within 20% of the plan's bytes."""
    script = textwrap.dedent(r"""
        import json
        from benchmarks import memory_plan as mp
        out = {}
        for spec in (mp.PlanSpec(model="smollm2-135m", task="serve", dtype="float32", adapters=16, kv_tokens=16384,
                                 max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=512),
                     mp.PlanSpec(model="smollm2-135m", task="sft", dtype="float32", batch=4, seq=256),
                     mp.PlanSpec(model="smollm2-135m", task="sft", dtype="float32", batch=4, seq=256, quantize="int8")):
            p = mp.plan(spec)
            q = p.peak_program
            out[spec.task + (f"-{spec.quantize}" if spec.quantize else "")] = [mp.measure(q), q.peak - q.resident]
        print("RESULT" + json.dumps(out))
    """)
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here (the peak-RSS mark cannot be reset)")
    r = run_on_fake_devices(script, n_devices=1, timeout=1800)
    for task, (measured, planned) in r.items():
        assert planned > 256 << 20, (task, planned)           # a real amount of memory, not noise
        assert abs(measured / planned - 1) < 0.20, (task, measured / GiB, planned / GiB)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_plan_weights_equal_the_real_quantized_model(mode):
    """A `--quantize` plan's base weights are the abstract twin of what `quantize_params` makes of real
    random weights: the same bytes (int4 counted packed, 4 bits), weight by weight."""
    import jax
    import numpy as np
    from flax import nnx
    from preft_jax.config import tiny_config
    from preft_jax.model import Llama
    from preft_jax.quantize import quantize_params
    cfg = tiny_config(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=256)
    spec = mp.PlanSpec(model="smollm2-135m", task="sft", dtype="float32", quantize=mode)
    planned = mp.abstract_model(cfg, spec)
    real = Llama(cfg, rngs=nnx.Rngs(3), dtype="float32")
    params = {n: np.asarray(getattr(real.layers, n).get_value()) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                                           "w_down")}
    params["embed"] = np.asarray(real.embed.get_value())
    q = quantize_params(cfg, params, mode)
    for name, value in q.items():
        holder = planned if name == "embed" else planned.layers
        want = jax.tree.leaves(value)
        got = jax.tree.leaves(getattr(holder, name).get_value())
        assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want], name
        assert mp.shard_bytes(got) == sum(-(-w.size * mp.dtype_bits(w.dtype) // 8) for w in want), name
    bits = {str(x.dtype) for x in jax.tree.leaves(planned.layers.wq.get_value())}
    assert ("int4" if mode == "int4" else "int8") in bits
