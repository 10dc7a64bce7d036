// Native CPU decode for float32 Llama-family models, as XLA FFI handlers (see pallas_kernels/cpu).
//
//   PreftPackedMatmul   y [M, N] = x [M, K] @ W (or W[layer] of a stack), W packed in column panels [P, K, 48]
//   PreftDecodeStep     one token per row through every decoder layer over a paged KV pool, then
//                       the final norm and LM head: logits [M, V] and each row's argmax
//
// Weights are packed once (pack_panels in decode.py): panel p holds columns [48p, 48p + 48) of
// W [K, N] as K contiguous rows of 48 floats (zero-padded past N), so a GEMM streams each panel
// once, in order. The register tile is 8 rows x 48 columns with AVX-512, passes of fewer rows and
// columns without it (see Tile); the panels are split across threads (OpenMP). The code is plain C++
// with GCC vector extensions: AVX-512 machines get 16-lane vectors, others the compiler's split of them;
// intrinsics only for horizontal sums (HSum with AVX-512, attention's Dot8 with AVX).
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 48;  // panel width (3 vectors of 16)
constexpr int64_t kMR = 8;   // rows per register tile
typedef float v16 __attribute__((vector_size(64), aligned(4)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16*>(p) = v; }

// C[mr, 48] (+)= A[mr, K] (row stride lda, rows padded to 8 by the caller) @ panel [K, 48].
// `prefetch` (or null): pf_step floats of the next panel to pull into cache per k, so that panel's
// DRAM stream overlaps this tile's arithmetic (the tiles of one panel split the next panel).
//
// The register tile is sized for the machine's vector registers: with AVX-512 (32 x 16 lanes) one
// pass holds all 8 x 48 outputs (24 accumulators); without it (AVX2: 16 x 8 lanes) that tile would
// spill most of its accumulators to the stack on every k (~18x slower), so the tile runs as passes
// of 4 rows x 24 columns (12 accumulators, 3 panel vectors, 1 broadcast), and the last 1-3 rows
// (a decode step of one row) as passes of 2 or 1 rows over all 48 columns, streaming the panel
// once. Each output element sums over k in the same order either way.
#ifdef __AVX512F__
inline void Tile(const float* A, int64_t lda, const float* panel, int64_t K, float* C, int64_t ldc, int64_t mr,
                 int64_t nvalid, bool accumulate, const float* prefetch, int64_t pf_step) {
  v16 c[kMR][3];
  for (int r = 0; r < kMR; ++r) c[r][0] = c[r][1] = c[r][2] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    const float* b = panel + k * kNR;
    if (prefetch)
      for (int64_t j = 0; j < pf_step; j += 16) __builtin_prefetch(prefetch + k * pf_step + j, 0, 3);
    const v16 b0 = load(b), b1 = load(b + 16), b2 = load(b + 32);
#pragma GCC unroll 8
    for (int r = 0; r < kMR; ++r) {
      const float a = A[r * lda + k];
      c[r][0] += a * b0;
      c[r][1] += a * b1;
      c[r][2] += a * b2;
    }
  }
  for (int64_t r = 0; r < mr; ++r) {
    float* out = C + r * ldc;
    if (nvalid == kNR) {
      for (int j = 0; j < 3; ++j) store(out + 16 * j, accumulate ? load(out + 16 * j) + c[r][j] : c[r][j]);
    } else {
      alignas(64) float tmp[kNR];
      for (int j = 0; j < 3; ++j) store(tmp + 16 * j, c[r][j]);
      for (int64_t n = 0; n < nvalid; ++n) out[n] = accumulate ? out[n] + tmp[n] : tmp[n];
    }
  }
}
#else
typedef float v8 __attribute__((vector_size(32), aligned(4)));
inline v8 load8(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void store8(float* p, v8 v) { *reinterpret_cast<v8*>(p) = v; }

// One pass: C[R, 8 NV] (+)= A[R, K] @ panel columns [n0, n0 + 8 NV) (b = panel + n0), R x NV
// accumulators; `cols` (<= 8 NV) of them written.
template <int R, int NV>
inline void Pass(const float* A, int64_t lda, const float* b, int64_t K, float* C, int64_t ldc, int64_t cols,
                 bool accumulate, const float* prefetch, int64_t pf_step) {
  v8 c[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) c[r][j] = v8{};
  for (int64_t k = 0; k < K; ++k, b += kNR) {
    if (prefetch)
      for (int64_t j = 0; j < pf_step; j += 16) __builtin_prefetch(prefetch + k * pf_step + j, 0, 3);
#pragma GCC unroll 6
    for (int j = 0; j < NV; ++j) {
      const v8 bj = load8(b + 8 * j);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) c[r][j] += A[r * lda + k] * bj;
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = C + r * ldc;
    if (cols == 8 * NV) {
      for (int j = 0; j < NV; ++j) store8(out + 8 * j, accumulate ? load8(out + 8 * j) + c[r][j] : c[r][j]);
    } else {
      alignas(32) float tmp[8 * NV];
      for (int j = 0; j < NV; ++j) store8(tmp + 8 * j, c[r][j]);
      for (int64_t n = 0; n < cols; ++n) out[n] = accumulate ? out[n] + tmp[n] : tmp[n];
    }
  }
}

inline void Tile(const float* A, int64_t lda, const float* panel, int64_t K, float* C, int64_t ldc, int64_t mr,
                 int64_t nvalid, bool accumulate, const float* prefetch, int64_t pf_step) {
  int64_t r = 0;
  for (; r + 4 <= mr; r += 4)                         // 4 rows x 24 columns, twice
    for (int64_t n0 = 0; n0 < nvalid; n0 += 24, prefetch = nullptr)
      Pass<4, 3>(A + r * lda, lda, panel + n0, K, C + r * ldc + n0, ldc, std::min<int64_t>(24, nvalid - n0),
                 accumulate, prefetch, pf_step);
  for (; r + 2 <= mr; r += 2, prefetch = nullptr)     // the rest: the whole panel in one pass per 1-2 rows
    Pass<2, 6>(A + r * lda, lda, panel, K, C + r * ldc, ldc, nvalid, accumulate, prefetch, pf_step);
  if (r < mr) Pass<1, 6>(A + r * lda, lda, panel, K, C + r * ldc, ldc, nvalid, accumulate, prefetch, pf_step);
}
#endif

// Threads for a parallel region of `flops` floating-point operations: one per kParallelFlops, at
// least one, at most omp_get_max_threads(). A fork-join costs microseconds, and every barrier waits
// for its slowest thread: on a machine whose cores also run the serving engine's host thread, a
// region split thinner than that ran slower than on one thread and stalled whenever the host ran
// (the tiny model's 64-row step: ~1.0-1.2 ms on two threads, ~0.7 ms on one, which then overlaps
// the host's work on the other core). Each output element is computed by one thread in the same
// order whatever the count, so results do not depend on it.
constexpr int64_t kParallelFlops = int64_t{1} << 21;
int ThreadsFor(int64_t flops) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(flops / kParallelFlops, omp_get_max_threads())));
}

// A packed weight matrix [P, K, 48] holding N columns.
struct Packed {
  const float* w = nullptr;
  int64_t K = 0, N = 0;
  int64_t panels() const { return (N + kNR - 1) / kNR; }
};

// C [M, N] (+)= A [M, K] @ W. A's rows must be readable up to a multiple of 8 (callers pass buffers
// padded to that; the padding rows are never written back). Each thread takes a contiguous range of
// panels; while it works on one panel its tiles prefetch its next, and on its last panel, the first
// of its range in `next` (the GEMM that follows, if any): the weight stream never stalls on DRAM.
void Gemm(const float* A, int64_t M, Packed W, float* C, bool accumulate, Packed next = Packed()) {
  const int64_t P = W.panels(), K = W.K, N = W.N;
  const int64_t tiles = std::min<int64_t>((M + kMR - 1) / kMR, 4);   // tiles that prefetch
#pragma omp parallel num_threads(ThreadsFor(2 * M * K * N))
  {
    const int64_t T = omp_get_num_threads(), th = omp_get_thread_num();
    const int64_t p0 = P * th / T, p1 = P * (th + 1) / T;
    const int64_t q0 = next.w ? next.panels() * th / T : 0;
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = W.w + p * K * kNR;
      const float* ahead = nullptr;                   // the panel to pull in while this one runs
      int64_t ahead_floats = 0;
      if (p + 1 < p1) {
        ahead = panel + K * kNR, ahead_floats = K * kNR;
      } else if (next.w && q0 < next.panels()) {
        ahead = next.w + q0 * next.K * kNR, ahead_floats = next.K * kNR;
      }
      const int64_t pf_step = ahead ? ((ahead_floats + tiles * K - 1) / (tiles * K) + 15) / 16 * 16 : 0;
      const int64_t nvalid = std::min(kNR, N - p * kNR);
      for (int64_t m = 0, t = 0; m < M; m += kMR, ++t) {
        const float* pf = (ahead && t < tiles) ? ahead + t * K * pf_step : nullptr;
        Tile(A + m * K, K, panel, K, C + m * N + p * kNR, N, std::min(kMR, M - m), nvalid, accumulate, pf, pf_step);
      }
    }
  }
}


// exp on 16 lanes: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), p of degree 6
// (relative error ~1e-7 on [-ln2/2, ln2/2]); x clamped to [-87, 88].
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
inline v16 VecExp(v16 x) {
  x = x < -87.0f ? v16{} - 87.0f : x;
  x = x > 88.0f ? v16{} + 88.0f : x;
  const float shifter = 12582912.0f;                       // 1.5 * 2^23: adding it rounds to an integer
  const v16 t = x * 1.44269504088896341f + shifter;
  const v16 n = t - shifter;
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = 1.0f / 720 + r * 0.0f;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const v16i bits = (reinterpret_cast<const v16i&>(t) - 0x4B400000 + 127) << 23;
  return p * reinterpret_cast<const v16&>(bits);
}

// out[i] = silu(g[i]) * u[i]
void SiluMul(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 gv = load(g + i);
    store(out + i, gv / (1.0f + VecExp(-gv)) * load(u + i));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

inline float HSum(v16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(v));
#else  // halves, quarters, then 4 lanes (plain loads: __builtin_shufflevector needs GCC >= 12)
  typedef float v4 __attribute__((vector_size(16), aligned(4)));
  const float* f = reinterpret_cast<const float*>(&v);
  alignas(32) float h[8];
  store8(h, load8(f) + load8(f + 8));
  const v4 b = *reinterpret_cast<const v4*>(h) + *reinterpret_cast<const v4*>(h + 4);
  return (b[0] + b[2]) + (b[1] + b[3]);
#endif
}

#if !defined(__AVX512F__) && defined(__AVX__)
// s[j] = (q . k[j]) * scale for 8 keys at once (hd % 8 == 0): eight 8-lane accumulators, then one
// transpose-sum (a tree of hadds) instead of eight horizontal sums through memory, one per key.
inline void Dot8(const float* q, const float* const* k, int64_t hd, float scale, float* s) {
  v8 a[8];
  for (int j = 0; j < 8; ++j) a[j] = v8{};
  for (int64_t c = 0; c < hd; c += 8) {
    const v8 qc = load8(q + c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[j] += qc * load8(k[j] + c);
  }
  const __m256 h01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), h23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 h45 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), h67 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 h03 = _mm256_hadd_ps(h01, h23), h47 = _mm256_hadd_ps(h45, h67);   // per 128-bit half: keys 0-3, 4-7
  const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h03, h47, 0x20), _mm256_permute2f128_ps(h03, h47, 0x31));
  _mm256_storeu_ps(s, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}
#endif

// The G query heads sharing one KV head (q: G x hd contiguous) over n tokens (keys[t], vals[t]: hd
// floats each): softmax(q k / sqrt(hd)) v -> out (G x hd). Each key and value row is loaded once
// for all G heads. s: scratch of G * (n + 16) floats.
void AttendGroup(const float* q, int64_t G, const float* const* keys, const float* const* vals, int64_t n,
                 int64_t hd, float scale, float* s, float* out) {
  const int64_t ld = n + 16;
  const bool vec = hd % 16 == 0 && hd <= 256 && G <= 16;
  int64_t done = 0;
#if !defined(__AVX512F__) && defined(__AVX__)
  if (vec)                                                   // whole blocks of 8 keys, then one by one
    for (; done + 8 <= n; done += 8)
      for (int64_t g = 0; g < G; ++g) Dot8(q + g * hd, keys + done, hd, scale, s + g * ld + done);
#endif
  for (int64_t t = done; t < n; ++t) {
    const float* k = keys[t];
    if (vec) {
      v16 kc[16];
      for (int64_t c = 0; c < hd / 16; ++c) kc[c] = load(k + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        v16 acc = v16{};
        for (int64_t c = 0; c < hd / 16; ++c) acc += load(q + g * hd + 16 * c) * kc[c];
        s[g * ld + t] = HSum(acc) * scale;
      }
    } else {
      for (int64_t g = 0; g < G; ++g) {
        float dot = 0.f;
        for (int64_t i = 0; i < hd; ++i) dot += q[g * hd + i] * k[i];
        s[g * ld + t] = dot * scale;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {                         // softmax of each head's row, in place
    float* sg = s + g * ld;
    float mx = -INFINITY, sum = 0.f;
    const int64_t nv = n / 16 * 16;                         // 16 lanes at a time, then the rest
    v16 vmx = v16{} - INFINITY, vsum = v16{};
    for (int64_t t = 0; t < nv; t += 16) {
      const v16 x = load(sg + t);
      vmx = x > vmx ? x : vmx;
    }
    for (int j = 0; j < 16; ++j) mx = std::max(mx, vmx[j]);
    for (int64_t t = nv; t < n; ++t) mx = std::max(mx, sg[t]);
    for (int64_t t = 0; t < nv; t += 16) {
      const v16 e = VecExp(load(sg + t) - mx);
      store(sg + t, e);
      vsum += e;
    }
    for (int64_t t = nv; t < n; ++t) sum += sg[t] = std::exp(sg[t] - mx);
    sum += HSum(vsum);
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < nv; t += 16) store(sg + t, load(sg + t) * inv);
    for (int64_t t = nv; t < n; ++t) sg[t] *= inv;
  }
  if (vec) {
    // PV in chunks of kChunk tokens: each (head, 16 lanes) sums the chunk in one register, the
    // chunk's value rows (kChunk x hd floats) staying in L1 for the G heads. (An accumulator per
    // (head, lane group) across all tokens, indexed at run time, lived on the stack: a load and a
    // store per token and head.)
    constexpr int64_t kChunk = 32;
    const int64_t nv = hd / 16;
    std::fill(out, out + G * hd, 0.f);
    for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
      const int64_t t1 = std::min(n, t0 + kChunk);
      for (int64_t g = 0; g < G; ++g) {
        const float* sg = s + g * ld;
        for (int64_t c = 0; c < nv; ++c) {
          v16 acc = v16{};
          for (int64_t t = t0; t < t1; ++t) acc += sg[t] * load(vals[t] + 16 * c);
          store(out + g * hd + 16 * c, load(out + g * hd + 16 * c) + acc);
        }
      }
    }
  } else {
    std::fill(out, out + G * hd, 0.f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < hd; ++i) out[g * hd + i] += s[g * ld + t] * vals[t][i];
  }
}

// The first index of the maximum of x[0, n) (of the first NaN, if any: jnp.argmax's rule).
int64_t ArgMax(const float* x, int64_t n) {
  float mx = n ? x[0] : 0.f;
  bool nan = false;
  int64_t i = 0;
  v16 vm = v16{} + mx;
  v16i vnan = v16i{};
  for (; i + 16 <= n; i += 16) {
    const v16 v = load(x + i);
    vm = v > vm ? v : vm;
    vnan |= v != v;
  }
  for (int j = 0; j < 16; ++j) {
    mx = vm[j] > mx ? vm[j] : mx;
    nan |= vnan[j] != 0;
  }
  for (; i < n; ++i) {
    mx = x[i] > mx ? x[i] : mx;
    nan |= x[i] != x[i];
  }
  for (i = 0; i < n; ++i)
    if (nan ? x[i] != x[i] : x[i] == mx) return i;
  return 0;
}

int64_t Pad8(int64_t m) { return (m + kMR - 1) / kMR * kMR; }

void RmsNorm(const float* h, const float* scale, int64_t M, int64_t d, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* x = h + m * d;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) out[m * d + i] = x[i] * inv * scale[i];
  }
}

// x [hd] rotated in place, HF rotate_half layout.
inline void Rope(float* __restrict x, const float* __restrict cs, const float* __restrict sn, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const v16 a = load(x + i), b = load(x + i + half), c = load(cs + i), n = load(sn + i);
    store(x + i, a * c - b * n);
    store(x + i + half, b * c + a * n);
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cs[i] - b * sn[i];
    x[i + half] = b * cs[i] + a * sn[i];
  }
}

struct Dims {
  int64_t M, d, L, H, KV, hd, ffn, NB, bs, nb, nqkv;
};

ffi::Error Fail(const std::string& msg) { return ffi::Error::InvalidArgument("preft native decode: " + msg); }

// y [M, N] = x [M, K] @ w[layer], w [L, P, K, 48] (or one matrix [P, K, 48], layer 0) read in place.
ffi::Error PackedMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  const size_t r = wd.size();
  if (xd.size() != 2 || (r != 3 && r != 4) || wd[r - 1] != kNR || yd.size() != 2 || layer.element_count() != 1)
    return Fail("packed_matmul expects x [M, K], w [(L,) P, K, 48], a scalar layer and y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1], L = r == 4 ? wd[0] : 1;
  if (wd[r - 2] != K || yd[0] != M || (N + kNR - 1) / kNR != wd[r - 3]) return Fail("packed_matmul: shapes disagree");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return Fail("packed_matmul: layer index out of range");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* a = x.typed_data();
  std::vector<float> padded;
  if (M % kMR) {                                  // the last tile reads 8 rows
    padded.assign(Pad8(M) * K, 0.f);
    std::memcpy(padded.data(), a, sizeof(float) * M * K);
    a = padded.data();
  }
  Gemm(a, M, Packed{w.typed_data() + l * wd[r - 3] * K * kNR, K, N}, y->typed_data(), false);
  return ffi::Error::Success();
}

ffi::Error DecodeStep(ffi::Buffer<ffi::F32> h_in, ffi::Buffer<ffi::S32> block_tables,
                        ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> chunk_lens,
                        ffi::Buffer<ffi::S32> write_index, ffi::Buffer<ffi::F32> inv_freq,
                        ffi::Buffer<ffi::F32> attn_norm, ffi::Buffer<ffi::F32> mlp_norm, ffi::Buffer<ffi::F32> w_qkv,
                        ffi::Buffer<ffi::F32> b_qkv, ffi::Buffer<ffi::F32> w_o, ffi::Buffer<ffi::F32> w_gu,
                        ffi::Buffer<ffi::F32> w_down, ffi::Buffer<ffi::F32> final_norm,
                        ffi::Buffer<ffi::F32> lm_head, ffi::Buffer<ffi::F32> k_in, ffi::Buffer<ffi::F32> v_in,
                        ffi::ResultBuffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> greedy,
                        ffi::ResultBuffer<ffi::F32> k_out, ffi::ResultBuffer<ffi::F32> v_out, float eps) {
  // ---- shapes ----------------------------------------------------------------------------------
  auto hd_ = h_in.dimensions();
  auto kd = k_in.dimensions();
  auto btd = block_tables.dimensions();
  if (hd_.size() != 2 || kd.size() != 5 || btd.size() != 2) return Fail("h [M, d], pools [L, KV, NB, bs, hd], tables [M, nb]");
  Dims D{};
  D.M = hd_[0], D.d = hd_[1], D.L = kd[0], D.KV = kd[1], D.NB = kd[2], D.bs = kd[3], D.hd = kd[4], D.nb = btd[1];
  if (v_in.dimensions().size() != 5 || v_in.element_count() != k_in.element_count() || btd[0] != D.M ||
      context_lens.element_count() != D.M || chunk_lens.element_count() != D.M || write_index.element_count() != D.M)
    return Fail("per-row inputs must have one entry per row of h and the pools one shape");
  if (inv_freq.element_count() * 2 != D.hd) return Fail("inv_freq must have head_dim / 2 entries");
  auto qd = w_qkv.dimensions();
  if (qd.size() != 4 || qd[0] != D.L || qd[2] != D.d || qd[3] != kNR) return Fail("w_qkv must be [L, P, d, 48]");
  D.nqkv = b_qkv.dimensions().back();
  if (b_qkv.element_count() != D.L * D.nqkv || (D.nqkv + kNR - 1) / kNR != qd[1])
    return Fail("b_qkv must be [L, n_q + 2 n_kv] matching w_qkv");
  const int64_t kvdim = D.KV * D.hd;
  D.H = (D.nqkv - 2 * kvdim) / D.hd;
  if (D.H <= 0 || D.H * D.hd + 2 * kvdim != D.nqkv || D.H % D.KV) return Fail("q heads must be a multiple of kv heads");
  const int64_t qdim = D.H * D.hd;
  auto gd = w_gu.dimensions();
  if (gd.size() != 4 || gd[0] != D.L || gd[2] != D.d) return Fail("w_gu must be [L, P, d, 48]");
  auto dd = w_down.dimensions();
  if (dd.size() != 4 || dd[0] != D.L || dd[2] * 2 > gd[1] * kNR || (D.d + kNR - 1) / kNR != dd[1])
    return Fail("w_down must be [L, P, ffn, 48]");
  D.ffn = dd[2];
  if ((2 * D.ffn + kNR - 1) / kNR != gd[1]) return Fail("w_gu must pack 2 * ffn columns");
  auto od = w_o.dimensions();
  if (od.size() != 4 || od[0] != D.L || od[2] != qdim || od[1] != (D.d + kNR - 1) / kNR) return Fail("w_o must be [L, P, q_dim, 48]");
  if (attn_norm.element_count() != D.L * D.d || mlp_norm.element_count() != D.L * D.d) return Fail("norms must be [L, d]");
  if (final_norm.element_count() != D.d) return Fail("final_norm must be [d]");
  auto ld = lm_head.dimensions();
  auto lgd = logits->dimensions();
  const int64_t V = lgd.size() == 2 ? lgd[1] : -1;
  if (ld.size() != 3 || ld[1] != D.d || ld[2] != kNR || lgd.size() != 2 || lgd[0] != D.M ||
      (V + kNR - 1) / kNR != ld[0] || greedy->element_count() != D.M)
    return Fail("lm_head must be [P, d, 48] packing the logits' [M, V] columns");

  // ---- per-row checks: a bad index is an error, never a stray read or write --------------------
  const int32_t* bt = block_tables.typed_data();
  const int32_t* ctx = context_lens.typed_data();
  const int32_t* clen = chunk_lens.typed_data();
  const int32_t* widx = write_index.typed_data();
  const int64_t pool_tokens = D.NB * D.bs;
  for (int64_t r = 0; r < D.M; ++r) {
    if (clen[r] != 0 && clen[r] != 1) return Fail("decode rows carry one token (chunk_lens 0 or 1)");
    if (ctx[r] < 0 || ctx[r] > D.nb * D.bs) return Fail("a context length exceeds its block table");
    if (widx[r] < 0) return Fail("negative write index");
    if (clen[r] == 0) continue;
    for (int64_t t = 0; t < (ctx[r] + D.bs - 1) / D.bs; ++t) {
      const int32_t b = bt[r * D.nb + t];
      if (b < 0 || b >= D.NB) return Fail("a block table names a block outside the pool");
    }
  }

  float* kp = k_out->typed_data();
  float* vp = v_out->typed_data();
  if (kp != k_in.typed_data()) std::memcpy(kp, k_in.typed_data(), sizeof(float) * k_in.element_count());
  if (vp != v_in.typed_data()) std::memcpy(vp, v_in.typed_data(), sizeof(float) * v_in.element_count());

  const int64_t M = D.M, d = D.d, Mp = Pad8(M), half = D.hd / 2, groups = D.H / D.KV;
  std::vector<float> hbuf(M * d);
  float* h = hbuf.data();
  std::memcpy(h, h_in.typed_data(), sizeof(float) * M * d);
  std::vector<float> x(Mp * std::max(d, D.ffn), 0.f), qkv(M * D.nqkv), attn(Mp * qdim, 0.f), gu(M * 2 * D.ffn);
  std::vector<float> cs(M * half), sn(M * half);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < half; ++i) {
      const float ang = static_cast<float>(ctx[r]) * inv_freq.typed_data()[i];
      cs[r * half + i] = std::cos(ang);
      sn[r * half + i] = std::sin(ang);
    }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D.hd));
  const int64_t max_ctx = D.nb * D.bs + 1;
  int64_t attended = 0;                                   // (row, context token) pairs, this step
  for (int64_t r = 0; r < M; ++r) attended += clen[r] ? ctx[r] + 1 : 0;
  const int attn_threads = ThreadsFor(4 * attended * D.H * D.hd);   // QK^T and PV, per layer

  auto Wqkv = [&](int64_t l) { return Packed{w_qkv.typed_data() + l * qd[1] * d * kNR, d, D.nqkv}; };
  auto Wo = [&](int64_t l) { return Packed{w_o.typed_data() + l * od[1] * qdim * kNR, qdim, d}; };
  auto Wgu = [&](int64_t l) { return Packed{w_gu.typed_data() + l * gd[1] * d * kNR, d, 2 * D.ffn}; };
  auto Wdown = [&](int64_t l) { return Packed{w_down.typed_data() + l * dd[1] * D.ffn * kNR, D.ffn, d}; };
  const Packed Whead{lm_head.typed_data(), d, V};
  for (int64_t l = 0; l < D.L; ++l) {
    // attention block
    RmsNorm(h, attn_norm.typed_data() + l * d, M, d, eps, x.data());
    Gemm(x.data(), M, Wqkv(l), qkv.data(), false, Wo(l));
    const float* bias = b_qkv.typed_data() + l * D.nqkv;
    for (int64_t r = 0; r < M; ++r) {
      float* row = qkv.data() + r * D.nqkv;
#pragma omp simd
      for (int64_t i = 0; i < D.nqkv; ++i) row[i] += bias[i];
      for (int64_t hh = 0; hh < D.H + D.KV; ++hh) Rope(row + hh * D.hd, &cs[r * half], &sn[r * half], half);
    }
    const int64_t layer_off = l * D.KV * pool_tokens * D.hd;      // pool [L, KV, NB * bs, hd]
#pragma omp parallel num_threads(attn_threads)
    {
      std::vector<float> s(groups * (max_ctx + 16));
      std::vector<const float*> keys(max_ctx), vals(max_ctx);
      const int64_t T = omp_get_num_threads(), th = omp_get_thread_num();
      const int64_t pairs = M * D.KV, p0 = pairs * th / T, p1 = pairs * (th + 1) / T;
      // Context rows of (row, kv head) pair p: token t's offset in the layer's pool of that head.
      auto token_off = [&](int64_t r, int64_t t) {
        return (static_cast<int64_t>(bt[r * D.nb + t / D.bs]) * D.bs + t % D.bs) * D.hd;
      };
      for (int64_t pr = p0; pr < p1; ++pr) {
        const int64_t r = pr / D.KV, kv = pr % D.KV;
        if (pr + 1 < p1) {                                  // pull the next pair's context in meanwhile
          const int64_t r2 = (pr + 1) / D.KV, kv2 = (pr + 1) % D.KV;
          const int64_t n2 = clen[r2] ? ctx[r2] : 0;
          const float* kb2 = kp + layer_off + kv2 * pool_tokens * D.hd;
          const float* vb2 = vp + layer_off + kv2 * pool_tokens * D.hd;
          for (int64_t t = 0; t < n2; ++t)
            for (int64_t i = 0; i < D.hd; i += 16) {
              __builtin_prefetch(kb2 + token_off(r2, t) + i, 0, 3);
              __builtin_prefetch(vb2 + token_off(r2, t) + i, 0, 3);
            }
        }
        const float* row = qkv.data() + r * D.nqkv;
        float* out = attn.data() + r * qdim + kv * groups * D.hd;
        if (!clen[r]) {
          std::fill(out, out + groups * D.hd, 0.f);
          continue;
        }
        const int64_t n = ctx[r];
        const float* kbase = kp + layer_off + kv * pool_tokens * D.hd;
        const float* vbase = vp + layer_off + kv * pool_tokens * D.hd;
        for (int64_t t = 0; t < n; ++t) {
          keys[t] = kbase + token_off(r, t);
          vals[t] = vbase + token_off(r, t);
        }
        keys[n] = row + qdim + kv * D.hd;                   // the row's own new K/V
        vals[n] = row + qdim + kvdim + kv * D.hd;
        AttendGroup(row + kv * groups * D.hd, groups, keys.data(), vals.data(), n + 1, D.hd, scale, s.data(), out);
      }
    }
    // the new K/V into the pool after every row has read it (as the XLA path's one scatter per step)
    for (int64_t r = 0; r < M; ++r) {
      if (!clen[r] || widx[r] >= pool_tokens) continue;
      const float* row = qkv.data() + r * D.nqkv;
      for (int64_t kv = 0; kv < D.KV; ++kv) {
        const int64_t off = layer_off + (kv * pool_tokens + widx[r]) * D.hd;
        std::memcpy(kp + off, row + qdim + kv * D.hd, sizeof(float) * D.hd);
        std::memcpy(vp + off, row + qdim + kvdim + kv * D.hd, sizeof(float) * D.hd);
      }
    }
    Gemm(attn.data(), M, Wo(l), h, true, Wgu(l));
    // MLP block
    RmsNorm(h, mlp_norm.typed_data() + l * d, M, d, eps, x.data());
    Gemm(x.data(), M, Wgu(l), gu.data(), false, Wdown(l));
    for (int64_t r = 0; r < M; ++r)
      SiluMul(&gu[r * 2 * D.ffn], &gu[r * 2 * D.ffn + D.ffn], D.ffn, &x[r * D.ffn]);
    Gemm(x.data(), M, Wdown(l), h, true, l + 1 < D.L ? Wqkv(l + 1) : Whead);
  }
  // final norm, LM head, and each row's first maximal logit (a NaN counts as the maximum, as jnp.argmax)
  RmsNorm(h, final_norm.typed_data(), M, d, eps, x.data());
  float* out = logits->typed_data();
  Gemm(x.data(), M, Whead, out, false);
  int32_t* best = greedy->typed_data();
#pragma omp parallel for schedule(static) num_threads(ThreadsFor(M * V))
  for (int64_t r = 0; r < M; ++r) {
    best[r] = static_cast<int32_t>(ArgMax(out + r * V, V));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PreftPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PreftDecodeStep, DecodeStep,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // h [M, d]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [M, nb]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // context_lens [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // chunk_lens [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // write_index [M]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq [hd / 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // attn_norm [L, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // mlp_norm [L, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_qkv [L, P, d, 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // b_qkv [L, n_qkv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_o [L, P, q_dim, 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_gu [L, P, d, 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_down [L, P, ffn, 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // final_norm [d]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lm_head [P, d, 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k pool
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v pool
                                  .Ret<ffi::Buffer<ffi::F32>>()   // logits [M, V]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // greedy [M]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // k pool (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // v pool (aliased)
                                  .Attr<float>("eps"));
