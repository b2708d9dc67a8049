// AVX-512 VNNI micro-kernels of the integer prefill GEMM (qmm_avx2i8gemm.cpp drives them; this file alone is
// compiled with -mavx512f -mavx512bw -mavx512vnni, like qmm_vnni.cpp, whose decode matvec it sits beside).
#include <immintrin.h>

#include <cstring>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {

// ---- The int8 prefill's micro-kernel (qmm_kernels.h: I8MicroFn; layouts in qmm_avx2i8gemm.cpp) ----------------
// A chunk (32 k) of a 16-column panel is 8 quads of 64 bytes: quad e holds k = 4e..4e+3 of each column (one dword
// per column), exactly vpdpbusd's operand: u8 weights x s8 x, 4 products per int32 lane. x's 4 bytes of quad e
// are broadcast from memory. The int32 sums equal the AVX2 kernel's (both exact), and the float steps are the same
// operations in the same order, so the two kernels' outputs are equal bit for bit.
namespace isa_vnni {

// s[m] = the integer dot products of x row m's chunk c with the panel's 16 columns (int32, column order).
template <bool WIDE>
__attribute__((always_inline)) static inline void chunk_sums(const uint8_t* wc, const void* xq, size_t xq_stride,
                                                             int c, __m512i (&s)[kI8RowBlock]) {
  constexpr int MR = kI8RowBlock;
  if constexpr (!WIDE) {
    const int8_t* x0 = static_cast<const int8_t*>(xq) + c * 32;
    for (int m = 0; m < MR; ++m) s[m] = _mm512_setzero_si512();
    for (int e = 0; e < 8; ++e) {
      const __m512i w = _mm512_load_si512(reinterpret_cast<const void*>(wc + e * 64));
      for (int m = 0; m < MR; ++m) {
        int32_t v;
        std::memcpy(&v, x0 + m * xq_stride + 4 * e, 4);
        s[m] = _mm512_dpbusd_epi32(s[m], w, _mm512_set1_epi32(v));
      }
    }
  } else {
    // A quad's 32-byte half (8 columns x 4 k) widened to int16 is 16 dword lanes: (k0, k1) and (k2, k3) of each
    // column; x's 4 int16 of the quad broadcast as a qword match them. Each column's two lanes add up at the end.
    const int16_t* x0 = static_cast<const int16_t*>(xq) + c * 32;
    __m512i h[MR][2];
    for (int m = 0; m < MR; ++m) h[m][0] = h[m][1] = _mm512_setzero_si512();
    for (int e = 0; e < 8; ++e) {
      for (int half = 0; half < 2; ++half) {
        const __m512i w = _mm512_cvtepu8_epi16(
            _mm256_load_si256(reinterpret_cast<const __m256i*>(wc + e * 64 + half * 32)));
        for (int m = 0; m < MR; ++m) {
          int64_t v;
          std::memcpy(&v, x0 + m * xq_stride + 4 * e, 8);
          h[m][half] = _mm512_dpwssd_epi32(h[m][half], w, _mm512_set1_epi64(v));
        }
      }
    }
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for (int m = 0; m < MR; ++m) {
      const __m512i a = _mm512_add_epi32(h[m][0], _mm512_srli_epi64(h[m][0], 32));  // lane 2j: column j
      const __m512i b = _mm512_add_epi32(h[m][1], _mm512_srli_epi64(h[m][1], 32));  // lane 2j: column 8 + j
      s[m] = _mm512_permutex2var_epi32(a, evens, b);
    }
  }
}

template <int CPG, bool WIDE>
static void i8_micro(const uint8_t* wp, const float* sp, const float* bp, const void* xq, size_t xq_stride,
                     const float* xd, size_t xd_stride, const float* xs, const float* xc, size_t xs_stride, int nchunk,
                     float* tile) {
  constexpr int MR = kI8RowBlock, NP = 16;
  static_assert(MR == 4, "written for 4 x rows");
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int c = 0; c < nchunk; ++c) {
    const uint8_t* wc = wp + (size_t)c * 512;
    __m512i s[MR];
    chunk_sums<WIDE>(wc, xq, xq_stride, c, s);
    const int g = c / CPG;
    const __m512 sv = _mm512_loadu_ps(sp + g * NP);
    for (int m = 0; m < MR; ++m) {
      const __m512 dv = _mm512_set1_ps(xd[m * xd_stride + c]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), _mm512_mul_ps(sv, dv), acc[m]);
    }
    if (c % CPG == CPG - 1) {  // end of a group: the bias and centring terms
      const __m512 bv = _mm512_loadu_ps(bp + g * NP);
      for (int m = 0; m < MR; ++m) {
        const __m512 xsv = _mm512_set1_ps(xs[m * xs_stride + g]);
        const __m512 xcv = _mm512_set1_ps(xc[m * xs_stride + g]);
        acc[m] = _mm512_fmadd_ps(sv, xcv, _mm512_fmadd_ps(bv, xsv, acc[m]));
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(tile + m * NP, acc[m]);
}

}  // namespace isa_vnni

I8MicroFn vnni_i8_micro(int chunks_per_group) {
  switch (chunks_per_group) {
    case 1: return isa_vnni::i8_micro<1, false>;
    case 2: return isa_vnni::i8_micro<2, false>;
    default: return isa_vnni::i8_micro<4, false>;
  }
}

I8MicroFn vnni_i16_micro(int chunks_per_group) {
  switch (chunks_per_group) {
    case 1: return isa_vnni::i8_micro<1, true>;
    case 2: return isa_vnni::i8_micro<2, true>;
    default: return isa_vnni::i8_micro<4, true>;
  }
}

}  // namespace mlxinfer_cpu
