// Native CPU decode for float32 Llama-family models, as XLA FFI handlers (see pallas_kernels/cpu).
//
//   PreftPackedMatmul   y [M, N] = x [M, K] @ W, W packed in column panels [P, K, 48]
//   PreftDecodeLayers   one token per row through every decoder layer over a paged KV pool
//
// Weights are packed once (pack_panels in decode.py): panel p holds columns [48p, 48p + 48) of
// W [K, N] as K contiguous rows of 48 floats (zero-padded past N), so a GEMM streams each panel
// once, in order. The register tile is 8 rows x 48 columns (24 vector accumulators); the panels
// are split across threads (OpenMP). The code is plain C++ with GCC vector extensions: AVX-512
// machines get 16-lane vectors, others the compiler's split of them.
#include <omp.h>

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

// C [M, N] (+)= A [M, K] @ packed W [P, K, 48]. A's rows must be readable up to a multiple of 8
// (callers pass buffers padded to that; the padding rows are never written back).
void Gemm(const float* A, int64_t M, int64_t K, const float* W, int64_t N, float* C, bool accumulate) {
  const int64_t P = (N + kNR - 1) / kNR;
  const int64_t tiles = std::min<int64_t>((M + kMR - 1) / kMR, 4);   // tiles that prefetch the next panel
  const int64_t pf_step = kNR / tiles;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const float* panel = W + p * K * kNR;
    const int64_t nvalid = std::min(kNR, N - p * kNR);
    for (int64_t m = 0, t = 0; m < M; m += kMR, ++t) {
      const float* pf = (p + 1 < P && t < tiles) ? panel + K * kNR + t * K * pf_step : nullptr;
      Tile(A + m * K, K, panel, K, C + m * N + p * kNR, N, std::min(kMR, M - m), nvalid, accumulate, pf, pf_step);
    }
  }
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
inline void Rope(float* x, const float* cs, const float* sn, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cs[i] - b * sn[i];
    x[i + half] = b * cs[i] + a * sn[i];
  }
}

struct Dims {
  int64_t M, d, L, H, KV, hd, ffn, NB, bs, nb, nqkv;
};

ffi::Error Fail(const std::string& msg) { return ffi::Error::InvalidArgument("preft native decode: " + msg); }

ffi::Error PackedMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kNR || yd.size() != 2)
    return Fail("packed_matmul expects x [M, K], w [P, K, 48] and y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  if (wd[1] != K || yd[0] != M || (N + kNR - 1) / kNR != wd[0]) return Fail("packed_matmul: shapes disagree");
  if (M == 0 || N == 0) return ffi::Error::Success();
  std::vector<float> a(Pad8(M) * K, 0.f);
  std::memcpy(a.data(), x.typed_data(), sizeof(float) * M * K);
  Gemm(a.data(), M, K, w.typed_data(), N, y->typed_data(), false);
  return ffi::Error::Success();
}

ffi::Error DecodeLayers(ffi::Buffer<ffi::F32> h_in, ffi::Buffer<ffi::S32> block_tables,
                        ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> chunk_lens,
                        ffi::Buffer<ffi::S32> write_index, ffi::Buffer<ffi::F32> inv_freq,
                        ffi::Buffer<ffi::F32> attn_norm, ffi::Buffer<ffi::F32> mlp_norm, ffi::Buffer<ffi::F32> w_qkv,
                        ffi::Buffer<ffi::F32> b_qkv, ffi::Buffer<ffi::F32> w_o, ffi::Buffer<ffi::F32> w_gu,
                        ffi::Buffer<ffi::F32> w_down, ffi::Buffer<ffi::F32> k_in, ffi::Buffer<ffi::F32> v_in,
                        ffi::ResultBuffer<ffi::F32> h_out, ffi::ResultBuffer<ffi::F32> k_out,
                        ffi::ResultBuffer<ffi::F32> v_out, float eps) {
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
  float* h = h_out->typed_data();
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

  for (int64_t l = 0; l < D.L; ++l) {
    // attention block
    RmsNorm(h, attn_norm.typed_data() + l * d, M, d, eps, x.data());
    Gemm(x.data(), M, d, w_qkv.typed_data() + l * qd[1] * d * kNR, D.nqkv, qkv.data(), false);
    const float* bias = b_qkv.typed_data() + l * D.nqkv;
    for (int64_t r = 0; r < M; ++r) {
      float* row = qkv.data() + r * D.nqkv;
      for (int64_t i = 0; i < D.nqkv; ++i) row[i] += bias[i];
      for (int64_t hh = 0; hh < D.H + D.KV; ++hh) Rope(row + hh * D.hd, &cs[r * half], &sn[r * half], half);
    }
    const int64_t layer_off = l * D.KV * pool_tokens * D.hd;      // pool [L, KV, NB * bs, hd]
#pragma omp parallel
    {
      std::vector<float> s(max_ctx);
#pragma omp for collapse(2) schedule(static)
      for (int64_t r = 0; r < M; ++r)
        for (int64_t kv = 0; kv < D.KV; ++kv) {
          const float* row = qkv.data() + r * D.nqkv;
          const float* kn = row + qdim + kv * D.hd;
          const float* vn = row + qdim + kvdim + kv * D.hd;
          const float* kbase = kp + layer_off + kv * pool_tokens * D.hd;
          const float* vbase = vp + layer_off + kv * pool_tokens * D.hd;
          const int64_t n = clen[r] ? ctx[r] : 0;
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t head = kv * groups + g;
            const float* q = row + head * D.hd;
            float* out = attn.data() + r * qdim + head * D.hd;
            if (!clen[r]) {
              std::fill(out, out + D.hd, 0.f);
              continue;
            }
            float mx = -INFINITY;
            for (int64_t t = 0; t <= n; ++t) {
              const float* kt = t < n ? kbase + (static_cast<int64_t>(bt[r * D.nb + t / D.bs]) * D.bs + t % D.bs) * D.hd : kn;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t i = 0; i < D.hd; ++i) dot += q[i] * kt[i];
              s[t] = dot * scale;
              mx = std::max(mx, s[t]);
            }
            float sum = 0.f;
            for (int64_t t = 0; t <= n; ++t) {
              s[t] = std::exp(s[t] - mx);
              sum += s[t];
            }
            std::fill(out, out + D.hd, 0.f);
            for (int64_t t = 0; t <= n; ++t) {
              const float* vt = t < n ? vbase + (static_cast<int64_t>(bt[r * D.nb + t / D.bs]) * D.bs + t % D.bs) * D.hd : vn;
              const float p = s[t] / sum;
#pragma omp simd
              for (int64_t i = 0; i < D.hd; ++i) out[i] += p * vt[i];
            }
          }
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
    Gemm(attn.data(), M, qdim, w_o.typed_data() + l * od[1] * qdim * kNR, d, h, true);
    // MLP block
    RmsNorm(h, mlp_norm.typed_data() + l * d, M, d, eps, x.data());
    Gemm(x.data(), M, d, w_gu.typed_data() + l * gd[1] * d * kNR, 2 * D.ffn, gu.data(), false);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t i = 0; i < D.ffn; ++i) {
        const float g = gu[r * 2 * D.ffn + i];
        x[r * D.ffn + i] = g / (1.0f + std::exp(-g)) * gu[r * 2 * D.ffn + D.ffn + i];
      }
    Gemm(x.data(), M, D.ffn, w_down.typed_data() + l * dd[1] * D.ffn * kNR, d, h, true);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PreftPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PreftDecodeLayers, DecodeLayers,
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
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k pool
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v pool
                                  .Ret<ffi::Buffer<ffi::F32>>()   // h out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // k pool (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // v pool (aliased)
                                  .Attr<float>("eps"));
