// AVX2 integer decode matvec (this file alone is compiled with -mavx2 -mfma -mf16c): the VNNI algorithm of
// qmm_vnni.cpp without AVX-512. x is rounded to int16 once per call (a scale per weight group), weights stay
// integers and vpmaddwd + vpaddd stand in for vpdpwssd:
//   out[m, n] = sum_g s[n, g] * d[m, g] * I[m, n, g] + sum_g b[n, g] * xsum[m, g] (+ the centring term xcorr)
// Why: for several x rows (batched decode, M <= 8) the float32 kernel is bound by its FMAs (one per 8 weights
// per row); vpmaddwd does 16 multiply-adds per instruction and the weights unpack to int16 only, not to float.
// Accuracy is the VNNI path's (x to int16 per group: ~2-3e-5 of the output's scale). Prefill keeps the float
// AVX2 kernels.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "avx2_helpers.h"
#include "qmm_kernels.h"
#include "qmv_dispatch.h"

namespace mlxinfer_cpu {
namespace isa_avx2int {

using avx2_helpers::hsum;
using avx2_helpers::hsum4;
using avx2_helpers::scale_row_values;

// One weight group (CPG 32-element chunks from chunk c0) dotted with every x row as exact int32 sums, scaled
// by sd[m] (= s * d) into acc. For 4-bit a chunk is 16 bytes, byte j holding elements 2j (low nibble) and 2j+1
// (high nibble); xq orders each 64-block [x0, x2, ..., x62, x1, ..., x63], so chunk c's even elements sit at
// block offset 16 * (c % 2) and its odd ones 32 further.
template <int MM, int BITS, int CPG>
__attribute__((always_inline)) static inline void group_dot(const QmmArgs& a, const uint8_t* wg, int c0,
                                                            const float* sd, __m256 (&acc)[MM]) {
  __m256i iacc[MM];
  for (int c = 0; c < CPG; ++c) {
    const int kc = c0 + c;
    if constexpr (BITS == 4) {
      const __m256i wv = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + c * 16)));
      const __m256i lo = _mm256_and_si256(wv, _mm256_set1_epi16(0x0F));
      const __m256i hi = _mm256_srli_epi16(wv, 4);
      const size_t xo = (size_t)(kc >> 1) * 64 + (kc & 1) * 16;
      for (int m = 0; m < MM; ++m) {
        const int16_t* xq = a.xq + (size_t)m * a.kpad + xo;
        const __m256i p = _mm256_add_epi32(
            _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))),
            _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32))));
        iacc[m] = c == 0 ? p : _mm256_add_epi32(iacc[m], p);
      }
    } else {
      const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + c * 32)));
      const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + c * 32 + 16)));
      for (int m = 0; m < MM; ++m) {
        const int16_t* xq = a.xq + (size_t)m * a.kpad + (size_t)kc * 32;
        const __m256i p = _mm256_add_epi32(
            _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))),
            _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16))));
        iacc[m] = c == 0 ? p : _mm256_add_epi32(iacc[m], p);
      }
    }
  }
  for (int m = 0; m < MM; ++m)
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m]), _mm256_set1_ps(sd[m * a.gpad]), acc[m]);
}

constexpr int kPrefetch = 2048;
// Short rows (SmolLM2's 288/768-byte rows) go R = 4 at a time for one x row, as in qmm_vnni.cpp.
constexpr size_t kBlockRowsMaxBytes = 768;

// R consecutive output rows; sd scratch: R * MM * gpad floats, sb/bb: 2 * gpad floats.
template <int MM, int R, int BITS, int CPG>
static inline void qmv_block(const QmmArgs& a, int n, float* sd, float* sbuf, float* bbuf) {
  constexpr int G = CPG * 32;
  const int K = a.K, ng = K / G, gp = a.gpad;
  const size_t row_bytes = (size_t)K * BITS / 8;
  constexpr size_t group_bytes = (size_t)G * BITS / 8;
  __m256 acc0[R][MM], acc1[R][MM];
  // Locals: the sd stores below may alias QmmArgs as far as the compiler knows (it reloaded a.xd every step).
  const float* const xd = a.xd;
  const float* const xsum = a.xsum;
  const float* const xcorr = a.xcorr;
  {
    // The scales and biases of the rows a few blocks on, as the weights below (separate arrays: their own misses).
    const size_t item = a.stype == ScaleType::f32 ? 4 : 2, sbytes = (size_t)R * ng * item;
    const size_t ahead = (size_t)(n + 2 * R) * ng * item;
    for (size_t l = 0; l < sbytes; l += 64) {
      _mm_prefetch(static_cast<const char*>(a.scales) + ahead + l, _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(a.biases) + ahead + l, _MM_HINT_T0);
    }
  }
  for (int r = 0; r < R; ++r) {
    scale_row_values(a.scales, a.stype, n + r, ng, sbuf);  // the pad past ng stays zero (qmv_rows)
    scale_row_values(a.biases, a.stype, n + r, ng, bbuf);
    for (int m = 0; m < MM; ++m) acc0[r][m] = acc1[r][m] = _mm256_setzero_ps();
    // sd[r][m][g] = s[g] * d[m][g] for the group loop; the centring and bias terms go straight into acc0 and
    // acc1 (two chains, not one: they are all this loop waits on) (xd, xsum, xcorr are zero past ng).
    for (int g = 0; g < ng; g += 8) {
      const __m256 sv = _mm256_load_ps(sbuf + g), bv = _mm256_load_ps(bbuf + g);
      for (int m = 0; m < MM; ++m) {
        const size_t xo = (size_t)m * gp + g;
        _mm256_storeu_ps(sd + (r * MM + m) * gp + g, _mm256_mul_ps(sv, _mm256_loadu_ps(xd + xo)));
        acc1[r][m] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(xsum + xo), acc1[r][m]);
        acc0[r][m] = _mm256_fmadd_ps(sv, _mm256_loadu_ps(xcorr + xo), acc0[r][m]);
      }
    }
  }
  const uint8_t* w0 = a.w + (size_t)n * row_bytes;
  const size_t pf = std::max<size_t>(kPrefetch, (size_t)R * row_bytes);
  // Two accumulator sets so consecutive groups do not wait on each other's FMA.
  int g = 0;
  for (; g + 1 < ng; g += 2) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = w0 + r * row_bytes + g * group_bytes;
      // Weights stream from DRAM once per token: one prefetch per cache line, kPrefetch bytes ahead, and the line of
      // the last byte (rows not 64-byte aligned, e.g. 288 bytes, span one line more than their 64-byte steps; one
      // thread, 256 MB of 288-byte 64-group rows cycled, Zen 4: 1-19% less time, median ~6%).
      const char* ahead = reinterpret_cast<const char*>(wr + pf);
      for (size_t l = 0; l < 2 * group_bytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
      // And 2 kPrefetch further into L2: more lines in flight (Zen 4 running this set, in-model A/B call by call:
      // the layers' matvecs +4-5%).
      for (size_t l = 0; l < 2 * group_bytes; l += 64) _mm_prefetch(ahead + 2 * kPrefetch + l, _MM_HINT_T1);
      _mm_prefetch(ahead + 2 * group_bytes - 1, _MM_HINT_T0);
      group_dot<MM, BITS, CPG>(a, wr, g * CPG, sd + r * MM * gp + g, acc0[r]);
      group_dot<MM, BITS, CPG>(a, wr + group_bytes, (g + 1) * CPG, sd + r * MM * gp + g + 1, acc1[r]);
    }
  }
  if (g < ng)
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = w0 + r * row_bytes + g * group_bytes;
      _mm_prefetch(reinterpret_cast<const char*>(wr + pf), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wr + group_bytes - 1 + pf), _MM_HINT_T0);
      group_dot<MM, BITS, CPG>(a, wr, g * CPG, sd + r * MM * gp + g, acc0[r]);
    }
  if constexpr (R == 4 && MM == 1) {
    _mm_storeu_ps(a.out + n, hsum4(_mm256_add_ps(acc0[0][0], acc1[0][0]), _mm256_add_ps(acc0[1][0], acc1[1][0]),
                                   _mm256_add_ps(acc0[2][0], acc1[2][0]), _mm256_add_ps(acc0[3][0], acc1[3][0])));
  } else {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) a.out[(size_t)m * a.N + n + r] = hsum(_mm256_add_ps(acc0[r][m], acc1[r][m]));
  }
}

template <int MM, int BITS, int CPG>
static void qmv_rows(const QmmArgs& a, int n0, int n1) {
  constexpr int R = MM == 1 ? 4 : 1;
  thread_local std::vector<float> store;
  store.resize((size_t)(R * MM + 2) * a.gpad + 16);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 31) & ~uintptr_t(31));
  float* sbuf = base;  // gpad is a multiple of 16: every buffer stays 32-byte aligned
  float* bbuf = base + a.gpad;
  float* sd = base + 2 * a.gpad;
  std::fill(sbuf, sbuf + 2 * a.gpad, 0.f);  // scale_row_values writes [0, ng) of each row: the pad stays zero
  int n = n0;
  if constexpr (MM > 4) {
    // 16 ymm registers hold the accumulators of 4 x rows, not 8 (the VNNI kernel has 32 zmm): rows 0-3 and
    // 4.. go as two blocks over each weight row, its second read coming from L1.
    QmmArgs hi = past_x_rows(a, 4);
    hi.out += (size_t)4 * a.N;
    for (; n < n1; ++n) {
      qmv_block<4, 1, BITS, CPG>(a, n, sd, sbuf, bbuf);
      qmv_block<MM - 4, 1, BITS, CPG>(hi, n, sd, sbuf, bbuf);
    }
  } else {
    if ((size_t)a.K * BITS / 8 <= kBlockRowsMaxBytes)
      for (; n + R <= n1; n += R) qmv_block<MM, R, BITS, CPG>(a, n, sd, sbuf, bbuf);
    for (; n < n1; ++n) qmv_block<MM, 1, BITS, CPG>(a, n, sd, sbuf, bbuf);
  }
}

struct Rows {  // the kernels count 32-element chunks per group (CPG)
  template <int MM, int BITS, int GS>
  static void run(const QmmArgs& a, int n0, int n1) { qmv_rows<MM, BITS, GS / 32>(a, n0, n1); }
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
  const int ng = K / gs, nv = gs / 8;
  const float off = bits == 4 ? 8.f : 128.f;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int m = 0; m < M; ++m) {
    int16_t* q = bits == 4 ? tmp.data() : xq + (size_t)m * kpad;  // natural order first for 4-bit
    for (int g = 0; g < ng; ++g) {
      const float* xg = x + (size_t)m * K + (size_t)g * gs;
      __m256 vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
      for (int v = 0; v < nv; ++v) {
        const __m256 xv = _mm256_loadu_ps(xg + 8 * v);
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(xv, absmask));
        vsum = _mm256_add_ps(vsum, xv);
      }
      __m128 mx4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      mx4 = _mm_max_ps(mx4, _mm_movehl_ps(mx4, mx4));
      mx4 = _mm_max_ss(mx4, _mm_movehdup_ps(mx4));
      const float amax = _mm_cvtss_f32(mx4), sum = hsum(vsum);
      const size_t o = (size_t)m * gpad + g;
      xsum[o] = sum;
      if (!(amax > 0.f) || !std::isfinite(amax)) {  // all zero: nothing to add; inf/nan: let d carry it
        xd[o] = amax > 0.f ? amax : 0.f;
        for (int k = 0; k < gs; ++k) q[g * gs + k] = 0;
        continue;
      }
      const __m256 inv = _mm256_set1_ps(32767.f / amax);
      __m256i isum = _mm256_setzero_si256();
      for (int v = 0; v < nv; v += 2) {
        // Round to nearest even, as lrintf; packs saturates and interleaves 128-bit halves (undone by permute).
        const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * v), inv));
        const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * v + 8), inv));
        isum = _mm256_add_epi32(isum, _mm256_add_epi32(q0, q1));
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * gs + 8 * v), packed);
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      xd[o] = amax / 32767.f;
      xcorr[o] = off * (sum - xd[o] * static_cast<float>(_mm_cvtsi128_si32(s4)));
    }
    if (bits == 4) {
      // Each 64-block as [x0, x2, ..., x62, x1, x3, ..., x63].
      int16_t* dst = xq + (size_t)m * kpad;
      for (int b = 0; b < kpad; b += 64)
        for (int i = 0; i < 32; ++i) {
          dst[b + i] = tmp[b + 2 * i];
          dst[b + 32 + i] = tmp[b + 2 * i + 1];
        }
    }
  }
}

}  // namespace isa_avx2int

KernelSet avx2int_kernels() {
  KernelSet ks = avx2_kernels();  // prefill tiles, SwiGLU and attention stay the float32 AVX2 ones
  ks.isa = "avx2";
  ks.qmv = isa_avx2int::qmv;
  ks.int16_x = true;
  ks.prep_x16 = isa_avx2int::prep_x16;
  return ks;
}

}  // namespace mlxinfer_cpu
