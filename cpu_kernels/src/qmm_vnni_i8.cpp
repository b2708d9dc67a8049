// AVX-512 VNNI int8 decode matvec for 4- and 8-bit weights (this file alone is compiled with the VNNI set's flags):
// the opt-in "avx512vnnii8" set (MLXINFER_ISA=avx512vnnii8), llama.cpp's Q4 x Q8 and Q8 x Q8 accuracy class on MLX's
// affine format.
//
// Why: the int16 kernel (qmm_vnni.cpp) does 32 multiply-adds per vpdpwssd and loads one 64-byte x vector per
// instruction; vpdpbusd multiplies 64 unsigned nibbles by 64 int8 x values, so the same work takes half the
// dot-product instructions, half the x loads and, with 128 elements per step, half the float scalings:
//   out[m, n] = sum_g s[n, g] * (d[m, g] * sum_k q * xq + xcorr[m, g]) + b[n, g] * xsum[m, g]
// with x ~= d * xq, |xq| <= 127 per weight group and xcorr = off * (xsum - d * sum xq), off = 8 (4-bit) or 128
// (8-bit): qmm_avx2i8.cpp explains the centring. Accuracy is llama.cpp's: int8 x costs ~0.3-0.5% of a dot's scale,
// where int16 x costs ~2e-5.
//
// Layout: x rows are kpad (a multiple of 128) int8 values. A block is the 64 weight bytes of a row, zero-padded at
// the end of K. 4-bit: 128 elements, byte j holding element 2j in its low nibble and 2j + 1 in its high one, so
// (w & 15) pairs with the first half of the block's x and (w >> 4) with the second: x is laid out per block as
// [x0, x2, ..., x126, x1, x3, ..., x127], and int32 lane l of both vpdpbusd sums elements 8l..8l+7. 8-bit: 64
// elements in order, lane l sums elements 4l..4l+3. Either way a lane holds one group's products (32-, 64- or
// 128-groups; a 128-group spans two 8-bit blocks).
#include <immintrin.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "qmm_kernels.h"
#include "qmv_dispatch.h"
#include "vnni_helpers.h"

namespace mlxinfer_cpu {
namespace isa_vnni_i8 {

using namespace vnni_helpers;

// Elements per block (64 weight bytes).
template <int BITS>
constexpr int kBlock = BITS == 4 ? 128 : 64;

// Scales of the groups in block c, one per int32 lane (the lane's elements, above). sd: one x row's s * d.
template <int BITS, int GS>
static inline __m512 block_scale(const float* sd, int c) {
  constexpr int per_block = kBlock<BITS> / GS;  // groups per block: 4, 2, 1, or 0 (8-bit 128-groups: half a group)
  if constexpr (per_block == 4) {
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(sd + 4 * c)));
  } else if constexpr (per_block == 2) {
    return pair_scale(sd + 2 * c);
  } else if constexpr (per_block == 1) {
    return _mm512_set1_ps(sd[c]);
  } else {
    return _mm512_set1_ps(sd[c / 2]);
  }
}

// R consecutive output rows n.. (R = 1 or 2: two weight rows share every x load) for MM x rows; each row's 16
// partial sums go to out[r] + m * 256 (qmv_rows reduces them). sd: scratch of R * MM * gpad floats.
template <int MM, int R, int BITS, int GS>
static inline void qmv_pass(const QmmArgs& a, int n, float* sd, float* const (&out)[R]) {
  static_assert(MM * R <= 8, "accumulators: at most 8 (x row, weight row) pairs per pass");
  constexpr int NA = MM * R <= 2 ? 2 : 1;  // independent FMA chains when there are few pairs
  const int K = a.K, ng = K / GS, gp = a.gpad;
  const size_t row_bytes = (size_t)K * BITS / 8;
  __m512 acc[NA][R][MM];
  for (int i = 0; i < NA; ++i)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) acc[i][r][m] = _mm512_setzero_ps();
  // sd = s * d per group (zero past ng: masked scales, zeroed xd); the bias and centring terms go into acc[0].
  {
    float* sds[R];
    __m512* accs[R];
    for (int r = 0; r < R; ++r) {
      sds[r] = sd + r * MM * gp;
      accs[r] = acc[0][r];
    }
    row_setup<MM, R>(a, n, ng, sds, accs);
  }
  const uint8_t* w0 = a.w + (size_t)n * row_bytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int full = K / kBlock<BITS>;
  const int tail_bytes = (K % kBlock<BITS>) * BITS / 8;  // 16, 32 or 48 weight bytes in a last partial block
  auto block = [&](auto ic, int c, bool tail) {
    constexpr int i = decltype(ic)::value;
    __m512i lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = w0 + r * row_bytes + (size_t)c * 64;
      // Weights stream from DRAM once per token, kPrefetch bytes ahead. A block is one line only where rows are
      // 64-byte aligned: the line of its last byte too (288-byte rows from DRAM: ~0.93x the int16 kernel's time
      // without it, ~0.99x with it; harness, one thread, 256 MB cycled).
      if (!tail) {
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + 63), _MM_HINT_T0);
      }
      const __m512i v =
          tail ? _mm512_maskz_loadu_epi8((__mmask64)((1ull << tail_bytes) - 1), p) : _mm512_loadu_si512(p);
      if constexpr (BITS == 4) {
        lo[r] = _mm512_and_si512(v, low4);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      } else {
        lo[r] = v;
      }
    }
    for (int m = 0; m < MM; ++m) {
      const int8_t* x = a.xb + (size_t)m * a.kpad + (size_t)c * kBlock<BITS>;
      const __m512i xl = _mm512_loadu_si512(x);
      for (int r = 0; r < R; ++r) {
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], xl);
        if constexpr (BITS == 4) d = _mm512_dpbusd_epi32(d, hi[r], _mm512_loadu_si512(x + 64));
        const __m512 s = block_scale<BITS, GS>(sd + (r * MM + m) * gp, c);
        acc[i][r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[i][r][m]);
      }
    }
  };
  using I0 = std::integral_constant<int, 0>;
  int c = 0;
  for (; c + NA <= full; c += NA) {
    block(I0{}, c, false);
    if constexpr (NA == 2) block(std::integral_constant<int, 1>{}, c + 1, false);
  }
  for (; c < full; ++c) block(I0{}, c, false);
  if (tail_bytes) block(I0{}, full, true);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) {
      __m512 v = acc[0][r][m];
      if constexpr (NA == 2) v = _mm512_add_ps(v, acc[NA - 1][r][m]);
      _mm512_store_ps(out[r] + m * 256, v);
    }
}

// Output rows in blocks of 16, reduced by sum16 as in qmm_vnni.cpp's qmv_rows: [m][row][16] partial sums. Two
// weight rows per pass where qmm_vnni.cpp pairs them (from 4 x rows, or rows of at most 512 bytes), in passes of
// at most 4 x rows.
template <int MM, int BITS, int GS>
static void qmv_rows(const QmmArgs& a, int n0, int n1) {
  thread_local std::vector<float> store;
  const size_t sd_len = ((size_t)8 * a.gpad + 15) / 16 * 16;  // R * (x rows per pass) <= 8
  store.resize(sd_len + (size_t)MM * 256 + 16);
  float* sd = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t(63));
  float* rows = sd + sd_len;
  const bool short_rows = (size_t)a.K * BITS / 8 <= 512;
  const bool pairs = MM >= 4 || (short_rows && (MM >= 2 || short_row_pairs()));
  constexpr int P = MM < 4 ? MM : 4;  // x rows in the first pass of a pair
  const QmmArgs rest = past_x_rows(a, P);
  for (int nb = n0; nb < n1; nb += 16) {
    const int cnt = n1 - nb < 16 ? n1 - nb : 16;
    int j = 0;
    if (pairs)
      for (; j + 1 < cnt; j += 2) {
        float* const o[2] = {rows + 16 * j, rows + 16 * (j + 1)};
        qmv_pass<P, 2, BITS, GS>(a, nb + j, sd, o);
        if constexpr (MM > P) {
          float* const o2[2] = {o[0] + P * 256, o[1] + P * 256};
          qmv_pass<MM - P, 2, BITS, GS>(rest, nb + j, sd, o2);
        }
      }
    for (; j < cnt; ++j) {
      float* const o[1] = {rows + 16 * j};
      qmv_pass<MM, 1, BITS, GS>(a, nb + j, sd, o);
    }
    const __mmask16 k = (__mmask16)((1u << cnt) - 1);
    for (int m = 0; m < MM; ++m) _mm512_mask_storeu_ps(a.out + (size_t)m * a.N + nb, k, sum16(rows + m * 256));
  }
}

struct Rows {
  template <int MM, int BITS, int GS>
  static void run(const QmmArgs& a, int n0, int n1) { qmv_rows<MM, BITS, GS>(a, n0, n1); }
};

// int8 x turned off (set_int8_decode): the int16 x kernel of qmm_vnni.cpp.
static QmvFn int16_qmv = nullptr;

static void qmv(const QmmArgs& a, int n0, int n1) {
  if (a.xb == nullptr) return int16_qmv(a, n0, n1);
  if (a.bits == 4) return dispatch_qmv<Rows, 4>(a, n0, n1);
  dispatch_qmv<Rows, 8>(a, n0, n1);
}

// x rounded to int8 per weight group (d = max|x| / 127, round to nearest even, as qmm_avx2i8.cpp's prep_x8) in
// the layout above for weights of `bits`; the caller zeroes the buffers and sizes xb (M, kpad), kpad a multiple of
// 128.
static void prep_x8(const float* x, int M, int K, int gs, int bits, int kpad, int gpad, int8_t* xb, float* xd,
                    float* xcorr, float* xsum) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  prep_int8_rows(x, M, K, gs, bits, gpad, xd, xcorr, xsum, [&](int m, int g, __m512 inv) {
    const float* xr = x + (size_t)m * K;
    int8_t* dst = xb + (size_t)m * kpad;
    __m512i isum = _mm512_setzero_si512();
    for (int e = g * gs; e < (g + 1) * gs && bits == 8; e += 16) {  // 8-bit: in order
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + e), inv));
      isum = _mm512_add_epi32(isum, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e), _mm512_cvtsepi32_epi8(q));
    }
    for (int e = g * gs; e < (g + 1) * gs && bits == 4; e += 32) {
      const __m512 a = _mm512_loadu_ps(xr + e), b = _mm512_loadu_ps(xr + e + 16);
      const __m512i qe = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(a, even, b), inv));
      const __m512i qo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(a, odd, b), inv));
      isum = _mm512_add_epi32(isum, _mm512_add_epi32(qe, qo));
      int8_t* blk = dst + (size_t)(e / 128) * 128 + (e % 128) / 2;  // this 32-chunk's 16 evens, then its 16 odds
      _mm_storeu_si128(reinterpret_cast<__m128i*>(blk), _mm512_cvtsepi32_epi8(qe));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(blk + 64), _mm512_cvtsepi32_epi8(qo));
    }
    return isum;
  });
}

}  // namespace isa_vnni_i8

KernelSet avx512vnnii8_kernels() {
  KernelSet ks = avx512vnni_kernels();  // prefill and attention stay the VNNI set's
  isa_vnni_i8::int16_qmv = ks.qmv;
  ks.isa = "avx512vnnii8";
  ks.qmv = isa_vnni_i8::qmv;
  ks.int8_x = ks.int8_x8 = true;
  ks.prep_x8 = isa_vnni_i8::prep_x8;
  ks.int8_kpad = 128;
  return ks;
}

}  // namespace mlxinfer_cpu
