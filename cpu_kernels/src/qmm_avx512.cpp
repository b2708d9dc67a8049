// AVX-512F kernels (this file alone is compiled with -mavx512f -mfma).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {
namespace isa_avx512 {

struct V {
  static constexpr int W = 16;
  __m512 r;
  static V zero() { return {_mm512_setzero_ps()}; }
  static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V load_h(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a.r); }
  static V set1(float f) { return {_mm512_set1_ps(f)}; }
  static V add(V a, V b) { return {_mm512_add_ps(a.r, b.r)}; }
  static V mul(V a, V b) { return {_mm512_mul_ps(a.r, b.r)}; }
  static V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.r, b.r, c.r)}; }
  static float reduce(V a) { return _mm512_reduce_add_ps(a.r); }
};

static inline V u8_to_f(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }

static inline void load_q4(const uint8_t* p, V* q) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0f);
  q[0] = u8_to_f(_mm_and_si128(b, mask));
  q[1] = u8_to_f(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
}

static inline void load_q8(const uint8_t* p, V* q) {
  q[0] = u8_to_f(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  q[1] = u8_to_f(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
}

constexpr int kPackM = 32;

#include "qmm_impl.inc"
#include "attn_impl.inc"

}  // namespace isa_avx512

SdpaFn avx512_sdpa() { return isa_avx512::sdpa_rows; }

KernelSet avx512_kernels() { return {"avx512", isa_avx512::kPackM, isa_avx512::qmv, isa_avx512::qmm, false, isa_avx512::silu_mul}; }

}  // namespace mlxinfer_cpu
