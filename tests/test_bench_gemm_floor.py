"""benchmarks/gemm_floor.py's Q4_1 variant: its blocks decode exactly as gguf's own Q4_1 dequantizer does, and
the in-jit dequantization reproduces those float32 values bit for bit."""
import gguf
import jax
import numpy as np

from benchmarks.gemm_floor import dequant_q4_1, q4_1


def _ggml_blocks(q, d, m):
    """One layer's (q [d_in, d_out], d, m [d_in / 32, d_out]) as ggml Q4_1 rows (one row per output column):
    per block of 32 inputs, f16 d, f16 m, then 16 bytes with element j in the low nibble and j + 16 in the high."""
    din, dout = q.shape
    rows = []
    for o in range(dout):
        blocks = []
        for b in range(din // 32):
            codes = q[b * 32:(b + 1) * 32, o]
            packed = (codes[:16] | (codes[16:] << 4)).astype(np.uint8)
            blocks.append(np.concatenate([np.float16(d[b, o]).reshape(1).view(np.uint8),
                                          np.float16(m[b, o]).reshape(1).view(np.uint8), packed]))
        rows.append(np.concatenate(blocks))
    return np.stack(rows)


def test_q4_1_decodes_like_gguf_and_in_jit():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((2, 64, 24)) * rng.uniform(0.01, 0.5, (2, 1, 24))).astype(np.float32)
    (q, d, m), decoded = q4_1(w)
    assert q.dtype == np.uint8 and q.max() <= 15 and len(np.unique(q)) == 16
    assert np.all(np.abs(decoded - w) <= np.repeat(d, 32, axis=1) * 0.5 + 1e-3 * np.abs(w).max())
    for layer in range(2):
        ref = gguf.quants.dequantize(_ggml_blocks(q[layer], d[layer], m[layer]), gguf.GGMLQuantizationType.Q4_1)
        np.testing.assert_array_equal(ref.T, decoded[layer])            # gguf rows are output columns
        got = jax.jit(dequant_q4_1)(q[layer], d[layer], m[layer])
        np.testing.assert_array_equal(np.asarray(got), decoded[layer])
