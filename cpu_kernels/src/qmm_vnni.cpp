// AVX-512 VNNI decode matvec (this file alone is compiled with -mavx512f -mavx512bw -mavx512vnni).
//
// Why: the float32 decode kernel spends ~7 instructions per 16 weights (unpack, widen, convert, FMA) and tops out
// at ~20 G weights/s per core, below what DRAM can feed two cores. Here x is rounded to int16 once per call (a
// scale per weight group), and the weights stay integers: vpdpwssd does 32 int16 multiply-adds per instruction,
// and each group's exact integer sum is scaled once in float32:
//   out[m, n] = sum_g s[n, g] * d[m, g] * I[m, n, g] + sum_g b[n, g] * xsum[m, g]
//   I[m, n, g] = sum_{k in g} q[n, k] * xq[m, k],   xq = round(x / d),   d[m, g] = max|x[m, g]| / 32767
// The bias term uses the exact float32 xsum. Rounding x costs at most d/2 per element (1.5e-5 of the group's
// largest |x|): results differ from the float32 kernel by ~1e-5 relative, far below 4-bit weight error.
// Prefill (M > 8) and attention keep the float32 AVX-512 kernels (compute-bound, already blocked).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {
namespace isa_vnni {

// Row n of scales/biases as float32 into buf (padded with zeros to a multiple of 16).
static inline void scale_row(const void* base, ScaleType t, int n, int ng, float* buf) {
  int g = 0;
  if (t == ScaleType::f32) {
    const float* p = static_cast<const float*>(base) + (size_t)n * ng;
    for (; g + 16 <= ng; g += 16) _mm512_store_ps(buf + g, _mm512_loadu_ps(p + g));
    if (g < ng) _mm512_store_ps(buf + g, _mm512_maskz_loadu_ps((__mmask16)((1u << (ng - g)) - 1), p + g));
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(base) + (size_t)n * ng;
  for (; g < ng; g += 16) {
    const __mmask16 k = ng - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (ng - g)) - 1);
    const __m256i h = _mm256_maskz_loadu_epi16(k, p + g);
    const __m512 f = t == ScaleType::f16 ? _mm512_cvtph_ps(h)
                                         : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm512_store_ps(buf + g, f);
  }
}

// Reads a (lo, hi) float pair and spreads it over lanes 0-7 and 8-15: the scales of two 32-groups that share
// one 64-element block.
static inline __m512 pair_scale(const float* p) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)))));
}

// Centring q (q - 8 for 4-bit, q - 128 for 8-bit) halves |s * q| and with it the error that rounding x
// contributes (it scales with the integer weights, not with w). It is free: sum (q - off) xq = I - off * sum xq
// is an exact integer identity, so the dot products use q as stored and each row subtracts
// sum_g sd[g] * off * S[g] (S = QmmArgs::xqsum) once; the bias absorbs off * s.
template <int BITS>
constexpr int kOff = BITS == 4 ? 8 : 128;

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

// Prefetch distance in bytes (1024, 2048 and 4096 measured within 3% of each other on Llama-1B shapes).
constexpr int kPrefetch = 2048;

template <int MM, int BITS, int GS>
static void qmv_rows(const QmmArgs& a, int n0, int n1) {
  const int K = a.K, ng = K / GS, gp = a.gpad;
  const size_t row_bytes = (size_t)K * BITS / 8;
  constexpr int unit_elems = BITS == 4 && GS == 32 ? 64 : GS;
  constexpr int unit_bytes = unit_elems * BITS / 8;
  const int nfull = K / unit_elems;           // units with all their bytes
  const bool tail = K % unit_elems != 0;      // 4-bit GS 32 with K % 64 == 32
  thread_local std::vector<float> store;
  store.resize((size_t)(2 + MM) * gp + 16);
  float* sbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t(63));
  float* bbuf = sbuf + gp;
  float* sd = bbuf + gp;  // (MM, gp): s[n, g] * d[m, g]
  const __m512 offv = _mm512_set1_ps((float)kOff<BITS>);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = a.w + n * row_bytes;
    scale_row(a.scales, a.stype, n, ng, sbuf);
    scale_row(a.biases, a.stype, n, ng, bbuf);
    __m512 acc0[MM], acc1[MM];
    for (int m = 0; m < MM; ++m) {
      const float* xd = a.xd + (size_t)m * gp;
      const float* xs = a.xsum + (size_t)m * gp;
      acc0[m] = acc1[m] = _mm512_setzero_ps();
      const float* xqs = a.xqsum + (size_t)m * gp;
      for (int g = 0; g < gp; g += 16) {
        const __m512 sv = _mm512_load_ps(sbuf + g);
        const __m512 sdv = _mm512_mul_ps(sv, _mm512_loadu_ps(xd + g));
        _mm512_store_ps(sd + m * gp + g, sdv);
        // + (b + off * s) * xsum - off * sd * S
        acc1[m] = _mm512_fmadd_ps(_mm512_fmadd_ps(offv, sv, _mm512_load_ps(bbuf + g)), _mm512_loadu_ps(xs + g), acc1[m]);
        acc1[m] = _mm512_fnmadd_ps(_mm512_mul_ps(offv, sdv), _mm512_loadu_ps(xqs + g), acc1[m]);
      }
    }
    // Two accumulator sets so consecutive units do not wait on each other's FMA.
    int u = 0;
    for (; u + 1 < nfull; u += 2) {
      // Weights stream from DRAM once per token: one prefetch per cache line, kPrefetch bytes ahead.
      for (int l = 0; l < 2 * unit_bytes; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wr + u * unit_bytes + l + kPrefetch), _MM_HINT_T0);
      unit_dot<MM, BITS, GS>(a, wr + u * unit_bytes, u, sd, acc0, false);
      unit_dot<MM, BITS, GS>(a, wr + (u + 1) * unit_bytes, u + 1, sd, acc1, false);
    }
    if (u < nfull) unit_dot<MM, BITS, GS>(a, wr + u * unit_bytes, u, sd, acc0, false);
    if (tail) unit_dot<MM, BITS, GS>(a, wr + nfull * unit_bytes, nfull, sd, acc1, true);
    for (int m = 0; m < MM; ++m) a.out[(size_t)m * a.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
  }
}

template <int MM, int BITS>
static void qmv_group(const QmmArgs& a, int n0, int n1) {
  switch (a.group_size) {
    case 32: return qmv_rows<MM, BITS, 32>(a, n0, n1);
    case 64: return qmv_rows<MM, BITS, 64>(a, n0, n1);
    default: return qmv_rows<MM, BITS, 128>(a, n0, n1);
  }
}

template <int BITS>
static void qmv_bits(const QmmArgs& a, int n0, int n1) {
  switch (a.M) {
    case 1: return qmv_group<1, BITS>(a, n0, n1);
    case 2: return qmv_group<2, BITS>(a, n0, n1);
    case 3: return qmv_group<3, BITS>(a, n0, n1);
    case 4: return qmv_group<4, BITS>(a, n0, n1);
    case 5: return qmv_group<5, BITS>(a, n0, n1);
    case 6: return qmv_group<6, BITS>(a, n0, n1);
    case 7: return qmv_group<7, BITS>(a, n0, n1);
    default: return qmv_group<8, BITS>(a, n0, n1);
  }
}

static void qmv(const QmmArgs& a, int n0, int n1) {
  if (a.bits == 4) {
    qmv_bits<4>(a, n0, n1);
  } else {
    qmv_bits<8>(a, n0, n1);
  }
}

}  // namespace isa_vnni

KernelSet avx512vnni_kernels() {
  KernelSet ks = avx512_kernels();  // prefill tiles and their packing stay the float32 AVX-512 ones
  ks.isa = "avx512vnni";
  ks.qmv = isa_vnni::qmv;
  ks.int16_x = true;
  return ks;
}

}  // namespace mlxinfer_cpu
