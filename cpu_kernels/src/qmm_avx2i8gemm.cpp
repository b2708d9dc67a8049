// AVX2 integer prefill GEMMs for 4-bit weights (this file alone is compiled with -mavx2 -mfma -mf16c): x rounded to
// int16 (the default of the avx2/avx2i8 sets, chunk_dot16 below) or, opt-in, to int8 (chunk_dot). Both share the
// tiling, the repacked weight panels and the formula below, with 32767 in place of 127.
//
// Why: the float32 prefill kernel dequantizes every weight to float and spends one FMA per 8 multiply-adds;
// llama.cpp's Q4_0 x Q8_0 path beats it with vpmaddubsw (32 u8 x s8 products, summed in pairs, per instruction).
// Here x is rounded to int8 per 32-element block (d = max|x| / 127, as Q8_0) and the weights stay integers:
//   out[m, n] = sum_c s[n, g(c)] * d[m, c] * I[m, n, c] + sum_g (b[n, g] * xsum[m, g] + s[n, g] * xcorr[m, g])
//   I[m, n, c] = sum_{k in c} (q[n, k]) * xq[m, k]
// xsum is the exact float sum of x over group g; xcorr = 8 * (xsum - sum_c d * sum xq) centres q (q - 8) for
// free, which halves the error that rounding x contributes (it scales with the integer weights).
// Micro-tile: 4 x rows by 16 output columns. One ymm holds 4 consecutive k of 8 columns (byte 4j + i = column j,
// k + i); x's 4 bytes are broadcast to every 32-bit lane, so vpmaddubsw leaves per column two int16 pair sums.
// A 32-block's 8 pair sums stay below 8 * 2 * 15 * 127 = 30480 and add in int16; vpmaddwd with ones then gives
// one int32 per column, converted and scaled once per block.
// The weights of a task's rows are unpacked into that layout once per kKc block (scratch) and reused by every
// block of 4 x rows.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {
namespace isa_avx2i8gemm {

constexpr int MR = kI8RowBlock;  // x rows per micro-tile
constexpr int NP = 16;           // output columns per panel (two ymm of 8 int32 lanes)
constexpr int kPanels = (kPackN + NP - 1) / NP;
constexpr int kPanelBytes = kKc * NP;  // one panel's unpacked weights for one k-block

static_assert(kKc % 128 == 0, "k-blocks must hold whole groups");

// count scales (or biases) from element off as float32 into dst[i * stride].
static inline void load_scales(const void* base, ScaleType t, size_t off, int count, float* dst, int stride) {
  if (t == ScaleType::f32) {
    const float* p = static_cast<const float*>(base) + off;
    for (int i = 0; i < count; ++i) dst[i * stride] = p[i];
  } else if (t == ScaleType::f16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + off;
    for (int i = 0; i < count; ++i) dst[i * stride] = _cvtsh_ss(p[i]);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + off;
    for (int i = 0; i < count; ++i) {
      const uint32_t bits = (uint32_t)p[i] << 16;
      std::memcpy(dst + i * stride, &bits, 4);
    }
  }
}

// Unpacks rows [n0, n1) (n1 - n0 <= kPackN), k in [k0, k0 + kc), into panels of NP columns:
// wdst[panel][chunk][quad 0..7][half 0..1][col 0..7][4 bytes]; sdst/bdst[panel][group][NP] (zero past n1).
// WIDE (the AVX2 int16 micro-kernel): int16 weights, each quad as [half][pair 0..1][col 0..7][2 k]: pair 0 holds
// (k0, k1) and pair 1 (k2, k3) of 8 columns, so vpmaddwd against x's broadcast pair sums one column per lane.
// repack<false> for tiled weights (QmmArgs::tiled, qmm_vnni_tiled.cpp: a tile is a panel): each word of 16 rows,
// its bytes 1 and 2 swapped back, gives quad e (low nibbles) and quad 4 + e (high nibbles) of 16 columns as they
// are; the scales of a tile's group are already side by side. n0 and n1 are multiples of kTileRows.
static void repack_tiled(const QmmArgs& a, int n0, int n1, int k0, int kc, uint8_t* wdst, float* sdst, float* bdst) {
  const int gs = a.group_size, ng = a.K / gs, gpb = kc / gs, nchunk = kc / 32;
  const size_t tile_bytes = (size_t)kTileRows * a.K / 2;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i unswap = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15, 0, 2, 1, 3, 4, 6, 5, 7,
                                          8, 10, 9, 11, 12, 14, 13, 15);
  for (int p = 0; p < (n1 - n0) / NP; ++p) {
    const int t = n0 / kTileRows + p;
    const uint8_t* src = a.w + (size_t)t * tile_bytes + (size_t)k0 / 8 * 64;
    uint8_t* wp = wdst + (size_t)p * kPanelBytes;
    for (int c = 0; c < nchunk; ++c)
      for (int e = 0; e < 4; ++e)
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_shuffle_epi8(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (size_t)(4 * c + e) * 64 + half * 32)), unswap);
          uint8_t* d = wp + (size_t)c * 512 + half * 32;
          _mm256_store_si256(reinterpret_cast<__m256i*>(d + e * 64), _mm256_and_si256(v, mask));
          _mm256_store_si256(reinterpret_cast<__m256i*>(d + (e + 4) * 64),
                             _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
        }
    for (int g = 0; g < gpb; ++g) {
      const size_t off = ((size_t)t * ng + k0 / gs + g) * kTileRows;
      load_scales(a.scales, a.stype, off, NP, sdst + ((size_t)p * (kKc / 32) + g) * NP, 1);
      load_scales(a.biases, a.stype, off, NP, bdst + ((size_t)p * (kKc / 32) + g) * NP, 1);
    }
  }
}

template <bool WIDE>
static void repack(const QmmArgs& a, int n0, int n1, int k0, int kc, uint8_t* wdst, float* sdst, float* bdst) {
  if constexpr (!WIDE) {
    if (a.tiled) return repack_tiled(a, n0, n1, k0, kc, wdst, sdst, bdst);
  }
  const int gs = a.group_size, ng = a.K / gs, gpb = kc / gs, nchunk = kc / 32;
  const size_t row_bytes = (size_t)a.K / 2;
  const int nrows = n1 - n0, npan = (nrows + NP - 1) / NP;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m128i zero16 = _mm_setzero_si128();
  // Per 128-bit lane (4 columns x 4 k): the (k0, k1) bytes of each column, then the (k2, k3) bytes.
  const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13,
                                         2, 3, 6, 7, 10, 11, 14, 15);
  constexpr int wide = WIDE ? 2 : 1;
  for (int j0 = 0; j0 < npan * NP; j0 += 8) {  // 8 columns: one half of a panel
    const int p = j0 / NP, half = (j0 % NP) / 8;
    uint8_t* wp = wdst + (size_t)p * kPanelBytes * wide + half * 32 * wide;
    const uint8_t* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = j0 + j < nrows ? a.w + (n0 + j0 + j) * row_bytes + (size_t)k0 / 2 : nullptr;
    for (int c = 0; c < nchunk; ++c) {
      // Byte i of a 16-byte chunk holds k = 2i (low nibble) and 2i + 1 (high). x is stored in the matching
      // order (XInt8::q), so dword e's low nibbles are quad e and its high nibbles quad 4 + e: transpose the
      // packed dwords of 8 rows (rows j and j + 4 share a ymm), then split the nibbles.
      __m256i y[4];
      for (int j = 0; j < 4; ++j) {
        const __m128i lo = rows[j] ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + c * 16)) : zero16;
        const __m128i hi =
            rows[j + 4] ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j + 4] + c * 16)) : zero16;
        y[j] = _mm256_set_m128i(hi, lo);
      }
      const __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
      const __m256i u[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                            _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
      uint8_t* d = wp + (size_t)c * 512 * wide;
      for (int e = 0; e < 4; ++e) {  // u[e]: dword e of columns 0..7
        const __m256i lo = _mm256_and_si256(u[e], mask), hi = _mm256_and_si256(_mm256_srli_epi16(u[e], 4), mask);
        if constexpr (WIDE) {
          for (int qd = 0; qd < 2; ++qd) {  // quads e and e + 4
            // qwords [lane 0 pairs 0, lane 1 pairs 0, lane 0 pairs 1, lane 1 pairs 1]: (k0, k1) of columns 0..7,
            // then (k2, k3).
            const __m256i t = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(qd ? hi : lo, pairs), 0xD8);
            uint8_t* dq = d + (e + 4 * qd) * 128;
            _mm256_store_si256(reinterpret_cast<__m256i*>(dq), _mm256_cvtepu8_epi16(_mm256_castsi256_si128(t)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(dq + 32),
                               _mm256_cvtepu8_epi16(_mm256_extracti128_si256(t, 1)));
          }
        } else {
          _mm256_store_si256(reinterpret_cast<__m256i*>(d + e * 64), lo);
          _mm256_store_si256(reinterpret_cast<__m256i*>(d + (e + 4) * 64), hi);
        }
      }
    }
  }
  for (int j = 0; j < npan * NP; ++j) {
    float* sp = sdst + (size_t)(j / NP) * (kKc / 32) * NP + (j % NP);
    float* bp = bdst + (size_t)(j / NP) * (kKc / 32) * NP + (j % NP);
    if (j < nrows) {
      load_scales(a.scales, a.stype, (size_t)(n0 + j) * ng + k0 / gs, gpb, sp, NP);
      load_scales(a.biases, a.stype, (size_t)(n0 + j) * ng + k0 / gs, gpb, bp, NP);
    } else {  // padding columns: zero scales
      for (int g = 0; g < gpb; ++g) sp[g * NP] = bp[g * NP] = 0.f;
    }
  }
}

// Cache lines of the weights, scales and biases that repack reads for rows [n0, n1), k-block k0: items
// [i0, i1) of n_lines(kc) per row. Each task's rows are far apart in memory (one k-block of 48 rows = 48 short
// streams), so without this repack waits on every line (measured ~10% of the GEMM).
static inline int lines_per_row(int kc) { return kc / 128 + 1 + 2 * 2; }
static inline void prefetch_block(const QmmArgs& a, int n0, int k0, int kc, int i0, int i1) {
  const int per = lines_per_row(kc), wl = kc / 128 + 1, gs = a.group_size, ng = a.K / gs;
  const size_t row_bytes = (size_t)a.K / 2, esz = a.stype == ScaleType::f32 ? 4 : 2;
  for (int i = i0; i < i1; ++i) {
    const int j = i / per, r = i % per;
    const char* p;
    if (r < wl) {
      p = reinterpret_cast<const char*>(a.w + (size_t)(n0 + j) * row_bytes + (size_t)k0 / 2) + r * 64;
    } else {
      const int s = r - wl;  // 0, 1: scales; 2, 3: biases
      const char* base = static_cast<const char*>(s < 2 ? a.scales : a.biases);
      p = base + ((size_t)(n0 + j) * ng + k0 / gs) * esz + (s & 1) * 64;
    }
    _mm_prefetch(p, _MM_HINT_T1);  // to L2: a block's lines (~27 KB) would evict the panel from L1
  }
}

static inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// s16[m][h] = per column (int16 pairs) sums of one 32-block of x row m times the weights of columns 8h..8h+7.
// Written in asm: GCC issues every broadcast first and then spills an accumulator (measured ~17% of the loop
// stalled on that store-load chain); this keeps the 8 accumulators, 2 weight vectors, 1 broadcast and 1 product
// in 12 registers.
static inline void chunk_dot(const uint8_t* wc, const int8_t* x, size_t stride, __m256i (&s16)[MR][2]) {
  static_assert(MR == 4, "chunk_dot is written for 4 x rows");
  const int8_t* x1 = x + stride;
  const int8_t* x2 = x + 2 * stride;
  const int8_t* x3 = x + 3 * stride;
  __m256i w0, w1, b, t;
#define MLXI8_ROW(xr, a0, a1, q)                \
  "vpbroadcastd " #q "*4(%[" #xr "]), %[b]\n\t"  \
  "vpmaddubsw %[b], %[w0], %[t]\n\t"            \
  "vpaddw %[t], %[" #a0 "], %[" #a0 "]\n\t"     \
  "vpmaddubsw %[b], %[w1], %[t]\n\t"            \
  "vpaddw %[t], %[" #a1 "], %[" #a1 "]\n\t"
#define MLXI8_QUAD(q)                               \
  "vmovdqa " #q "*64(%[w]), %[w0]\n\t"            \
  "vmovdqa " #q "*64+32(%[w]), %[w1]\n\t"         \
  MLXI8_ROW(x0, a00, a01, q) MLXI8_ROW(x1, a10, a11, q) MLXI8_ROW(x2, a20, a21, q) MLXI8_ROW(x3, a30, a31, q)
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
          a31 = a00;
  asm(MLXI8_QUAD(0) MLXI8_QUAD(1) MLXI8_QUAD(2) MLXI8_QUAD(3) MLXI8_QUAD(4) MLXI8_QUAD(5) MLXI8_QUAD(6)
          MLXI8_QUAD(7)
      : [a00] "+x"(a00), [a01] "+x"(a01), [a10] "+x"(a10), [a11] "+x"(a11), [a20] "+x"(a20), [a21] "+x"(a21),
        [a30] "+x"(a30), [a31] "+x"(a31), [w0] "=&x"(w0), [w1] "=&x"(w1), [b] "=&x"(b), [t] "=&x"(t)
      : [w] "r"(wc), [x0] "r"(x), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3)
      : "memory");
#undef MLXI8_QUAD
#undef MLXI8_ROW
  s16[0][0] = a00, s16[0][1] = a01, s16[1][0] = a10, s16[1][1] = a11;
  s16[2][0] = a20, s16[2][1] = a21, s16[3][0] = a30, s16[3][1] = a31;
}

// int16 x (XInt8::q16, the same layout with 2-byte elements): the AVX2 sets' default prefill, at the int16
// decode kernel's accuracy (~1e-5). vpmaddwd does 16 int16 multiply-adds (two per int32 lane) and Zen 3 issues two
// per cycle, as many as 8-wide FMAs, but each needs a vpaddd: twice the int8 kernel's instructions per product.
// Measured at M = 128, one thread, Zen 3: 1.1-1.3x the float32 tiles, ~0.6x int8. The weights come widened from
// repack<true> in (k0, k1) / (k2, k3) pairs per column; x's matching pair is broadcast as a dword, so each lane
// accumulates one column's exact sum: |q x| <= 15 * 32767, so a chunk's sum stays below 2^24 (exact in float32
// too). The 8 accumulators (4 rows x 16 columns), 4 weight vectors, 1 broadcast and 1 product stay in 14 registers
// (asm, for the reason chunk_dot gives).
static inline void chunk_dot16(const uint8_t* wc, const int16_t* x, size_t stride, __m256i (&s32)[MR][2]) {
  static_assert(MR == 4, "chunk_dot16 is written for 4 x rows");
  const int16_t* x1 = x + stride;
  const int16_t* x2 = x + 2 * stride;
  const int16_t* x3 = x + 3 * stride;
  __m256i p0, p1, r0, r1, b, t;
#define MLXI16_ROW(xr, a0, a1, q)               \
  "vpbroadcastd " #q "*8(%[" #xr "]), %[b]\n\t"  \
  "vpmaddwd %[b], %[p0], %[t]\n\t"              \
  "vpaddd %[t], %[" #a0 "], %[" #a0 "]\n\t"     \
  "vpmaddwd %[b], %[p1], %[t]\n\t"              \
  "vpaddd %[t], %[" #a1 "], %[" #a1 "]\n\t"     \
  "vpbroadcastd " #q "*8+4(%[" #xr "]), %[b]\n\t" \
  "vpmaddwd %[b], %[r0], %[t]\n\t"              \
  "vpaddd %[t], %[" #a0 "], %[" #a0 "]\n\t"     \
  "vpmaddwd %[b], %[r1], %[t]\n\t"              \
  "vpaddd %[t], %[" #a1 "], %[" #a1 "]\n\t"
#define MLXI16_QUAD(q)                              \
  "vmovdqa " #q "*128(%[w]), %[p0]\n\t"           \
  "vmovdqa " #q "*128+64(%[w]), %[p1]\n\t"        \
  "vmovdqa " #q "*128+32(%[w]), %[r0]\n\t"        \
  "vmovdqa " #q "*128+96(%[w]), %[r1]\n\t"        \
  MLXI16_ROW(x0, a00, a01, q) MLXI16_ROW(x1, a10, a11, q) MLXI16_ROW(x2, a20, a21, q) MLXI16_ROW(x3, a30, a31, q)
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
          a31 = a00;
  asm(MLXI16_QUAD(0) MLXI16_QUAD(1) MLXI16_QUAD(2) MLXI16_QUAD(3) MLXI16_QUAD(4) MLXI16_QUAD(5) MLXI16_QUAD(6)
          MLXI16_QUAD(7)
      : [a00] "+x"(a00), [a01] "+x"(a01), [a10] "+x"(a10), [a11] "+x"(a11), [a20] "+x"(a20), [a21] "+x"(a21),
        [a30] "+x"(a30), [a31] "+x"(a31), [p0] "=&x"(p0), [p1] "=&x"(p1), [r0] "=&x"(r0), [r1] "=&x"(r1),
        [b] "=&x"(b), [t] "=&x"(t)
      : [w] "r"(wc), [x0] "r"(x), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3)
      : "memory");
#undef MLXI16_QUAD
#undef MLXI16_ROW
  s32[0][0] = a00, s32[0][1] = a01, s32[1][0] = a10, s32[1][1] = a11;
  s32[2][0] = a20, s32[2][1] = a21, s32[3][0] = a30, s32[3][1] = a31;
}

// tile[MR][NP] += x rows [m0, m0 + MR) times one panel over one k-block (from chunk 0 of wp, group 0 of sp/bp).
// xq/xd/xs/xc point at row m0's first k / block / group of this k-block; strides in elements. WIDE: int16 x and
// repack<true>'s weights (chunk_dot16 above), else int8 (chunk_dot); the float steps are the same.
template <int CPG, bool WIDE>
static void micro(const uint8_t* wp, const float* sp, const float* bp, const void* xq, size_t xq_stride,
                  const float* xd, size_t xd_stride, const float* xs, const float* xc, size_t xs_stride, int nchunk,
                  float* tile) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int c = 0; c < nchunk; ++c) {
    __m256i s32[MR][2];  // per column, the chunk's exact integer sum
    if constexpr (WIDE) {
      chunk_dot16(wp + (size_t)c * 1024, static_cast<const int16_t*>(xq) + c * 32, xq_stride, s32);
    } else {
      chunk_dot(wp + (size_t)c * 512, static_cast<const int8_t*>(xq) + c * 32, xq_stride, s32);
      for (int m = 0; m < MR; ++m)
        for (int h = 0; h < 2; ++h) s32[m][h] = _mm256_madd_epi16(s32[m][h], ones);  // int16 pair sums -> int32
    }
    const int g = c / CPG;
    const __m256 sv0 = _mm256_load_ps(sp + g * NP), sv1 = _mm256_load_ps(sp + g * NP + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 dv = _mm256_broadcast_ss(xd + m * xd_stride + c);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[m][0]), _mm256_mul_ps(sv0, dv), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[m][1]), _mm256_mul_ps(sv1, dv), acc[m][1]);
    }
    if (c % CPG == CPG - 1) {  // end of a group: the bias and centring terms
      const __m256 bv0 = _mm256_load_ps(bp + g * NP), bv1 = _mm256_load_ps(bp + g * NP + 8);
      for (int m = 0; m < MR; ++m) {
        const __m256 xsv = _mm256_broadcast_ss(xs + m * xs_stride + g);
        const __m256 xcv = _mm256_broadcast_ss(xc + m * xs_stride + g);
        acc[m][0] = _mm256_fmadd_ps(sv0, xcv, _mm256_fmadd_ps(bv0, xsv, acc[m][0]));
        acc[m][1] = _mm256_fmadd_ps(sv1, xcv, _mm256_fmadd_ps(bv1, xsv, acc[m][1]));
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_store_ps(tile + m * NP, acc[m][0]);
    _mm256_store_ps(tile + m * NP + 8, acc[m][1]);
  }
}

// Which micro-kernel runs the tiles: this file's (int8 or int16 x), or qmm_vnni.cpp's (AVX-512 VNNI: int8 x with the
// same results, or int16 x), called once per micro-tile.
enum class Micro { avx2_i8, avx2_i16, vnni_i8, vnni_i16 };

template <int CPG, Micro MK>
static void qmm_rows(const QmmArgs& a, const XInt8& x, int n0, int n1, void* scratch) {
  const int K = a.K, gs = a.group_size, ng = K / gs, nblk = K / 32;
  const int nrows = n1 - n0, npan = (nrows + NP - 1) / NP;
  uint8_t* wbuf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
  const size_t panel_bytes = (size_t)kPanelBytes * (MK == Micro::avx2_i16 ? 2 : 1);  // repack<true>: int16
  float* sbuf = reinterpret_cast<float*>(wbuf + (size_t)kPanels * panel_bytes);
  float* bbuf = sbuf + (size_t)kPanels * (kKc / 32) * NP;
  alignas(64) float tile[MR * NP];
  const I8MicroFn vnni_micro = MK == Micro::vnni_i8 ? vnni_i8_micro(CPG) : MK == Micro::vnni_i16 ? vnni_i16_micro(CPG)
                                                                                               : nullptr;
  constexpr bool wide = MK == Micro::vnni_i16 || MK == Micro::avx2_i16;
  const I8MicroFn micro_fn = vnni_micro ? vnni_micro : MK == Micro::avx2_i16 ? micro<CPG, true> : micro<CPG, false>;
  const size_t xbytes = wide ? 2 : 1;  // x element size: int16 or int8, same layout
  const uint8_t* xbase = wide ? reinterpret_cast<const uint8_t*>(x.q16) : reinterpret_cast<const uint8_t*>(x.q);
  const int ncalls = x.mpad / MR * npan;
  for (int k0 = 0; k0 < K; k0 += kKc) {
    const int kc = std::min(kKc, K - k0);
    // Row-major weights only: a tiled task's rows are one contiguous stream the hardware prefetcher follows.
    if (k0 == 0 && !a.tiled) prefetch_block(a, n0, 0, kc, 0, nrows * lines_per_row(kc));
    repack<MK == Micro::avx2_i16>(a, n0, n1, k0, kc, wbuf, sbuf, bbuf);
    // The next k-block's lines, spread over this block's micro-kernel calls.
    const int kn = k0 + kKc, kcn = std::min(kKc, K - kn), nlines = kn < K && !a.tiled ? nrows * lines_per_row(kcn) : 0;
    int call = 0;
    for (int m0 = 0; m0 < x.mpad; m0 += MR) {
      const int mcount = std::min(MR, a.M - m0);
      for (int p = 0; p < npan; ++p, ++call) {
        if (nlines) prefetch_block(a, n0, kn, kcn, nlines * call / ncalls, nlines * (call + 1) / ncalls);
        micro_fn(wbuf + (size_t)p * panel_bytes,
                   sbuf + (size_t)p * (kKc / 32) * NP, bbuf + (size_t)p * (kKc / 32) * NP,
                   xbase + ((size_t)m0 * K + k0) * xbytes, K, x.d + (size_t)m0 * nblk + k0 / 32,
                   nblk, x.sum + (size_t)m0 * ng + k0 / gs, x.corr + (size_t)m0 * ng + k0 / gs, ng, kc / 32, tile);
        const int nc = std::min(NP, nrows - p * NP);
        for (int m = 0; m < mcount; ++m) {
          float* o = a.out + (size_t)(m0 + m) * a.N + n0 + p * NP;
          const float* t = tile + m * NP;
          if (nc == NP) {  // the first k-block stores, later ones add (out need not be zeroed)
            const __m256 t0 = _mm256_load_ps(t), t1 = _mm256_load_ps(t + 8);
            _mm256_storeu_ps(o, k0 == 0 ? t0 : _mm256_add_ps(t0, _mm256_loadu_ps(o)));
            _mm256_storeu_ps(o + 8, k0 == 0 ? t1 : _mm256_add_ps(t1, _mm256_loadu_ps(o + 8)));
          } else {
            for (int j = 0; j < nc; ++j) o[j] = k0 == 0 ? t[j] : o[j] + t[j];
          }
        }
      }
    }
  }
}

template <Micro MK>
static void qmm(const QmmArgs& a, const XInt8& x, int n0, int n1, void* scratch) {
  switch (a.group_size) {
    case 32: return qmm_rows<1, MK>(a, x, n0, n1, scratch);
    case 64: return qmm_rows<2, MK>(a, x, n0, n1, scratch);
    default: return qmm_rows<4, MK>(a, x, n0, n1, scratch);
  }
}

static inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// x (M, K) float32 -> XInt8 buffers (rows past M are zero; the caller sizes them for mpad rows).
template <typename Q>
static void prep_x(const float* x, int M, int K, int gs, int mpad, Q* q, float* d, float* sum, float* corr) {
  constexpr bool wide = sizeof(Q) == 2;
  constexpr float qmax = wide ? 32767.f : 127.f;
  const int nblk = K / 32, ng = K / gs, cpg = gs / 32;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                              12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < ng; ++g) {
      float gsum = 0.f, dsum = 0.f;
      for (int cc = 0; cc < cpg; ++cc) {
        const int c = g * cpg + cc;
        const float* xc = x + (size_t)m * K + c * 32;
        Q* qc = q + (size_t)m * K + c * 32;
        __m256 v[4], vmax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(xc + 8 * i);
          vmax = _mm256_max_ps(vmax, _mm256_and_ps(v[i], absmask));
        }
        const float amax = hmax(vmax);
        gsum += hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        float& dc = d[(size_t)m * nblk + c];
        if (!(amax > 0.f) || !std::isfinite(amax)) {  // all zero: nothing to add; inf/nan: let d carry it
          dc = amax > 0.f ? amax : (amax == amax ? 0.f : amax);
          std::memset(qc, 0, 32 * sizeof(Q));
          continue;
        }
        dc = amax / qmax;
        const __m256 inv = _mm256_set1_ps(qmax / amax);
        __m256i qi[4];
        for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest even
        const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        if constexpr (wide) {
          // k order [0, 2, ..., 30, 1, 3, ..., 31], as the 4-bit weights' low then high nibbles.
          alignas(32) int32_t t[32];
          for (int i = 0; i < 4; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(t + 8 * i), qi[i]);
          for (int p = 0; p < 32; ++p) qc[p] = static_cast<Q>(t[perm4(p)]);
        } else {
          const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
          // k order [0, 2, ..., 30, 1, 3, ..., 31], as the 4-bit weights' low then high nibbles.
          const __m256i nat = _mm256_permutevar8x32_epi32(p8, order);
          const __m256i eo = _mm256_shuffle_epi8(nat, evens_odds);  // per lane: even bytes, then odd bytes
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qc), _mm256_permute4x64_epi64(eo, 0xD8));
        }
        dsum += dc * hsum(_mm256_cvtepi32_ps(s4));
      }
      sum[(size_t)m * ng + g] = gsum;
      corr[(size_t)m * ng + g] = 8.f * (gsum - dsum);
    }
  }
  std::memset(q + (size_t)M * K, 0, (size_t)(mpad - M) * K * sizeof(Q));
  std::fill(d + (size_t)M * nblk, d + (size_t)mpad * nblk, 0.f);
  std::fill(sum + (size_t)M * ng, sum + (size_t)mpad * ng, 0.f);
  std::fill(corr + (size_t)M * ng, corr + (size_t)mpad * ng, 0.f);
}

}  // namespace isa_avx2i8gemm

static_assert(2 * kKc * 16 * ((kPackN + 15) / 16) + 2 * (kKc / 32) * 16 * ((kPackN + 15) / 16) * 4 + 64 <=
                  (size_t)kPackN * kKc * 4,
              "the integer prefill's unpacked weights (int16: twice the bytes) fit the float kernels' scratch");

KernelSet with_integer_prefill(KernelSet ks) {
  // Under int8 the name says so below; int16, unset and any unknown value (mlxinfer.native reports it) keep the
  // int16 GEMM as the precise path.
  if (prefill_mode() == PrefillMode::float32) return ks;
  const bool vnni = std::strncmp(ks.isa, "avx512vnni", 10) == 0;  // avx512vnni, avx512vnnii8
  ks.qmm_i8 = vnni ? isa_avx2i8gemm::qmm<isa_avx2i8gemm::Micro::vnni_i8> : isa_avx2i8gemm::qmm<isa_avx2i8gemm::Micro::avx2_i8>;
  ks.prep_x8_gemm = isa_avx2i8gemm::prep_x<int8_t>;
  // The precise default: int16 x, same GEMM.
  ks.qmm_i16 = vnni ? isa_avx2i8gemm::qmm<isa_avx2i8gemm::Micro::vnni_i16>
                   : isa_avx2i8gemm::qmm<isa_avx2i8gemm::Micro::avx2_i16>;
  ks.prep_x16_gemm = isa_avx2i8gemm::prep_x<int16_t>;
  // The name carries the choice: kernel reports and bench provenance must say that prefill rounds x to int8.
  if (int8_prefill_requested()) {
    static const char* const named[][2] = {{"avx512vnni", "avx512vnni+int8-prefill"},
                                           {"avx512vnnii8", "avx512vnnii8+int8-prefill"},
                                           {"avx2i8", "avx2i8+int8-prefill"}};
    const char* name = "avx2+int8-prefill";
    for (const auto& n : named)
      if (std::strcmp(ks.isa, n[0]) == 0) name = n[1];
    ks.isa = name;
  }
  return ks;
}

}  // namespace mlxinfer_cpu
