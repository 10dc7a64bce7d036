"""SFT loss curves per adapter / rank and mode, as a PNG (matplotlib), from an experiment's saved
metrics (`<out>/sft-<adapter>-r<rank>-<mode>.jsonl`, written by experiments/prefill_vs_all.py).

    python -m experiments.prefill_vs_all --out runs/experiment --plot docs/sft_loss.png   # after (or instead of) a run
    python -m experiments.sft_plots runs/experiment docs/sft_loss.png
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re

_NAME = re.compile(r"^sft-(?P<adapter>[a-z]+)-r(?P<rank>\d+)-(?P<mode>prefill|all)\.jsonl$")


def load_sft_metrics(out: str | pathlib.Path) -> dict:
    """{(adapter, rank): {mode: [rows]}} from the run folder's sft-*.jsonl files."""
    runs: dict = {}
    for path in sorted(pathlib.Path(out).glob("sft-*.jsonl")):
        m = _NAME.match(path.name)
        if not m:
            continue
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if rows:
            runs.setdefault((m["adapter"], int(m["rank"])), {})[m["mode"]] = rows
    return runs


def sft_loss_plot(out: str | pathlib.Path, path: str, title: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_sft_metrics(out)
    if not runs:
        raise FileNotFoundError(f"no sft-<adapter>-r<rank>-<mode>.jsonl metrics in {out}")
    keys = sorted(runs, key=lambda k: (k[0] != "lora", k[1]))
    cols = min(2, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), dpi=110, squeeze=False, sharey=True)
    for ax, key in zip(axes.flat, keys):
        for mode, color in (("prefill", "C0"), ("all", "C1")):
            rows = runs[key].get(mode)
            if not rows:
                continue
            label = "prefill-only (PreFT)" if mode == "prefill" else "all-token"
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=color, label=f"{label} train")
            ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
            if ev:
                ax.plot(*zip(*ev), "o", color=color, label=f"{label} eval")
        ax.set_title(f"{'LoRA' if key[0] == 'lora' else 'LoReFT'} rank {key[1]}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (response tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(title or "SFT loss: prefill-only vs all-token adapters")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="SFT loss curves PNG from an experiment folder's metrics")
    ap.add_argument("out", help="the experiment's --out folder")
    ap.add_argument("png")
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    print(sft_loss_plot(a.out, a.png, a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
