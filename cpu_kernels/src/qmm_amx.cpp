// Prefill on Intel AMX (this file alone is compiled with -mamx-tile -mamx-bf16 and AVX-512): the quantized matmul
// for M > 8 rows when the CPU has AMX-BF16 and the kernel lets the process use it (arch_prctl).
//
// Why: one TDPBF16PS multiplies a 16 x 32 by a 32 x 16 bf16 tile (8192 multiply-adds) in ~14 cycles, ~10x what
// the int16 VNNI GEMM sustains per core. Its inputs are bf16 (8 significant bits), so neither side is rounded
// to fit it:
// - weights: q - off (off = 8 for 4-bit, 128 for 8-bit) is an integer of at most 8 bits, exact in bf16; the
//   scale s and the bias are applied in float32 once per group, as the other kernels do;
// - x: split as x = hi + lo, hi = bf16(x), lo = bf16(x - hi), which keeps ~16 significant bits (|x - hi - lo|
//   <= 2^-17 |x|); two tile products per chunk, hi and lo, accumulate into the same float32 tile.
//   out[n, m] = sum_g s[n, g] * C[n, m, g] + (b[n, g] + off * s[n, g]) * xsum[m, g]
//   C[n, m, g] = sum_{k in g} (q[n, k] - off) * (hi[m, k] + lo[m, k])   (products exact, sums in float32)
// Results are within float32 rounding of the exact product (~1e-6 of the output's scale): more precise than the
// int16 GEMM (~2e-5) it replaces, which was the price of integer arithmetic.
//
// Tiles (all 16 rows x 64 bytes): the weights are the left operand, A[n][k] = bf16(q[n][k] - off) for 16 output
// columns n and one 32-element chunk k (a weight row's chunk expands in place, no transpose); x is the right
// operand in AMX's pair layout, B[r][2m + e] = x[m][2r + e] for 16 x rows m. So C is (columns n, x rows m); each
// group's C is scaled into 16 accumulators (one per n, 16 rows m each), transposed once at the end.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qmm_kernels.h"

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
namespace mlxinfer_cpu {
namespace isa_amx {

constexpr int T = 16;      // tile rows: output columns per A tile, x rows per B tile
constexpr int kTile = 512;  // bf16 elements per tile (16 x 32)

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1: C (two, so one group's scaling overlaps the next group's products); 2-4 and 5-7: A, B hi, B lo of
// even and odd chunks.
static void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = T;
  }
  _tile_loadconfig(&cfg);
}

// 16 x 16 float32 (or int32) transpose in registers: r[i] lane j -> r[j] lane i.
static inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    for (int j = 0; j < 2; ++j) {
      const __m512d a = _mm512_castps_pd(t[i + j]), b = _mm512_castps_pd(t[i + j + 2]);
      r[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  // r[4G + e], 128-bit lane L: element 4L + e of rows 4G..4G+3; a 4 x 4 transpose of 128-bit lanes remains.
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      t[i + 4 * j] = _mm512_shuffle_f32x4(r[i], r[i + 4], j == 0 ? 0x88 : 0xDD);
      t[i + 4 * j + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], j == 0 ? 0x88 : 0xDD);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// 32 floats -> (hi, lo) bf16 vectors of 32, in k order.
static inline void split_bf16(__m512 x0, __m512 x1, __m512i& hi, __m512i& lo) {
  const __m512bh h = _mm512_cvtne2ps_pbh(x1, x0);
  const __m512i hb = (__m512i)h;
  // hi back to float32: the bf16 bits are the upper half of a float's.
  const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hb)), 16));
  const __m512 h1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hb, 1)), 16));
  hi = hb;
  lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0));
}

// x (M, K) float32 -> B tiles xb[mb][chunk][hi, lo][kTile] and xsum[mb][group][16] of m-blocks [mb0, mb1); rows
// past M are zero.
static void prep_x(const float* x, int M, int K, int gs, uint16_t* xb, float* xsum, int mb0, int mb1) {
  const int nchunk = K / 32, ng = K / gs;
  for (int mb = mb0; mb < mb1; ++mb) {
    const int rows = std::min(T, M - mb * T);
    for (int c = 0; c < nchunk; ++c) {
      __m512 hi[16], lo[16];  // row m: 16 dwords, dword r = the bf16 pair (k = 2r, 2r + 1)
      for (int m = 0; m < T; ++m) {
        if (m < rows) {
          const float* xr = x + (size_t)(mb * T + m) * K + c * 32;
          __m512i h, l;
          split_bf16(_mm512_loadu_ps(xr), _mm512_loadu_ps(xr + 16), h, l);
          hi[m] = _mm512_castsi512_ps(h);
          lo[m] = _mm512_castsi512_ps(l);
        } else {
          hi[m] = lo[m] = _mm512_setzero_ps();
        }
      }
      transpose16(hi);  // row r: pair r of the 16 x rows
      transpose16(lo);
      uint16_t* dst = xb + ((size_t)mb * nchunk + c) * 2 * kTile;
      for (int r = 0; r < T; ++r) {
        _mm512_storeu_ps(reinterpret_cast<float*>(dst) + r * 16, hi[r]);
        _mm512_storeu_ps(reinterpret_cast<float*>(dst + kTile) + r * 16, lo[r]);
      }
    }
    for (int g = 0; g < ng; ++g) {
      float* s = xsum + ((size_t)mb * ng + g) * T;
      for (int m = 0; m < T; ++m) {
        if (m >= rows) {
          s[m] = 0.f;
          continue;
        }
        const float* xr = x + (size_t)(mb * T + m) * K + g * gs;
        __m512 v = _mm512_loadu_ps(xr);
        for (int i = 16; i < gs; i += 16) v = _mm512_add_ps(v, _mm512_loadu_ps(xr + i));
        s[m] = _mm512_reduce_add_ps(v);
      }
    }
  }
}

static inline float scale_at(const void* base, ScaleType t, size_t i) {
  if (t == ScaleType::f32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  if (t == ScaleType::f16) return _cvtsh_ss(h);
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The A tiles of output columns [n0, n0 + 16) over all chunks: wa[chunk][n][32] bf16 (q - off; rows past N zero),
// and their scales sc[g][n] and centred biases bc[g][n] = b + off * s.
template <int BITS>
static void expand_weights(const QmmArgs& a, int n0, int cols, uint16_t* wa, float* sc, float* bc) {
  const int K = a.K, nchunk = K / 32, ng = K / a.group_size;
  const size_t row_bytes = (size_t)K * BITS / 8;
  constexpr float off = BITS == 4 ? 8.f : 128.f;
  // bf16 of v - 8 for v = 0..15, indexed by the nibble in each 16-bit lane.
  alignas(64) static const uint16_t lut4[32] = {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                                0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                                0,      0,      0,      0,      0,      0,      0,      0,
                                                0,      0,      0,      0,      0,      0,      0,      0};
  const __m512i lut = _mm512_load_si512(lut4);
  for (int n = 0; n < T; ++n) {
    uint16_t* dst = wa + (size_t)n * 32;
    if (n >= cols) {
      for (int c = 0; c < nchunk; ++c) std::memset(dst + (size_t)c * kTile, 0, 64);
      for (int g = 0; g < ng; ++g) sc[g * T + n] = bc[g * T + n] = 0.f;
      continue;
    }
    const uint8_t* wr = a.w + (size_t)(n0 + n) * row_bytes;
    for (int c = 0; c < nchunk; ++c) {
      __m512i v;
      if constexpr (BITS == 4) {
        // byte j holds k = 2j (low nibble) and 2j + 1 (high): dword j = (low, high) as two 16-bit lanes.
        const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + c * 16)));
        const __m512i idx = _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0x0F)),
                                            _mm512_and_si512(_mm512_slli_epi32(d, 12), _mm512_set1_epi32(0xF0000)));
        v = _mm512_permutexvar_epi16(idx, lut);
      } else {
        const __m128i* p = reinterpret_cast<const __m128i*>(wr + c * 32);
        const __m512i bias = _mm512_set1_epi32(128);
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(p)), bias));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(p + 1)), bias));
        v = (__m512i)_mm512_cvtne2ps_pbh(f1, f0);  // integers of <= 8 bits: exact
      }
      _mm512_storeu_si512(dst + (size_t)c * kTile, v);
    }
    for (int g = 0; g < ng; ++g) {
      const size_t i = (size_t)(n0 + n) * ng + g;
      const float s = scale_at(a.scales, a.stype, i);
      sc[g * T + n] = s;
      bc[g * T + n] = scale_at(a.biases, a.stype, i) + off * s;
    }
  }
}

// acc[n] (16 x rows) += s[n] * C[n] + b[n] * xsum: one group's products into the accumulators.
static inline void scale_group(const float* cbuf, const float* sc, const float* bc, const float* xs, __m512 (&acc)[16]) {
  const __m512 xv = _mm512_loadu_ps(xs);
  for (int n = 0; n < T; ++n) {
    acc[n] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + n * T), _mm512_set1_ps(sc[n]), acc[n]);
    acc[n] = _mm512_fmadd_ps(xv, _mm512_set1_ps(bc[n]), acc[n]);
  }
}

// Chunks per k-block: one m-block's x tiles (2 KB a chunk) and the task's weight tiles (1 KB a chunk per 16
// columns) for one k-block are reused from cache by every (m-block, n-tile) pair (Dec 6, one thread: whole-K
// passes 132 GMAC/s, blocks of 2 / 4 / 8 / 16 / 64 chunks 24 / 23 / 22 / 23 / 33 ns per tile product at
// 128 x 576 x 1536).
constexpr int kChunksPerBlock = 8;

// C tile CT += the weight tile of chunk c times x's hi and lo tiles, loaded into tiles A, BH, BL. A macro: GCC's
// tile intrinsics take the register number as a literal.
#define MLXINFER_CHUNK_PRODUCTS(CT, A, BH, BL)                \
  do {                                                        \
    _tile_loadd(A, wa + (size_t)c * kTile, 64);               \
    _tile_loadd(BH, xb + (size_t)c * 2 * kTile, 64);          \
    _tile_loadd(BL, xb + (size_t)c * 2 * kTile + kTile, 64);  \
    _tile_dpbf16ps(CT, A, BH);                                \
    _tile_dpbf16ps(CT, A, BL);                                \
  } while (0)

// One k-block [c0, c1) of one (m-block, n-tile) pair: acc (16 x 16 float32, row n = 16 x rows) += its groups.
template <int CPG>
static void gemm_block(const uint16_t* wa, const uint16_t* xb, const float* sc, const float* bc, const float* xs,
                       int c0, int c1, float* acc_mem) {
  alignas(64) float cbuf[2][T * T];
  __m512 acc[16];
  for (int n = 0; n < T; ++n) acc[n] = _mm512_load_ps(acc_mem + n * T);
  // Group g's products go to tile g % 2; its scaling runs while the next group's products are computed.
  const int g0 = c0 / CPG, g1 = c1 / CPG;
  for (int g = g0; g < g1; ++g) {
    const bool odd = g & 1;
    if (odd) {
      _tile_zero(1);
    } else {
      _tile_zero(0);
    }
    for (int cc = 0; cc < CPG; ++cc) {
      const int c = g * CPG + cc;
      // Odd chunks load into their own tiles: a tile being read by the products is not reloaded before they end.
      if (odd) {
        if (c & 1) {
          MLXINFER_CHUNK_PRODUCTS(1, 5, 6, 7);
        } else {
          MLXINFER_CHUNK_PRODUCTS(1, 2, 3, 4);
        }
      } else if (c & 1) {
        MLXINFER_CHUNK_PRODUCTS(0, 5, 6, 7);
      } else {
        MLXINFER_CHUNK_PRODUCTS(0, 2, 3, 4);
      }
    }
    if (g > g0) scale_group(cbuf[!odd], sc + (g - 1) * T, bc + (g - 1) * T, xs + (g - 1) * T, acc);
    if (odd) {
      _tile_stored(1, cbuf[1], 64);
    } else {
      _tile_stored(0, cbuf[0], 64);
    }
  }
  scale_group(cbuf[(g1 - 1) & 1], sc + (g1 - 1) * T, bc + (g1 - 1) * T, xs + (g1 - 1) * T, acc);
  for (int n = 0; n < T; ++n) _mm512_store_ps(acc_mem + n * T, acc[n]);
}

template <int BITS, int CPG>
static void gemm_cols(const QmmArgs& a, const XBf16& x, int n0, int n1) {
  const int nchunk = a.K / 32, ng = a.K / a.group_size, mblocks = (x.M + T - 1) / T;
  const int ntiles = (n1 - n0 + T - 1) / T;
  thread_local std::vector<uint16_t> wbuf;
  thread_local std::vector<float> sbuf, abuf;
  const size_t wtile = (size_t)nchunk * kTile;  // one n-tile's expanded weights
  wbuf.resize(ntiles * wtile + 32);
  sbuf.resize((size_t)2 * ng * T * ntiles);
  abuf.resize((size_t)mblocks * ntiles * T * T + 16);
  uint16_t* wa = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(wbuf.data()) + 63) & ~uintptr_t(63));
  float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(abuf.data()) + 63) & ~uintptr_t(63));
  std::memset(acc, 0, (size_t)mblocks * ntiles * T * T * sizeof(float));
  for (int j = 0; j < ntiles; ++j) {
    float* sc = sbuf.data() + (size_t)2 * ng * T * j;
    expand_weights<BITS>(a, n0 + j * T, std::min(T, n1 - n0 - j * T), wa + j * wtile, sc, sc + (size_t)ng * T);
  }
  configure_tiles();
  const int cpb = std::max(CPG, kChunksPerBlock / CPG * CPG);
  for (int c0 = 0; c0 < nchunk; c0 += cpb) {
    const int c1 = std::min(nchunk, c0 + cpb);
    for (int mb = 0; mb < mblocks; ++mb) {
      const uint16_t* xb = x.tiles + (size_t)mb * nchunk * 2 * kTile;
      const float* xs = x.xsum + (size_t)mb * ng * T;
      for (int j = 0; j < ntiles; ++j) {
        const float* sc = sbuf.data() + (size_t)2 * ng * T * j;
        gemm_block<CPG>(wa + j * wtile, xb, sc, sc + (size_t)ng * T, xs, c0, c1, acc + ((size_t)mb * ntiles + j) * T * T);
      }
    }
  }
  _tile_release();
  for (int mb = 0; mb < mblocks; ++mb) {
    const int rows = std::min(T, x.M - mb * T);
    for (int j = 0; j < ntiles; ++j) {
      const float* am = acc + ((size_t)mb * ntiles + j) * T * T;
      __m512 r[16];
      for (int n = 0; n < T; ++n) r[n] = _mm512_load_ps(am + n * T);
      transpose16(r);  // r[m]: 16 output columns of x row m
      const int cols = std::min(T, n1 - n0 - j * T);
      const __mmask16 k = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
      for (int m = 0; m < rows; ++m) _mm512_mask_storeu_ps(a.out + (size_t)(mb * T + m) * a.N + n0 + j * T, k, r[m]);
    }
  }
}

template <int BITS>
static void gemm_bits(const QmmArgs& a, const XBf16& x, int n0, int n1) {
  switch (a.group_size) {
    case 32: return gemm_cols<BITS, 1>(a, x, n0, n1);
    case 64: return gemm_cols<BITS, 2>(a, x, n0, n1);
    default: return gemm_cols<BITS, 4>(a, x, n0, n1);
  }
}

static void gemm(const QmmArgs& a, const XBf16& x, int n0, int n1) {
  if (a.bits == 4) {
    gemm_bits<4>(a, x, n0, n1);
  } else {
    gemm_bits<8>(a, x, n0, n1);
  }
}

}  // namespace isa_amx

bool amx_bf16_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw"))
      return false;
    // Linux hands out the 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18);
    // without it the first tile instruction faults.
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return usable;
}

KernelSet with_amx_prefill(KernelSet ks) {
  ks.qmm_bf16 = isa_amx::gemm;
  ks.prep_x_bf16 = isa_amx::prep_x;
  return ks;
}

}  // namespace mlxinfer_cpu
#else
namespace mlxinfer_cpu {
bool amx_bf16_usable() { return false; }  // built without AMX support in the compiler
KernelSet with_amx_prefill(KernelSet ks) { return ks; }
}  // namespace mlxinfer_cpu
#endif
