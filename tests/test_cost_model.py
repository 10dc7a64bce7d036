"""scripts/cost_model.py: parameter counts equal the published ones; bytes and the predicted ratio by hand."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import cost_model as cm  # noqa: E402


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
