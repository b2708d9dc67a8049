// Small AVX-512 helpers shared by the VNNI decode matvecs (qmm_vnni.cpp: int16 x, qmm_vnni_i8.cpp: int8 x).
// Include only from translation units compiled with the VNNI set's flags; `static inline` keeps each copy local
// to its unit, so no AVX-512 code can be picked by the linker for a unit built for another ISA.
#pragma once

#include <cpuid.h>
#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {
namespace vnni_helpers {

// 16 scales (or biases) from element `off` as float32; lanes past `count` are zero.
static inline __m512 load_scales(const void* base, ScaleType t, size_t off, int count) {
  const __mmask16 k = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
  if (t == ScaleType::f32) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(base) + off);
  const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(base) + off);
  return t == ScaleType::f16 ? _mm512_cvtph_ps(h)
                             : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Reads a (lo, hi) float pair and spreads it over lanes 0-7 and 8-15: the scales of two 32-groups that share
// one 64-element block.
static inline __m512 pair_scale(const float* p) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
}

// The per-row setup of the VNNI matvecs for weight rows n..n+R-1 and MM x rows: sd[r][m * gpad + g] = s[n+r][g] *
// d[m][g] for the unit loop, and the bias and centring terms, sum_g b * xsum + s * xcorr, into acc[r][m]. Each x
// vector is loaded once for all R rows (two one-row setups for a pair measured 10-15% slower on 576-wide rows).
template <int MM, int R>
__attribute__((always_inline)) static inline void row_setup(const QmmArgs& a, int n, int ng, float* const (&sd)[R],
                                                            __m512* const (&acc)[R]) {
  const int gp = a.gpad;
  for (int g = 0; g < ng; g += 16) {
    __m512 sv[R], bv[R];
    for (int r = 0; r < R; ++r) {
      const size_t off = (size_t)(n + r) * ng + g;
      sv[r] = load_scales(a.scales, a.stype, off, ng - g);
      bv[r] = load_scales(a.biases, a.stype, off, ng - g);
    }
    for (int m = 0; m < MM; ++m) {
      const size_t xo = (size_t)m * gp + g;
      const __m512 xd = _mm512_loadu_ps(a.xd + xo), xs = _mm512_loadu_ps(a.xsum + xo);
      const __m512 xc = _mm512_loadu_ps(a.xcorr + xo);
      for (int r = 0; r < R; ++r) {
        _mm512_store_ps(sd[r] + m * gp + g, _mm512_mul_ps(sv[r], xd));
        acc[r][m] = _mm512_fmadd_ps(sv[r], xc, _mm512_fmadd_ps(bv[r], xs, acc[r][m]));
      }
    }
  }
}

// The int8 decode x of the VNNI int8 kernels (qmm_vnni_i8.cpp's rows, qmm_vnni_tiled.cpp's tiles): each weight group
// of each row rounded with d = max|x| / 127 (round to nearest even), as llama.cpp's Q8_0. Per group this fills xsum
// (exact), xd and xcorr = off * (xsum - d * sum xq) (off = 8 for 4-bit weights, 128 for 8-bit: the centring term);
// quantize(m, g, inv) rounds the group's values times inv in the caller's layout, stores them and returns their
// int32 sum (16 lanes). An all-zero group keeps xq zero; inf/nan goes into d. The caller zeroes the buffers.
template <class Quantize>
static inline void prep_int8_rows(const float* x, int M, int K, int gs, int bits, int gpad, float* xd, float* xcorr,
                                  float* xsum, Quantize quantize) {
  const int ng = K / gs;
  const float off = bits == 4 ? 8.f : 128.f;
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < ng; ++g) {
      const float* xg = x + (size_t)m * K + (size_t)g * gs;
      __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
      for (int v = 0; v < gs; v += 16) {
        const __m512 xv = _mm512_loadu_ps(xg + v);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(xv));
        vsum = _mm512_add_ps(vsum, xv);
      }
      const float amax = _mm512_reduce_max_ps(vmax);
      const size_t o = (size_t)m * gpad + g;
      xsum[o] = _mm512_reduce_add_ps(vsum);
      if (!(amax > 0.f) || !std::isfinite(amax)) {  // all zero: nothing to add; inf/nan: let d carry it
        xd[o] = amax > 0.f ? amax : 0.f;
        continue;  // xq stays zero
      }
      const __m512i isum = quantize(m, g, _mm512_set1_ps(127.f / amax));
      xd[o] = amax / 127.f;
      xcorr[o] = off * (xsum[o] - xd[o] * static_cast<float>(_mm512_reduce_add_epi32(isum)));
    }
}

// Prefetch distance in bytes (Dec 6, 600 MB of 8192 x 2048 matrices cycled, GB/s: none 14.6, 1024 18.8, 2048 20.6,
// 4096 20.6, 8192 19.7; hints T1/T2/NTA slower than T0).
constexpr int kPrefetch = 2048;

// r[i] = the sum of the 16 lanes of v[i] (16 vectors, 64-byte aligned, 16 floats apart): a tree of 30 shuffles
// and adds for 16 rows, where one reduction per row costs ~8 dependent ones at the end of every row (Zen 4, one
// thread, 16384 x 640 4-bit rows: 15% of a row's time).
static inline __m512 sum16(const float* v) {
  __m512 w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k) {  // w[k]: quarters 0-1 row 2k, 2-3 row 2k + 1 (8 partial sums each)
    const __m512 a = _mm512_load_ps(v + 32 * k), b = _mm512_load_ps(v + 32 * k + 16);
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int k = 0; k < 4; ++k)  // x[k]: quarter q row 4k + q (4 partial sums)
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // y[k]: quarter q elements 0-1 row 8k + q, 2-3 row 8k + 4 + q
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
  // quarter q element e: row q + 4e
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// One x row streams weight rows one at a time, except rows of at most 512 bytes on AMD CPUs: there two at a time
// (Zen 4, alternating builds, 4 runs x 200 tokens: SmolLM2 shapes decode median ~176 -> ~199 tok/s, Gemma-3-270M
// ~104 -> ~114; harness: -8-10% in cache and on 320-byte rows from DRAM, but +37% on 1024-byte rows). Intel keeps
// one row: on the VNNI Xeon 4 rows side by side streamed 288-byte rows 16% slower; 2 were not measured there.
static inline bool short_row_pairs() {
  static const bool amd = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
    char vendor[13];
    std::memcpy(vendor, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
    vendor[12] = 0;
    return std::strcmp(vendor, "AuthenticAMD") == 0;
  }();
  return amd;
}

}  // namespace vnni_helpers
}  // namespace mlxinfer_cpu
