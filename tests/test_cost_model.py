"""benchmarks/cost_model.py: parameter counts equal the published ones; bytes, FLOPs and the predicted
ratio by hand."""
import subprocess
import sys

from benchmarks import cost_model as cm


def test_parameter_counts_match_published_models():
    assert cm.LLAMA_8B.params() == 8_030_261_248           # meta-llama/Llama-3.1-8B
    assert cm.LLAMA_70B.params() == 70_553_706_496         # meta-llama/Llama-3.1-70B
    qkv_biases = 24 * (896 + 128 + 128)                    # Qwen2 has q/k/v biases; the model has none
    assert cm.QWEN_05B.params() + qkv_biases == 494_032_768   # Qwen/Qwen2.5-0.5B


def test_step_bytes_and_ratio_by_hand():
    s = cm.Shape("toy", vocab=100, d=8, layers=2, heads=2, kv_heads=1, head_dim=4, ffn=16, tied=True)
    # per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + 3 x 8x16 + 2 norms x 8 = 592; + embed 800 + final norm 8
    assert s.params() == 2 * 592 + 800 + 8
    base = cm.step(s, batch=3, context=5, nbytes=2, bw=1.0, peak=1e30)
    assert base["bytes"] == 2 * (2 * 592 + 800 + 8) + 3 * 5 * 2 * 2 * 4 * 2
    lora = cm.step(s, batch=3, context=5, targets=("q", "v"), rank=2, nbytes=2, bw=1.0, peak=1e30)
    assert lora["lora"] == 3 * 2 * (2 * (8 + 8) + 2 * (8 + 4)) * 2
    assert lora["t"] / base["t"] == (base["bytes"] + lora["lora"]) / base["bytes"]
    assert cm.step(s, 3, 5, (), 2, 2, bw=1e30, peak=1.0)["t"] == base["flops"]     # compute bound branch


def test_table_prints_every_shape():
    rows = cm.table(4.8e12, 989e12, 2)
    assert sum(r.startswith(f"| {s.name} |") for s in cm.SHAPES for r in rows) == 24


def test_model_configs_match_shapes():
    assert cm.shape("llama-3.1-8b") == cm.Shape("Llama-3.1-8B", *[getattr(cm.LLAMA_8B, f) for f in
                                                              ("vocab", "d", "layers", "heads", "kv_heads",
                                                               "head_dim", "ffn", "tied")])
    assert cm.shape("qwen2.5-0.5b").params() == cm.QWEN_05B.params()
    assert cm.shape("smollm2-135m").params() == 134_515_008                 # HuggingFaceTB/SmolLM2-135M


def test_decode_prefill_and_training_costs_by_hand():
    s = cm.Shape("toy", vocab=100, d=8, layers=2, heads=2, kv_heads=1, head_dim=4, ffn=16, tied=True)
    proj = 2 * (64 + 32 + 32 + 64 + 3 * 128)                                # 1152 projection weights
    assert s.matmul_params() == proj + 800
    d = cm.decode_cost(s, batch=3, context=5, nbytes=2)
    kv_token = 2 * 2 * 4 * 2                                                # layers x (k, v) x kv_dim x bytes
    assert d["bytes"] == 2 * (proj + 2 * 2 * 8 + 800 + 8) + 3 * 6 * kv_token + 3 * kv_token
    assert d["flops"] == 2 * (proj + 800) * 3 + 4 * 3 * 6 * 2 * 8
    assert cm.attention_pairs(2, 3, 4) == 2 * (3 * 4 + 6)
    p = cm.prefill_cost(s, rows=2, chunk=3, nbytes=2, targets=("q",), rank=2, adapters=2)
    lora = 2 * 2 * (8 + 8)                                                  # layers x r x (d_in + d_out)
    assert p["flops"] == 2 * proj * 6 + 4 * 2 * 6 * 2 * 8 + 2 * 8 * 100 * 2 + 2 * 6 * lora
    t = cm.lora_train_flops(s, batch=2, seq=3, targets=("q",), rank=2)
    attn = 4 * 2 * 6 * 2 * 8
    assert t["forward"] == 2 * proj * 6 + 2 * 800 * 6 + 2 * lora * 6 + attn
    assert t["backward"] == 2 * proj * 6 + 2 * 800 * 6 + 4 * lora * 6 + 2 * attn


def test_scripts_entry_point_still_prints_the_table():
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "cost_model.py")], capture_output=True, text=True,
                       timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("| Llama-3.1-8B |") == 8
