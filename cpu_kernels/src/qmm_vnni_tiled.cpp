// AVX-512 VNNI decode matvecs on row-tiled 4- and 8-bit weights (this file alone is compiled with the VNNI flags).
//
// Why: a decode matvec over MLX's row-major weights reduces every output row on its own: a per-row setup (the
// row's scales times x's group scales, its bias terms), one float scaling per group and lane layout, a horizontal
// sum at the end. On short rows (SmolLM2's 576-wide layers: 288 bytes) that work, not DRAM, set the pace (one
// thread ~16 GB/s from DRAM where it reads ~21). Tiled, one int32 lane is one output row: 16 rows advance
// together, a group's float scaling is one vector op for all 16 and nothing is reduced across lanes (one thread,
// 3072 x 576: 2.1x faster from cache, 1.3-1.5x from DRAM; llama.cpp repacks Q4_0 the same way for the same reason).
//
// Layout (QmmArgs::tiled, made by mlxinfer/kernels/tiling.py): rows in tiles of kTileRows = 16; tile t holds, for
// each word j of a row (MLX's uint32 j: elements 8j..8j+7, nibble i = element 8j + i), the 16 rows' words side by
// side (64 bytes), each with its bytes 1 and 2 swapped, so that a word's nibbles (bit 4i) are elements
// [0, 1, 4, 5, 2, 3, 6, 7] of its 8. Scales and biases: tile t, group g: the 16 rows' values side by side. The
// arrays keep their shapes ((N, K/8) uint32, (N, K/gs)); N is a multiple of 16.
//   int16 x (QmmArgs::xq, prep_x16's layout: each 64-block's evens, then odds): (v & 0x000F000F) holds the pair
//   (q0, q2) in each lane, (v & 0x00F000F0) 16 (q1, q3), and v >> 8 the same for (q4, q6), (q5, q7): each against
//   one broadcast int16 pair of x, into a plain and a x16 accumulator (vpdpwssd).
//   int8 x (QmmArgs::xb, prep_x8_tiled below: each word's x as [x0, x4, x2, x6, x1, x5, x3, x7]): (v & 0x0F)
//   holds (q0, q4, q2, q6), (v & 0xF0) 16 (q1, q5, q3, q7) (vpdpbusd).
// 8-bit weights (the LM head; word j = elements 4j..4j+3, bytes (q0, q2, q1, q3) after the swap): int16 x in order
// against (v & 0x00FF00FF) = (q0, q1) and (v >> 8 & 0x00FF00FF) = (q2, q3); int8 x as [x0, x2, x1, x3] against v.
// Per group, with x ~= d * xq as in the row kernels (qmm_vnni_i8.cpp explains the centring term):
//   out[m, n] += s[n, g] * (d[m, g] * sum_k q * xq + xcorr[m, g]) + b[n, g] * xsum[m, g]
// QmmArgs::symmetric (b = -off * s, off = 8 or 128: Q4_0 / Q8_0 imports): s[n, g] * (d * sum + xcorr - off * xsum),
// the biases never read: 1/9 less traffic at group 32 with float16 scales (in-model A/B: decode steps 1.02-1.09x).
#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "qmm_kernels.h"
#include "qmv_dispatch.h"
#include "vnni_helpers.h"

namespace mlxinfer_cpu {
namespace isa_vnni_tiled {

using vnni_helpers::kPrefetch;

// 16 scales (or biases) of one tile's group as float32.
static inline __m512 tile_scales(const void* base, ScaleType t, size_t off) {
  if (t == ScaleType::f32) return _mm512_loadu_ps(static_cast<const float*>(base) + off);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + off));
  return t == ScaleType::f16 ? _mm512_cvtph_ps(h)
                             : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Output rows [16 t, 16 t + 16) for MM x rows of BITS-bit weights; I8: int8 x (xb), else int16 x (xq).
template <int MM, int GS, bool I8, int BITS>
static inline void tile_rows(const QmmArgs& a, int t) {
  constexpr int kWords = GS * BITS / 32;  // words per group
  const int K = a.K, ng = K / GS, gp = a.gpad;
  const uint8_t* w = a.w + (size_t)t * kTileRows * ((size_t)K * BITS / 8);  // this tile: its words, 64 bytes each
  const size_t soff = (size_t)t * kTileRows * ng;
  __m512 acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low = BITS == 8 ? _mm512_set1_epi32(0x00FF00FF)
                      : I8      ? _mm512_set1_epi8(0x0F)
                                : _mm512_set1_epi32(0x000F000F);
  for (int g = 0; g < ng; ++g) {
    __m512i lo[MM], hi[MM];  // two integer sums of this group (4-bit: plain and x16)
    for (int m = 0; m < MM; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
    for (int j = g * kWords; j < (g + 1) * kWords; ++j) {
      const char* p = reinterpret_cast<const char*>(w) + (size_t)j * 64;
      // One tile is one stream: a line per word kPrefetch ahead into L1, and 3 kPrefetch ahead into L2 (more lines
      // in flight: one thread reads DRAM latency-bound here; Zen 4 VM, in-model A/B call by call: the layers'
      // matvecs +7-11%, the LM heads +2-11%).
      _mm_prefetch(p + kPrefetch, _MM_HINT_T0);
      _mm_prefetch(p + 3 * kPrefetch, _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(p);
      if constexpr (BITS == 8 && I8) {  // bytes (q0, q2, q1, q3) against x [x0, x2, x1, x3]; even/odd words apart
        for (int m = 0; m < MM; ++m) {
          const int32_t xw = *reinterpret_cast<const int32_t*>(a.xb + (size_t)m * a.kpad + (size_t)j * 4);
          if (j & 1) {
            hi[m] = _mm512_dpbusd_epi32(hi[m], v, _mm512_set1_epi32(xw));
          } else {
            lo[m] = _mm512_dpbusd_epi32(lo[m], v, _mm512_set1_epi32(xw));
          }
        }
      } else if constexpr (BITS == 8) {  // int16 pairs (q0, q1) and (q2, q3) against x in order
        const __m512i w0 = _mm512_and_si512(v, low), w1 = _mm512_and_si512(_mm512_srli_epi32(v, 8), low);
        for (int m = 0; m < MM; ++m) {
          const int32_t* x32 = reinterpret_cast<const int32_t*>(a.xq + (size_t)m * a.kpad + (size_t)j * 4);
          lo[m] = _mm512_dpwssd_epi32(lo[m], w0, _mm512_set1_epi32(x32[0]));
          hi[m] = _mm512_dpwssd_epi32(hi[m], w1, _mm512_set1_epi32(x32[1]));
        }
      } else if constexpr (I8) {
        const __m512i wl = _mm512_and_si512(v, low), wh = _mm512_andnot_si512(low, v);
        for (int m = 0; m < MM; ++m) {
          const int8_t* x = a.xb + (size_t)m * a.kpad + (size_t)j * 8;
          lo[m] = _mm512_dpbusd_epi32(lo[m], wl, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x)));
          hi[m] = _mm512_dpbusd_epi32(hi[m], wh, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + 4)));
        }
      } else {
        const __m512i v8 = _mm512_srli_epi32(v, 8);
        const __m512i hmask = _mm512_slli_epi32(low, 4);
        const __m512i w0 = _mm512_and_si512(v, low), w1 = _mm512_and_si512(v, hmask);
        const __m512i w2 = _mm512_and_si512(v8, low), w3 = _mm512_and_si512(v8, hmask);
        // Word j's evens are xq[64 (j / 8) + 4 (j % 8) ...], its odds 32 further.
        const size_t xo = (size_t)(j / 8) * 64 + (j % 8) * 4;
        for (int m = 0; m < MM; ++m) {
          const int16_t* x = a.xq + (size_t)m * a.kpad + xo;
          const int32_t* x32 = reinterpret_cast<const int32_t*>(x);
          const int32_t* o32 = reinterpret_cast<const int32_t*>(x + 32);
          lo[m] = _mm512_dpwssd_epi32(lo[m], w0, _mm512_set1_epi32(x32[0]));
          lo[m] = _mm512_dpwssd_epi32(lo[m], w2, _mm512_set1_epi32(x32[1]));
          hi[m] = _mm512_dpwssd_epi32(hi[m], w1, _mm512_set1_epi32(o32[0]));
          hi[m] = _mm512_dpwssd_epi32(hi[m], w3, _mm512_set1_epi32(o32[1]));
        }
      }
    }
    const size_t so = soff + (size_t)g * kTileRows;
    // The scales (and biases) are streams of their own, a line per 2-4 groups: fetched 16 groups ahead they no
    // longer stall the group's scaling (Zen 4 VM, in-model A/B step by step, 11 runs: steps +1-9%).
    const size_t ahead = (so + 16 * kTileRows) * (a.stype == ScaleType::f32 ? 4 : 2);
    _mm_prefetch(static_cast<const char*>(a.scales) + ahead, _MM_HINT_T0);
    if (!a.symmetric) _mm_prefetch(static_cast<const char*>(a.biases) + ahead, _MM_HINT_T0);
    const __m512 s = tile_scales(a.scales, a.stype, so);
    // Symmetric weights (b = -off * s): out += s * (dq - off * xsum), with b = 0 here; their biases' lines are
    // never fetched.
    const __m512 b = a.symmetric ? _mm512_setzero_ps() : tile_scales(a.biases, a.stype, so);
    const float off = a.symmetric ? (BITS == 4 ? 8.f : 128.f) : 0.f;
    for (int m = 0; m < MM; ++m) {
      const size_t xg = (size_t)m * gp + g;
      // 4-bit: hi holds 16 x its products exactly, so the shift is exact.
      const __m512i sum = _mm512_add_epi32(lo[m], BITS == 4 ? _mm512_srai_epi32(hi[m], 4) : hi[m]);
      const float corr = a.xcorr[xg] - off * a.xsum[xg];
      const __m512 dq = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(a.xd[xg]), _mm512_set1_ps(corr));
      acc[m] = _mm512_fmadd_ps(s, dq, _mm512_fmadd_ps(b, _mm512_set1_ps(a.xsum[xg]), acc[m]));
    }
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(a.out + (size_t)m * a.N + (size_t)t * kTileRows, acc[m]);
}

template <bool I8>
struct Tiles {
  template <int MM, int BITS, int GS>
  static void run(const QmmArgs& a, int n0, int n1) {
    // More than 4 x rows: two passes, so that each pass's integer sums and float results stay in registers.
    constexpr int P = MM <= 4 ? MM : 4;
    const QmmArgs rest = past_x_rows(a, P);
    for (int t = n0 / kTileRows; t < n1 / kTileRows; ++t) {
      tile_rows<P, GS, I8, BITS>(a, t);
      if constexpr (MM > P) {
        QmmArgs r = rest;
        r.out = a.out + (size_t)P * a.N;
        tile_rows<MM - P, GS, I8, BITS>(r, t);
      }
    }
  }
};

// Rows [n0, n1), multiples of kTileRows: int8 x when the caller prepared it (xb), else int16 x.
static void qmv(const QmmArgs& a, int n0, int n1) {
  if (a.bits == 8) {
    if (a.xb != nullptr) return dispatch_qmv<Tiles<true>, 8>(a, n0, n1);
    return dispatch_qmv<Tiles<false>, 8>(a, n0, n1);
  }
  if (a.xb != nullptr) return dispatch_qmv<Tiles<true>, 4>(a, n0, n1);
  dispatch_qmv<Tiles<false>, 4>(a, n0, n1);
}

// x rounded to int8 per weight group as prep_x8 (qmm_vnni_i8.cpp) does, in the tiled words' order (above): for
// 4-bit weights each word's 8 values as [x0, x4, x2, x6, x1, x5, x3, x7], for 8-bit its 4 as [x0, x2, x1, x3];
// kpad a multiple of 16.
static void prep_x8(const float* x, int M, int K, int gs, int bits, int kpad, int gpad, int8_t* xb, float* xd,
                    float* xcorr, float* xsum) {
  const __m512i order = bits == 4 ? _mm512_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15)
                                  : _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  vnni_helpers::prep_int8_rows(x, M, K, gs, bits, gpad, xd, xcorr, xsum, [&](int m, int g, __m512 inv) {
    const float* xg = x + (size_t)m * K + (size_t)g * gs;
    int8_t* dst = xb + (size_t)m * kpad + (size_t)g * gs;
    __m512i isum = _mm512_setzero_si512();
    for (int v = 0; v < gs; v += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutexvar_ps(order, _mm512_loadu_ps(xg + v)), inv));
      isum = _mm512_add_epi32(isum, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + v), _mm512_cvtsepi32_epi8(q));
    }
    return isum;
  });
}

}  // namespace isa_vnni_tiled

KernelSet with_tiled_decode(KernelSet ks) {
  ks.qmv_tiled = isa_vnni_tiled::qmv;
  ks.prep_x8_tiled = isa_vnni_tiled::prep_x8;
  return ks;
}

}  // namespace mlxinfer_cpu
