"""The PNG renderers: benchmark tables parsed from markdown (medians and min-max whiskers) and SFT
metrics parsed from an experiment folder, each rendered to a PNG of the expected size; progress
bars stay silent when stderr is not a terminal."""
import io
import json
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")

MD = """
| adapters N | base tok/s | all-token LoRA tok/s | PreFT-LoRA tok/s | PreFT-ReFT tok/s | PreFT-LoRA / all-token |
|---:|---:|---:|---:|---:|---:|
| 1 | 114.4 | 112.9 | 114.2 | 114.3 | 1.01x |
| 8 | 114.4 | 95.8 | 106.9 | 116.5 | 1.12x |

| N | base (1 run) | all-token LoRA | PreFT-LoRA | PreFT-ReFT |
|---:|---:|---:|---:|---:|
| 8 | 118.2 | 95.8 (95.7–97.2) | 106.9 (104.2–109.4) | 116.5 (114.5–117.8) |
"""


def _png_shape(path):
    import matplotlib.image
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path).shape


def test_benchmark_table_to_png(tmp_path):
    from experiments.serve_plots import rows_from_markdown, throughput_plot
    base, rows = rows_from_markdown(MD)
    assert base == 114.4 and sorted(rows) == [1, 8]
    assert rows[1]["PreFT-LoRA"] == (114.2, 114.2, 114.2)                 # no per-group row: no whisker
    assert rows[8]["all-token LoRA"] == (95.8, 95.7, 97.2) and rows[8]["PreFT-ReFT"] == (116.5, 114.5, 117.8)
    with pytest.raises(ValueError, match="adapters N"):
        rows_from_markdown("| nothing | here |\n|---|---|\n| 1 | 2 |\n")
    h, w, _ = _png_shape(throughput_plot(base, rows, str(tmp_path / "t.png")))
    assert (w, h) == (768, 504)                                           # 6.4 x 4.2 in at 120 dpi


def test_sft_metrics_to_png(tmp_path):
    from experiments.sft_plots import load_sft_metrics, sft_loss_plot
    rng = np.random.default_rng(0)
    for name in ("lora-r4-prefill", "lora-r4-all", "reft-r8-prefill"):
        rows = [{"step": s, "loss": float(1 / s + rng.random() * 0.01)} for s in range(1, 6)]
        rows[-1]["eval_loss"] = 0.3
        (tmp_path / f"sft-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "grpo-prefill.jsonl").write_text('{"step": 1}\n')           # not an SFT run
    runs = load_sft_metrics(tmp_path)
    assert sorted(runs) == [("lora", 4), ("reft", 8)] and sorted(runs[("lora", 4)]) == ["all", "prefill"]
    assert [r["step"] for r in runs[("reft", 8)]["prefill"]] == [1, 2, 3, 4, 5]
    h, w, _ = _png_shape(sft_loss_plot(tmp_path, str(tmp_path / "s.png")))
    assert (w, h) == (2 * 572, 396)                                       # 2 panels of 5.2 x 3.6 in at 110 dpi
    with pytest.raises(FileNotFoundError):
        sft_loss_plot(tmp_path / "empty", str(tmp_path / "x.png"))


def test_progress_is_quiet_off_a_terminal(monkeypatch):
    from preft_jax import progress as pg
    items = [1, 2, 3]
    monkeypatch.setattr(sys, "stderr", io.StringIO())                     # not a TTY
    assert pg.progress(items, "x") is items and not pg.enabled()
    bar = pg.progress(None, "x", total=3)
    bar.update(1), bar.set_postfix(loss=1.0), bar.close()

    class Tty(io.StringIO):
        def isatty(self):
            return True
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    assert list(pg.progress(items, "counting", total=3)) == items and "counting" in err.getvalue()
    assert pg.progress(items, "x", quiet=True) is items
    pg.set_quiet(True)
    try:
        assert pg.progress(items, "x") is items
    finally:
        pg.set_quiet(False)
