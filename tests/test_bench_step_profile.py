"""benchmarks/step_profile.py: the trace aggregation, and the script end to end on the tiny model."""
import pytest

from adapter_factory import random_lora
from benchmarks import step_profile
from preft_jax.adapters.peft_io import save_peft_lora
from preft_jax.config import tiny_config


def test_op_table_groups_suffixes_and_divides_by_steps():
    events = [
        {"ph": "X", "name": "ynn_fusion.12", "dur": 300.0},
        {"ph": "X", "name": "ynn_fusion", "dur": 100.0},
        {"ph": "X", "name": "ynn_fusion.3", "dur": 200.0},
        {"ph": "X", "name": "copy_bitcast_fusion.1", "dur": 1000.0},
        {"ph": "X", "name": "$profiler.py:10 trace", "dur": 9e9},          # Python frame: dropped
        {"ph": "i", "name": "ynn_fusion.4", "dur": 5e6},                 # not a complete event
        {"ph": "X", "name": "dot", "dur": 50.0},
    ]
    table = step_profile.op_table(events, steps=2)
    assert list(table) == ["copy_bitcast_fusion", "ynn_fusion", "dot"]   # largest first
    assert table["copy_bitcast_fusion"] == (0.5, 0.5)                     # 1000 us, 1 call over 2 steps
    assert table["ynn_fusion"] == pytest.approx((0.3, 1.5))               # 600 us, 3 calls over 2 steps
    assert table["dot"] == pytest.approx((0.025, 0.5))


def test_step_profile_runs_on_the_tiny_model(capsys):
    assert step_profile.main(["--model", "tiny", "--requests", "4", "--prompt-len", "8", "--max-tokens", "4",
                              "--repeats", "1", "--trace-steps", "1", "--top", "50"]) == 0
    out = capsys.readouterr().out
    assert "base engine: " in out and ", 4 calls" in out                 # 1 prefill + 3 decode
    assert "| decode step (4 rows), median of 3 |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "fusion" in line]
    assert rows and all(float(r.split("|")[2]) >= 0 for r in rows)


@pytest.mark.slow
def test_step_profile_times_a_preft_engine_beside_base(tmp_path, capsys):
    cfg = tiny_config(max_seq_len=2048)                                   # load_runner("tiny")'s config
    for i in range(3):
        save_peft_lora(tmp_path / f"lora_{i}", random_lora(cfg, 40 + i, rank=4, targets=("q", "k", "v", "o")), cfg)
    assert step_profile.main(["--model", "tiny", "--requests", "4", "--prompt-len", "8", "--max-tokens", "3",
                              "--repeats", "2", "--trace-steps", "0", "--adapter-dir", str(tmp_path),
                              "--n-adapters", "3"]) == 0
    out = capsys.readouterr().out
    assert "PreFT-LoRA engine: " in out
    assert "| per-call device time, median ms (min-max over repeats) | base | PreFT-LoRA |" in out
    prefill = next(line for line in out.splitlines() if line.startswith("| prefill (4 rows x "))
    assert len(prefill.split("|")) == 5                                  # label + two variants
    assert "# prefill PreFT-LoRA / base: " in out
