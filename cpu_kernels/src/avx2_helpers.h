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

// Row n of scales or biases as float32 into buf[0, ng) and zeros into [ng, ng rounded up to 8) (the buffers hold
// at least that many; the decode kernels zero the rest of their pad once per call, not once per row: a memset call
// per row was ~2% of a SmolLM2 decode step). Whole 8-float stores only: the kernels read the buffer back in
// 8-float loads, and a load that spans scalar stores cannot be forwarded from them (a store-forwarding stall of
// ~10+ cycles: with 18 groups a row, SmolLM2's tail, the per-row setup was ~20% of the matvec's samples).
static inline __m256 scale_values8(const void* base, ScaleType t, size_t off) {
  if (t == ScaleType::f32) return _mm256_loadu_ps(static_cast<const float*>(base) + off);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + off));
  if (t == ScaleType::f16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bfloat16
}

static inline void scale_row_values(const void* base, ScaleType t, int n, int ng, float* buf) {
  const size_t off = (size_t)n * ng;
  int g = 0;
  for (; g + 8 <= ng; g += 8) _mm256_storeu_ps(buf + g, scale_values8(base, t, off + g));
  if (g == ng) return;
  const int cnt = ng - g;  // 1..7 values left
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  if (ng >= 8) {
    // The row's last 8 values (never past the row: the last row ends the array), the tail rotated to lanes
    // 0..cnt-1 in registers and the rest zeroed. A copy through memory would stall on forwarding again.
    const __m256 v = scale_values8(base, t, off + ng - 8);
    const __m256 shifted = _mm256_permutevar8x32_ps(v, _mm256_add_epi32(lane, _mm256_set1_epi32(8 - cnt)));
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), lane));
    _mm256_storeu_ps(buf + g, _mm256_and_ps(shifted, keep));
  } else {  // a row of under 8 groups (tiny test models): through a zero-padded copy
    alignas(32) uint8_t tail[32] = {};
    const size_t item = t == ScaleType::f32 ? 4 : 2;
    std::memcpy(tail, static_cast<const uint8_t*>(base) + off * item, (size_t)cnt * item);
    _mm256_storeu_ps(buf, scale_values8(tail, t, 0));
  }
}

}  // namespace avx2_helpers
}  // namespace mlxinfer_cpu
