"""Throughput vs number of adapters, per variant, as a PNG (matplotlib; `pip install matplotlib`).

    python -m experiments.serve_benchmark ... --plot docs/benchmark_throughput.png     # from a run
    python -m experiments.serve_plots docs/benchmarks.md docs/benchmark_throughput.png  # from the tables in the doc

`throughput_plot(base, rows, path)`: `rows` = {N: {variant: (median, min, max)}}; the base model is a
horizontal line (its median over the N groups). From a markdown file, the first table whose header
starts `| adapters N | base tok/s |` gives the medians and the per-group `| N | base (1 run) | ...`
table (if present) the min-max whiskers.
"""
from __future__ import annotations

import argparse
import re

VARIANTS = ("all-token LoRA", "PreFT-LoRA", "PreFT-ReFT")


def throughput_plot(base: float | None, rows: dict, path: str, title: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ns = sorted(rows)
    for label, marker in zip(VARIANTS, "osD"):
        pts = [(n, rows[n][label]) for n in ns if label in rows[n]]
        if not pts:
            continue
        x = [n for n, _ in pts]
        med = [v[0] for _, v in pts]
        lo = [v[0] - v[1] for _, v in pts]
        hi = [v[2] - v[0] for _, v in pts]
        ax.errorbar(x, med, yerr=[lo, hi], marker=marker, capsize=3, label=label)
    if base is not None:
        ax.axhline(base, color="gray", linestyle="--", label="base (no adapter)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("adapters N (each request picks one at random)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title or "Serving throughput vs number of adapters")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _table(lines: list[str], header_re: str) -> list[list[str]]:
    for i, line in enumerate(lines):
        if re.match(header_re, line.strip()):
            out = []
            for row in lines[i + 2:]:
                if not row.strip().startswith("|"):
                    break
                out.append([c.strip() for c in row.strip().strip("|").split("|")])
            return out
    return []


def _num(cell: str) -> float:
    return float(re.match(r"[-\d.]+", cell).group(0))


def rows_from_markdown(text: str) -> tuple[float | None, dict]:
    """(base median, {N: {variant: (median, min, max)}}) from docs/benchmarks.md's result tables."""
    lines = text.splitlines()
    main = _table(lines, r"\|\s*adapters N\s*\|\s*base tok/s\s*\|")
    if not main:
        raise ValueError("no '| adapters N | base tok/s | ...' table found")
    rows, base = {}, None
    for cells in main:
        n = int(cells[0])
        base = _num(cells[1])
        rows[n] = {label: (_num(c),) * 3 for label, c in zip(VARIANTS, cells[2:5])}
    for cells in _table(lines, r"\|\s*N\s*\|\s*base \(1 run\)\s*\|"):
        n = int(cells[0])
        for label, c in zip(VARIANTS, cells[2:5]):
            m = re.match(r"([\d.]+)\s*\(([\d.]+)\s*[–-]\s*([\d.]+)\)", c)
            if m and n in rows:
                rows[n][label] = tuple(float(g) for g in m.groups())
    return base, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="throughput vs adapters PNG from benchmark tables in a markdown file")
    ap.add_argument("markdown")
    ap.add_argument("png")
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    with open(a.markdown, encoding="utf-8") as f:
        base, rows = rows_from_markdown(f.read())
    print(throughput_plot(base, rows, a.png, a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
