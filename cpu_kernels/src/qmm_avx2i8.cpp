// AVX2 int8 decode matvec for 4-bit weights (this file alone is compiled with -mavx2 -mfma -mf16c), llama.cpp's
// Q4 x Q8 scheme on MLX's affine format. x is rounded to int8 once per call with a scale per weight group
// (x ~= d * xq, |xq| <= 127); the unsigned nibbles q go straight into vpmaddubsw (32 multiply-adds per
// instruction, twice vpmaddwd's):
//   out[m, n] = sum_g s[n, g] * (d[m, g] * sum_k q * xq + xcorr[m, g]) + b[n, g] * xsum[m, g]
// xsum: exact float sums; xcorr = 8 * (xsum - d * sum xq) centres q for free: without it the rounding error of
// x meets q's mean 7.5, not q - 8, and comes out ~2x larger.
// A vpmaddubsw lane is q0*x0 + q1*x1 <= 2 * 15 * 127 = 3810, so a 128-group's four products add in int16
// (<= 15240) before one vpmaddwd against ones. Accuracy is llama.cpp's (int8 x: ~0.3-0.5% of a dot's scale;
// the 4-bit weights themselves are far coarser). 8-bit weights would overflow the int16 lane (255 * 127 * 2):
// they keep the int16 x kernel of qmm_avx2int.cpp, as do prefill and attention.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2_helpers.h"
#include "qmm_kernels.h"
#include "qmv_dispatch.h"

namespace mlxinfer_cpu {
namespace isa_avx2i8 {

using avx2_helpers::hsum;
using avx2_helpers::hsum4;
using avx2_helpers::scale_row_values;

// The 64 weights of one 64-block as two u8 vectors: lo = elements 0, 2, ..., 62 and hi = 1, 3, ..., 63 (a
// 32-chunk is 16 bytes, byte j = element 2j in its low nibble, 2j+1 in its high one). half: only the first
// 32-chunk exists (K % 64 == 32 with 32-groups): the rest reads as zero and never past the row.
template <bool half = false>
static inline void unpack64(const uint8_t* w, __m256i& lo, __m256i& hi) {
  const __m256i v = half ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)))
                         : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i m = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(v, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}

// sum q * xq over one 64-block as 16 int16 lanes (lanes 0-7: the first 32-chunk, 8-15: the second).
static inline __m256i dot64(__m256i lo, __m256i hi, const int8_t* x) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                          _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))));
}

constexpr int kPrefetch = 2048;
constexpr size_t kBlockRowsMaxBytes = 768;  // rows this short go R = 4 at a time for one x row

// R consecutive output rows n.. for MM x rows. A step is one group (64 or 128 elements), or for 32-groups
// one 64-block holding two groups (int32 lanes 0-3 belong to the first, 4-7 to the second).
// sd: R * MM * gpad (+ 8) floats of scratch; sbuf/bbuf: gpad floats each.
template <int MM, int R, int CPG>
static inline void qmv_block(const QmmArgs& a, int n, float* sd, float* sbuf, float* bbuf) {
  constexpr int NA = MM * R <= 2 ? 2 : 1;  // accumulator sets: independent FMA chains for a lone row
  const int K = a.K, ng = K / (CPG * 32), gp = a.gpad;
  const size_t row_bytes = (size_t)K / 2;
  __m256 acc[NA][R][MM];
  for (int r = 0; r < R; ++r) {
    scale_row_values(a.scales, a.stype, n + r, ng, sbuf);  // the pad past ng stays zero (qmv_rows)
    scale_row_values(a.biases, a.stype, n + r, ng, bbuf);
    for (int i = 0; i < NA; ++i)
      for (int m = 0; m < MM; ++m) acc[i][r][m] = _mm256_setzero_ps();
    // sd = s * d per group; the bias and centring terms go into the first set (xd, xsum, xcorr are zero past ng).
    for (int g = 0; g < gp; g += 8) {
      const __m256 sv = _mm256_load_ps(sbuf + g), bv = _mm256_load_ps(bbuf + g);
      for (int m = 0; m < MM; ++m) {
        const size_t xo = (size_t)m * gp + g;
        _mm256_storeu_ps(sd + (r * MM + m) * gp + g, _mm256_mul_ps(sv, _mm256_loadu_ps(a.xd + xo)));
        acc[0][r][m] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(a.xsum + xo), acc[0][r][m]);
        acc[0][r][m] = _mm256_fmadd_ps(sv, _mm256_loadu_ps(a.xcorr + xo), acc[0][r][m]);
      }
    }
  }
  const uint8_t* w0 = a.w + (size_t)n * row_bytes;
  const size_t pf = std::max<size_t>(kPrefetch, (size_t)R * row_bytes);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  constexpr int SB = CPG == 4 ? 2 : 1;          // 64-blocks per step
  constexpr size_t step_bytes = SB * 32;        // 4-bit: 64 elements = 32 bytes
  const int full = K / (64 * SB);               // whole steps
  int s = 0;
  auto step = [&](auto ic, int s, auto halfc) {
    constexpr int i = decltype(ic)::value;
    constexpr bool half = decltype(halfc)::value;
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = w0 + r * row_bytes + s * step_bytes;
      // Weights stream from DRAM once per token: one prefetch per cache line, pf bytes ahead.
      if (!half && (SB == 2 || (s & 1) == 0)) _mm_prefetch(reinterpret_cast<const char*>(wr + pf), _MM_HINT_T0);
      __m256i lo0, hi0, lo1, hi1;
      unpack64<half>(wr, lo0, hi0);
      if constexpr (SB == 2) unpack64(wr + 32, lo1, hi1);
      for (int m = 0; m < MM; ++m) {
        const int8_t* x = a.xb + (size_t)m * a.kpad + (size_t)s * 64 * SB;
        __m256i p = dot64(lo0, hi0, x);
        if constexpr (SB == 2) p = _mm256_add_epi16(p, dot64(lo1, hi1, x + 64));
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
        const float* sdm = sd + (r * MM + m) * gp;
        const __m256 sv = CPG == 1 ? _mm256_permutevar8x32_ps(_mm256_loadu_ps(sdm + 2 * s), pair)
                                   : _mm256_broadcast_ss(sdm + s);
        acc[i][r][m] = _mm256_fmadd_ps(f, sv, acc[i][r][m]);
      }
    }
  };
  using F = std::false_type;
  using I0 = std::integral_constant<int, 0>;
  for (; s + NA <= full; s += NA) {
    step(I0{}, s, F{});
    if constexpr (NA == 2) step(std::integral_constant<int, NA - 1>{}, s + 1, F{});
  }
  for (; s < full; ++s) step(I0{}, s, F{});
  if (CPG == 1 && (K & 63)) step(I0{}, s, std::true_type{});
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m)
      if constexpr (NA == 2) acc[0][r][m] = _mm256_add_ps(acc[0][r][m], acc[NA - 1][r][m]);
  if constexpr (R == 4 && MM == 1) {
    _mm_storeu_ps(a.out + n, hsum4(acc[0][0][0], acc[0][1][0], acc[0][2][0], acc[0][3][0]));
  } else {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) a.out[(size_t)m * a.N + n + r] = hsum(acc[0][r][m]);
  }
}

template <int MM, int CPG>
static void qmv_rows(const QmmArgs& a, int n0, int n1) {
  constexpr int R = MM == 1 ? 4 : 1;
  thread_local std::vector<float> store;
  store.resize((size_t)(R * MM + 2) * a.gpad + 32);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 31) & ~uintptr_t(31));
  float* sbuf = base;  // gpad is a multiple of 16: every buffer stays 32-byte aligned
  float* bbuf = base + a.gpad;
  float* sd = base + 2 * a.gpad;  // the 32-group step reads 8 floats from 2s: the slack above covers the end
  std::fill(sbuf, sbuf + 2 * a.gpad, 0.f);  // scale_row_values writes [0, ng) of each row: the pad stays zero
  int n = n0;
  if ((size_t)a.K / 2 <= kBlockRowsMaxBytes)
    for (; n + R <= n1; n += R) qmv_block<MM, R, CPG>(a, n, sd, sbuf, bbuf);
  for (; n < n1; ++n) qmv_block<MM, 1, CPG>(a, n, sd, sbuf, bbuf);
}

struct Rows {  // 4-bit only; the kernels count 32-element chunks per group (CPG)
  template <int MM, int BITS, int GS>
  static void run(const QmmArgs& a, int n0, int n1) { qmv_rows<MM, GS / 32>(a, n0, n1); }
};

// 8-bit weights, or int8 x turned off (set_int8_decode): qmm_avx2int.cpp's kernel on the int16 x prepared then.
static QmvFn int16_qmv = nullptr;

static void qmv(const QmmArgs& a, int n0, int n1) {
  if (a.bits != 4 || a.xb == nullptr) return int16_qmv(a, n0, n1);
  dispatch_qmv<Rows, 4>(a, n0, n1);
}

// x rounded to int8 per weight group in the layout QmmArgs::xb describes (the caller zeroes the buffers).
static void prep_x8(const float* x, int M, int K, int gs, int /*bits: 4, int8_x8 is off*/, int kpad, int gpad,
                    int8_t* xb, float* xd, float* xcorr, float* xsum) {
  thread_local std::vector<int8_t> tmp;
  tmp.assign(kpad, 0);
  const int ng = K / gs, nv = gs / 8;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m128i evod = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int m = 0; m < M; ++m) {
    int8_t* q = tmp.data();
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
      const float amax = _mm_cvtss_f32(mx4);
      const size_t o = (size_t)m * gpad + g;
      xsum[o] = hsum(vsum);
      if (!(amax > 0.f) || !std::isfinite(amax)) {  // all zero: nothing to add; inf/nan: let d carry it
        xd[o] = amax > 0.f ? amax : 0.f;
        std::memset(q + (size_t)g * gs, 0, gs);
        continue;
      }
      xd[o] = amax / 127.f;
      const __m256 inv = _mm256_set1_ps(127.f / amax);
      __m256i isum = _mm256_setzero_si256();
      for (int v = 0; v < nv; v += 4) {
        // Round to nearest even; the packs interleave 128-bit halves, undone by perm (as llama.cpp's Q8_0).
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * v), inv));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * v + 8), inv));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * v + 16), inv));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * v + 24), inv));
        isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
        i0 = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (size_t)g * gs + 8 * v),
                            _mm256_permutevar8x32_epi32(i0, perm));
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      xcorr[o] = 8.f * (xsum[o] - xd[o] * static_cast<float>(_mm_cvtsi128_si32(s4)));
    }
    // Each 64-block as [x0, x2, ..., x62, x1, x3, ..., x63]: per 16 bytes evens then odds, then regrouped.
    int8_t* dst = xb + (size_t)m * kpad;
    for (int b = 0; b < kpad; b += 64) {
      __m128i v[4];
      for (int i = 0; i < 4; ++i)
        v[i] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b + 16 * i)), evod);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b), _mm_unpacklo_epi64(v[0], v[1]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b + 16), _mm_unpacklo_epi64(v[2], v[3]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b + 32), _mm_unpackhi_epi64(v[0], v[1]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b + 48), _mm_unpackhi_epi64(v[2], v[3]));
    }
  }
}

}  // namespace isa_avx2i8

KernelSet avx2i8_kernels() {
  KernelSet ks = avx2int_kernels();  // 8-bit decode (int16 x), prefill tiles, SwiGLU and attention
  isa_avx2i8::int16_qmv = ks.qmv;
  ks.isa = "avx2i8";
  ks.qmv = isa_avx2i8::qmv;
  ks.int8_x = true;
  ks.prep_x8 = isa_avx2i8::prep_x8;
  return ks;
}

}  // namespace mlxinfer_cpu
