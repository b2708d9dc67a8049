// AVX2 + FMA kernels (this file alone is compiled with -mavx2 -mfma -mf16c: F16C widens a float16 KV cache).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {
namespace isa_avx2 {

struct V {
  static constexpr int W = 8;
  __m256 r;
  static V zero() { return {_mm256_setzero_ps()}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static V load_h(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a.r); }
  static V set1(float f) { return {_mm256_set1_ps(f)}; }
  static V add(V a, V b) { return {_mm256_add_ps(a.r, b.r)}; }
  static V mul(V a, V b) { return {_mm256_mul_ps(a.r, b.r)}; }
  static V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.r, b.r, c.r)}; }
  static float reduce(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.r), _mm256_extractf128_ps(a.r, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

// Low 8 bytes of b -> 8 floats.
static inline V u8_to_f(__m128i b) { return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))}; }

static inline void load_q4(const uint8_t* p, V* q) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  q[0] = u8_to_f(lo);
  q[1] = u8_to_f(_mm_srli_si128(lo, 8));
  q[2] = u8_to_f(hi);
  q[3] = u8_to_f(_mm_srli_si128(hi, 8));
}

static inline void load_q8(const uint8_t* p, V* q) {
  for (int i = 0; i < 4; ++i)
    q[i] = u8_to_f(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
}

constexpr int kPackM = 16;

#include "qmm_impl.inc"
#include "attn_impl.inc"

}  // namespace isa_avx2

SdpaFn avx2_sdpa() { return isa_avx2::sdpa_rows; }

KernelSet avx2_kernels() { return {"avx2", isa_avx2::kPackM, isa_avx2::qmv, isa_avx2::qmm, false, isa_avx2::silu_mul}; }

}  // namespace mlxinfer_cpu
