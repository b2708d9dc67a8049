// AVX-512 VNNI decode matvec (this file alone is compiled with -mavx512f -mavx512bw -mavx512vnni).
//
// Why: the float32 decode kernel spends ~7 instructions per 16 weights (unpack, widen, convert, FMA) and tops out
// at ~20 G weights/s per core, below what DRAM can feed two cores. Here x is rounded to int16 once per call (a
// scale per weight group), and the weights stay integers: vpdpwssd does 32 int16 multiply-adds per instruction,
// and each group's exact integer sum is scaled once in float32:
//   out[m, n] = sum_g s[n, g] * d[m, g] * I[m, n, g] + sum_g b[n, g] * xsum[m, g]
//   I[m, n, g] = sum_{k in g} q[n, k] * xq[m, k],   xq = round(x / d),   d[m, g] = max|x[m, g]| / 32767
// The bias term uses the exact float32 xsum. Rounding x costs at most d/2 per element (1.5e-5 of the group's
// largest |x|): results differ from the exact product by ~2-3e-5 of the output's scale (measured; float32
// kernel ~1e-6), far below 4-bit weight error.
// Prefill (M > 8) of 4-bit weights: the integer GEMM of qmm_avx2i8gemm.cpp with the VNNI micro-kernels of
// qmm_vnni_gemm.cpp; 8-bit weights and attention keep the float32 AVX-512 kernels.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "qmm_kernels.h"
#include "qmv_dispatch.h"
#include "vnni_helpers.h"

namespace mlxinfer_cpu {
namespace isa_vnni {

using namespace vnni_helpers;

// Centring q (q - 8 for 4-bit, q - 128 for 8-bit) halves |s * q| and with it the error that rounding x
// contributes (it scales with the integer weights, not with w). It is free: sum (q - off) xq = I - off * sum xq
// is an exact integer identity, so the dot products use q as stored and each row adds
// sum_g s[g] * xcorr[g] with xcorr = off * (xsum - d * sum xq) (QmmArgs::xcorr) to its bias term.

// One unit = the weights of one group (two 32-groups for 4-bit GS 32): its integer dot products with each x row,
// scaled into acc. unit_bytes = bytes of weights per unit; `tail`: only the first 16 bytes exist (last 32 of K).
template <int MM, int BITS, int GS>
__attribute__((always_inline)) static inline void unit_dot(const QmmArgs& a, const uint8_t* wu, int u,
                                                           const float* sd, __m512 (&acc)[MM], bool tail) {
  __m512i iacc[MM];
  for (int m = 0; m < MM; ++m) iacc[m] = _mm512_setzero_si512();
  if constexpr (BITS == 4) {
    // 64 elements per block: byte j holds elements 2j (low nibble) and 2j+1 (high nibble); xq is laid out per
    // block as [x0, x2, ..., x62, x1, x3, ..., x63], so int32 lane l sums elements 4l..4l+3.
    constexpr int NB = GS == 128 ? 2 : 1;
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    for (int i = 0; i < NB; ++i) {
      const int blk = u * NB + i;
      const __m256i raw = tail ? _mm256_maskz_loadu_epi8((__mmask32)0xFFFF, wu + i * 32)
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wu + i * 32));
      const __m512i wv = _mm512_cvtepu8_epi16(raw);
      const __m512i lo = _mm512_and_si512(wv, low4);
      const __m512i hi = _mm512_srli_epi16(wv, 4);
      for (int m = 0; m < MM; ++m) {
        const int16_t* xq = a.xq + (size_t)m * a.kpad + blk * 64;
        iacc[m] = _mm512_dpwssd_epi32(iacc[m], lo, _mm512_loadu_si512(xq));
        iacc[m] = _mm512_dpwssd_epi32(iacc[m], hi, _mm512_loadu_si512(xq + 32));
      }
    }
  } else {
    // 32 elements per block, in order: lane l sums elements 2l and 2l+1.
    constexpr int NB = GS / 32;
    for (int i = 0; i < NB; ++i) {
      const int blk = u * NB + i;
      const __m512i wv = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wu + i * 32)));
      for (int m = 0; m < MM; ++m)
        iacc[m] = _mm512_dpwssd_epi32(iacc[m], wv, _mm512_loadu_si512(a.xq + (size_t)m * a.kpad + blk * 32));
    }
  }
  for (int m = 0; m < MM; ++m) {
    __m512 scale;
    if constexpr (BITS == 4 && GS == 32) {
      scale = pair_scale(sd + m * a.gpad + 2 * u);  // lanes 0-7: group 2u, lanes 8-15: group 2u+1
    } else {
      scale = _mm512_set1_ps(sd[m * a.gpad + u]);
    }
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m]), scale, acc[m]);
  }
}

// One output row for all MM x rows. Rows go one at a time at every length: one stream per thread prefetches best
// from DRAM (Dec 6, rows of 288 / 576 / 768 bytes streamed from 600 MB: 18.8 / 19.4 / 22.2 GB/s one at a time vs
// 15.7 / 17.8 / 19.3 four side by side; decode, 2 interleaved runs: Gemma-3-1B +9%, Qwen3-0.6B +12%, SmolLM2
// from cache not slower).
template <int MM, int BITS, int GS>
static inline void qmv_row(const QmmArgs& a, int n, float* sd, float* rows) {
  const int K = a.K, ng = K / GS;
  const size_t row_bytes = (size_t)K * BITS / 8;
  constexpr int unit_elems = BITS == 4 && GS == 32 ? 64 : GS;
  constexpr int unit_bytes = unit_elems * BITS / 8;
  const int nfull = K / unit_elems;       // units with all their bytes
  const bool tail = K % unit_elems != 0;  // 4-bit GS 32 with K % 64 == 32
  __m512 acc0[MM], acc1[MM];
  for (int m = 0; m < MM; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  // sd[m][g] = s[g] * d[m][g] for the unit loop; the bias term goes straight into acc1.
  {
    float* const sds[1] = {sd};
    __m512* const accs[1] = {acc1};
    row_setup<MM, 1>(a, n, ng, sds, accs);
  }
  const uint8_t* wr = a.w + (size_t)n * row_bytes;
  // Two accumulator sets so consecutive units do not wait on each other's FMA.
  int u = 0;
  for (; u + 1 < nfull; u += 2) {
    const uint8_t* wu = wr + u * unit_bytes;
    // Weights stream from DRAM once per token: one prefetch per cache line, kPrefetch bytes ahead, and the line of
    // the last byte: in rows not 64-byte aligned (288 bytes: SmolLM2) two units span one line more (one thread,
    // 256 MB of 288-byte rows cycled, Zen 4 with pairs off, as on Intel: 10-20% less time with it).
    const char* ahead = reinterpret_cast<const char*>(wu + kPrefetch);
    for (int l = 0; l < 2 * unit_bytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
    _mm_prefetch(ahead + 2 * unit_bytes - 1, _MM_HINT_T0);
    // And 3 kPrefetch ahead into L2: more lines in flight (a thread reads DRAM latency-bound; Zen 4, in-model A/B
    // call by call: +2-16% on the layers' matvecs, as the tiled kernel's).
    for (int l = 0; l < 2 * unit_bytes; l += 64) _mm_prefetch(ahead + 2 * kPrefetch + l, _MM_HINT_T1);
    unit_dot<MM, BITS, GS>(a, wu, u, sd, acc0, false);
    unit_dot<MM, BITS, GS>(a, wu + unit_bytes, u + 1, sd, acc1, false);
  }
  if (u < nfull) unit_dot<MM, BITS, GS>(a, wr + u * unit_bytes, u, sd, acc0, false);
  if (tail) unit_dot<MM, BITS, GS>(a, wr + nfull * unit_bytes, nfull, sd, acc1, true);
  for (int m = 0; m < MM; ++m) _mm512_store_ps(rows + m * 256, _mm512_add_ps(acc0[m], acc1[m]));
}

// Two weight rows at once for 2 or more x rows: each x vector loaded feeds both rows' dot products. From 2 x rows
// on the unit loop above is bound by its loads (one 64-byte x load per vpdpwssd): sharing them cut 8-row calls by
// 20-40% (Zen 4 harness, one thread: 4-bit 2048 x 2048 1127 -> 675 us, 3072 x 576 ~550 -> ~430 us; 4 rows -7%,
// 2 rows even). At most 4 x rows per pass: 2 x 4 int and float accumulators, 4 weight and 2 x vectors.
template <int MM, int BITS, int GS>
__attribute__((always_inline)) static inline void unit_dot2(const QmmArgs& a, const uint8_t* wu0, const uint8_t* wu1,
                                                            int u, const float* sd0, const float* sd1,
                                                            __m512 (&acc0)[MM], __m512 (&acc1)[MM], bool tail) {
  __m512i i0[MM], i1[MM];
  for (int m = 0; m < MM; ++m) i0[m] = i1[m] = _mm512_setzero_si512();
  if constexpr (BITS == 4) {
    constexpr int NB = GS == 128 ? 2 : 1;  // 64-element blocks, laid out as in unit_dot
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    for (int i = 0; i < NB; ++i) {
      const int blk = u * NB + i;
      const __m256i r0 = tail ? _mm256_maskz_loadu_epi8((__mmask32)0xFFFF, wu0 + i * 32)
                              : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wu0 + i * 32));
      const __m256i r1 = tail ? _mm256_maskz_loadu_epi8((__mmask32)0xFFFF, wu1 + i * 32)
                              : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wu1 + i * 32));
      const __m512i v0 = _mm512_cvtepu8_epi16(r0), v1 = _mm512_cvtepu8_epi16(r1);
      const __m512i lo0 = _mm512_and_si512(v0, low4), hi0 = _mm512_srli_epi16(v0, 4);
      const __m512i lo1 = _mm512_and_si512(v1, low4), hi1 = _mm512_srli_epi16(v1, 4);
      for (int m = 0; m < MM; ++m) {
        const int16_t* xq = a.xq + (size_t)m * a.kpad + blk * 64;
        const __m512i xl = _mm512_loadu_si512(xq), xh = _mm512_loadu_si512(xq + 32);
        i0[m] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(i0[m], lo0, xl), hi0, xh);
        i1[m] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(i1[m], lo1, xl), hi1, xh);
      }
    }
  } else {
    constexpr int NB = GS / 32;
    for (int i = 0; i < NB; ++i) {
      const int blk = u * NB + i;
      const __m512i v0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wu0 + i * 32)));
      const __m512i v1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wu1 + i * 32)));
      for (int m = 0; m < MM; ++m) {
        const __m512i xv = _mm512_loadu_si512(a.xq + (size_t)m * a.kpad + blk * 32);
        i0[m] = _mm512_dpwssd_epi32(i0[m], v0, xv);
        i1[m] = _mm512_dpwssd_epi32(i1[m], v1, xv);
      }
    }
  }
  for (int m = 0; m < MM; ++m) {
    __m512 s0, s1;
    if constexpr (BITS == 4 && GS == 32) {
      s0 = pair_scale(sd0 + m * a.gpad + 2 * u);
      s1 = pair_scale(sd1 + m * a.gpad + 2 * u);
    } else {
      s0 = _mm512_set1_ps(sd0[m * a.gpad + u]);
      s1 = _mm512_set1_ps(sd1[m * a.gpad + u]);
    }
    acc0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[m]), s0, acc0[m]);
    acc1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[m]), s1, acc1[m]);
  }
}

// Output rows n and n + 1 for MM <= 4 x rows: their accumulators go to out0 / out1 (+ m * 256, as qmv_row's).
template <int MM, int BITS, int GS>
static inline void qmv_row2(const QmmArgs& a, int n, float* sd0, float* sd1, float* out0, float* out1) {
  static_assert(MM >= 1 && MM <= 4, "at most 4 x rows per pass");
  const int K = a.K, ng = K / GS, gp = a.gpad;
  const size_t row_bytes = (size_t)K * BITS / 8;
  constexpr int unit_elems = BITS == 4 && GS == 32 ? 64 : GS;
  constexpr int unit_bytes = unit_elems * BITS / 8;
  const int nfull = K / unit_elems;
  const bool tail = K % unit_elems != 0;
  __m512 acc0[MM], acc1[MM];
  for (int m = 0; m < MM; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  {  // both rows' setup in one loop, sharing x's loads
    float* const sds[2] = {sd0, sd1};
    __m512* const accs[2] = {acc0, acc1};
    row_setup<MM, 2>(a, n, ng, sds, accs);
  }
  const uint8_t* w0 = a.w + (size_t)n * row_bytes;
  const uint8_t* w1 = w0 + row_bytes;
  for (int u = 0; u < nfull; ++u) {
    const int o = u * unit_bytes;
    for (int l = (o + 63) / 64 * 64; l < o + unit_bytes; l += 64) {  // each cache line once, kPrefetch ahead
      _mm_prefetch(reinterpret_cast<const char*>(w0 + l + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + l + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w0 + l + 3 * kPrefetch), _MM_HINT_T1);  // as in the loop above
      _mm_prefetch(reinterpret_cast<const char*>(w1 + l + 3 * kPrefetch), _MM_HINT_T1);
    }
    unit_dot2<MM, BITS, GS>(a, w0 + o, w1 + o, u, sd0, sd1, acc0, acc1, false);
  }
  if (tail) {
    const int o = nfull * unit_bytes;
    unit_dot2<MM, BITS, GS>(a, w0 + o, w1 + o, nfull, sd0, sd1, acc0, acc1, true);
  }
  for (int m = 0; m < MM; ++m) {
    _mm512_store_ps(out0 + m * 256, acc0[m]);
    _mm512_store_ps(out1 + m * 256, acc1[m]);
  }
}

// Rows j and j + 1 of a block for all MM x rows: passes of at most 4 (a view of QmmArgs past the first 4 x rows).
template <int MM, int BITS, int GS>
static inline void qmv_pair(const QmmArgs& a, int n, float* sd0, float* sd1, float* rows, int j) {
  if constexpr (MM <= 4) {
    qmv_row2<MM, BITS, GS>(a, n, sd0, sd1, rows + 16 * j, rows + 16 * (j + 1));
  } else {
    qmv_row2<4, BITS, GS>(a, n, sd0, sd1, rows + 16 * j, rows + 16 * (j + 1));
    float* r = rows + 4 * 256;
    qmv_row2<MM - 4, BITS, GS>(past_x_rows(a, 4), n, sd0, sd1, r + 16 * j, r + 16 * (j + 1));
  }
}

// Output rows in blocks of 16 (from 2 x rows on, two at a time: qmv_pair): each row leaves its accumulator in
// `rows` ([m][row][16]), and sum16 reduces a block's 16 at once into 16 consecutive outputs per x row (a partial
// block's extra lanes are not stored).
template <int MM, int BITS, int GS>
static void qmv_rows(const QmmArgs& a, int n0, int n1) {
  thread_local std::vector<float> store;
  const size_t sd_len = ((size_t)(MM > 8 ? MM : 8) * a.gpad + 15) / 16 * 16;  // qmv_pair: 2 x 4 x gpad
  store.resize(sd_len + (size_t)MM * 256 + 16);
  float* sd = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t(63));
  float* rows = sd + sd_len;
  // Two rows stream from DRAM worse than one when they are long and x rows few (4-bit 1024-byte rows, 2 x rows:
  // +18% time; 3: +3%; 4: -4%; 8: -25%; 320-byte rows gain at 2 and 3): pairs from 4 x rows on, or for rows of at
  // most 512 bytes (one x row: on AMD only, short_row_pairs).
  const bool short_rows = (size_t)a.K * BITS / 8 <= 512;
  const bool pairs = MM >= 4 || (short_rows && (MM >= 2 || short_row_pairs()));
  for (int nb = n0; nb < n1; nb += 16) {
    const int cnt = n1 - nb < 16 ? n1 - nb : 16;
    int j = 0;
    if (pairs)
      for (; j + 1 < cnt; j += 2) qmv_pair<MM, BITS, GS>(a, nb + j, sd, sd + 4 * a.gpad, rows, j);
    for (; j < cnt; ++j) qmv_row<MM, BITS, GS>(a, nb + j, sd, rows + 16 * j);
    const __mmask16 k = (__mmask16)((1u << cnt) - 1);
    for (int m = 0; m < MM; ++m) _mm512_mask_storeu_ps(a.out + (size_t)m * a.N + nb, k, sum16(rows + m * 256));
  }
}

struct Rows {
  template <int MM, int BITS, int GS>
  static void run(const QmmArgs& a, int n0, int n1) { qmv_rows<MM, BITS, GS>(a, n0, n1); }
};

static void qmv(const QmmArgs& a, int n0, int n1) {
  if (a.bits == 4) {
    dispatch_qmv<Rows, 4>(a, n0, n1);
  } else {
    dispatch_qmv<Rows, 8>(a, n0, n1);
  }
}

// x rounded to int16 per weight group, in the layout QmmArgs::xq describes (the caller zeroes the buffers).
static void prep_x16(const float* x, int M, int K, int gs, int bits, int kpad, int gpad, int16_t* xq, float* xd,
                     float* xcorr, float* xsum) {
  thread_local std::vector<int16_t> tmp;
  tmp.assign(kpad, 0);
  const int ng = K / gs, nv = gs / 16;
  const float off = bits == 4 ? 8.f : 128.f;
  alignas(64) int16_t ie[32], io[32];  // word indices of the even / odd elements of a 64-block
  for (int i = 0; i < 32; ++i) {
    ie[i] = static_cast<int16_t>(2 * i);
    io[i] = static_cast<int16_t>(2 * i + 1);
  }
  const __m512i even_idx = _mm512_load_si512(ie), odd_idx = _mm512_load_si512(io);
  for (int m = 0; m < M; ++m) {
    int16_t* q = bits == 4 ? tmp.data() : xq + (size_t)m * kpad;  // natural order first for 4-bit
    for (int g = 0; g < ng; ++g) {
      const float* xg = x + (size_t)m * K + (size_t)g * gs;
      __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
      for (int v = 0; v < nv; ++v) {
        const __m512 xv = _mm512_loadu_ps(xg + 16 * v);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(xv));
        vsum = _mm512_add_ps(vsum, xv);
      }
      const float amax = _mm512_reduce_max_ps(vmax), sum = _mm512_reduce_add_ps(vsum);
      const size_t o = (size_t)m * gpad + g;
      xsum[o] = sum;
      if (!(amax > 0.f) || !std::isfinite(amax)) {  // all zero: nothing to add; inf/nan: let d carry it
        xd[o] = amax > 0.f ? amax : 0.f;
        for (int k = 0; k < gs; ++k) q[g * gs + k] = 0;
        continue;
      }
      const __m512 inv = _mm512_set1_ps(32767.f / amax);
      __m512i isum = _mm512_setzero_si512();
      for (int v = 0; v < nv; ++v) {
        // Round to nearest even, as lrintf.
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + 16 * v), inv));
        isum = _mm512_add_epi32(isum, qi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * gs + 16 * v), _mm512_cvtsepi32_epi16(qi));
      }
      xd[o] = amax / 32767.f;
      xcorr[o] = off * (sum - xd[o] * static_cast<float>(_mm512_reduce_add_epi32(isum)));
    }
    if (bits == 4) {
      // Each 64-block as [x0, x2, ..., x62, x1, x3, ..., x63].
      int16_t* dst = xq + (size_t)m * kpad;
      for (int b = 0; b < kpad; b += 64) {
        const __m512i lo = _mm512_loadu_si512(tmp.data() + b), hi = _mm512_loadu_si512(tmp.data() + b + 32);
        _mm512_storeu_si512(dst + b, _mm512_permutex2var_epi16(lo, even_idx, hi));
        _mm512_storeu_si512(dst + b + 32, _mm512_permutex2var_epi16(lo, odd_idx, hi));
      }
    }
  }
}

}  // namespace isa_vnni

KernelSet avx512vnni_kernels() {
  KernelSet ks = avx512_kernels();  // prefill tiles and their packing stay the float32 AVX-512 ones
  ks.isa = "avx512vnni";
  ks.qmv = isa_vnni::qmv;
  ks.int16_x = true;
  ks.prep_x16 = isa_vnni::prep_x16;
  return with_tiled_decode(ks);
}

}  // namespace mlxinfer_cpu
