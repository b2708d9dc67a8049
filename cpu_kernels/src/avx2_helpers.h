// Small AVX2 helpers shared by the AVX2 decode kernels (qmm_avx2int.cpp, qmm_avx2i8.cpp). Include only from
// translation units compiled with -mavx2 -mfma -mf16c; `static inline` keeps each copy local to its unit, so no
// AVX2 code can be picked by the linker for a unit built for another ISA.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {
namespace avx2_helpers {

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Row n of scales or biases as float32 into buf[0, ng) only: the decode kernels zero the pad [ng, gp) of their
// buffers once per call, not once per row (a memset call per row was ~2% of a SmolLM2 decode step).
static inline void scale_row_values(const void* base, ScaleType t, int n, int ng, float* buf) {
  const size_t off = (size_t)n * ng;
  if (t == ScaleType::f32) {
    std::memcpy(buf, static_cast<const float*>(base) + off, (size_t)ng * 4);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + off;
    int g = 0;
    if (t == ScaleType::f16) {
      for (; g + 8 <= ng; g += 8)
        _mm256_store_ps(buf + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + g))));
      for (; g < ng; ++g) buf[g] = _cvtsh_ss(p[g]);
    } else {
      for (; g + 8 <= ng; g += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + g)));
        _mm256_store_ps(buf + g, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      }
      for (; g < ng; ++g) {
        const uint32_t bits = (uint32_t)p[g] << 16;
        std::memcpy(buf + g, &bits, 4);
      }
    }
  }
}

}  // namespace avx2_helpers
}  // namespace mlxinfer_cpu
