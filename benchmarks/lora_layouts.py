"""The jnp backend's LoRA layouts for prefill chunks, side by side: masked product, rows, per-token gather.

    python -m benchmarks.lora_layouts [--repeats 5] [--calls 120] [--d 576] [--rank 16]

One timed unit = `--calls` LoRA projections d -> d at the given rank (120 = 30 layers x q/k/v/o),
chained in one jitted scan so that dispatch is not timed. Each case is a chunk shape (rows x tokens)
and a bank size; every row holds one adapter (a random slot >= 1, as each prefill row is one request)
and 30 % of its tokens are base (slot 0: a first/last-k window). Every layout of a case is timed
round-robin with the others; the output is checked against `apply.lora_gather` before timing. The
table gives ms per unit, median (min-max), and rows' speed-up over the others.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.adapters import apply
from preft_jax.adapters.context import MASKED_MAX_SLOTS

CASES = ((32, 16, 2), (32, 16, 9), (32, 16, 33), (1, 512, 9), (4, 256, 9))      # rows, tokens per row, slots


def _chained(fn, calls):
    """calls x fn in one jitted scan (each call's input nudged by the last result so none is elided)."""
    def run(x, *args):
        def body(c, _):
            return c + fn(x + c * 1e-9, *args).sum() * 1e-9, None
        return jax.lax.scan(body, jnp.zeros((), x.dtype), None, length=calls)[0]
    return jax.jit(run)


def _case(rows, cols, n, d, rank, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows * cols, d), np.float32))
    A = rng.standard_normal((n, d, rank), np.float32) * 0.05
    B = rng.standard_normal((n, rank, d), np.float32) * 0.05
    A[0], B[0] = 0, 0                                                 # slot 0 = base, as in every bank
    row_slots = rng.integers(1, n, rows).astype(np.int32)
    slots = np.where(rng.random((rows, cols)) < 0.7, row_slots[:, None], 0).reshape(-1).astype(np.int32)
    return x, jnp.asarray(A), jnp.asarray(B), jnp.asarray(row_slots), jnp.asarray(slots)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=120)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args(argv)
    layouts = {"masked": _chained(apply.lora_masked, args.calls), "rows": _chained(apply.lora_rows, args.calls),
               "gather": _chained(apply.lora_gather, args.calls)}
    print(f"# jax {jax.__version__} ({jax.devices()[0].platform}); {args.calls} projections {args.d} -> {args.d} "
          f"at rank {args.rank} per unit; masked only up to {MASKED_MAX_SLOTS} slots (the backend's switch)")
    print("| rows x tokens | slots | masked ms | rows ms | gather ms | rows vs masked | rows vs gather |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, (rows, cols, n) in enumerate(CASES):
        x, A, B, row_slots, slots = _case(rows, cols, n, args.d, args.rank, i)
        run = {"masked": lambda: layouts["masked"](x, A, B, slots),
               "rows": lambda: layouts["rows"](x, A, B, row_slots, slots),
               "gather": lambda: layouts["gather"](x, A, B, slots)}
        if n > MASKED_MAX_SLOTS:
            del run["masked"]
        want = np.asarray(apply.lora_gather(x, A, B, slots))
        got = np.asarray(apply.lora_rows(x, A, B, row_slots, slots))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        times = {k: [] for k in run}
        for f in run.values():
            f().block_until_ready()
        for _ in range(args.repeats):
            for k, f in run.items():
                t0 = time.perf_counter()
                f().block_until_ready()
                times[k].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        cell = lambda k: f"{med[k]:.1f} ({min(times[k]):.1f}-{max(times[k]):.1f})" if k in med else "-"
        ratio = lambda k: f"{med[k] / med['rows']:.2f}x" if k in med else "-"
        print(f"| {rows} x {cols} | {n} | {cell('masked')} | {cell('rows')} | {cell('gather')} | {ratio('masked')} "
              f"| {ratio('gather')} |")
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
