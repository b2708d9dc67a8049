// Quantized matmul kernels in MLX's affine format: w (N, K*bits/32) uint32 with element k of a row
// at bits [bits*(k%e), ...) of word k/e (e = 32/bits), scales/biases (N, K/group).
// out[m, n] = sum_k x[m, k] * (q[n, k] * scale[n, k/g] + bias[n, k/g]).
//
// Every ISA variant lives in its own translation unit compiled with its own -m flags; this header
// holds only plain structs and declarations so that no inline code is shared across them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlxinfer_cpu {

enum class ScaleType : int { f32 = 0, f16 = 1, bf16 = 2 };

struct QmmArgs {
  int M, K, N;
  int group_size;  // 32, 64 or 128
  int bits;        // 4 or 8
  const uint8_t* w;
  const void* scales;
  const void* biases;
  ScaleType stype;
  // Decode path: x as float32 (M, K). For 4-bit each 32-wide chunk is permuted as
  // [x0, x2, ..., x30, x1, x3, ..., x31] to match how low/high nibbles unpack.
  const float* x;
  const float* xsum;  // (M, K/group): sum of x over each group, for the bias term
  float* out;         // (M, N) float32
  // Decode path of KernelSet::int16_x kernels instead of x/xsum: x rounded to int16 per weight group,
  // (M, kpad) with kpad = K rounded up to 64 and for 4-bit each 64-block ordered [x0, x2, ..., x62, x1, ..., x63];
  // xd (M, gpad): the group scales d (x ~= d * xq); xcorr (M, gpad): off * (xsum - d * sum of xq over the
  // group), off = 8 (4-bit) or 128 (8-bit), the term that lets the kernel centre q for free;
  // xsum then has stride gpad. Padding is zero.
  const int16_t* xq;
  const float* xd;
  const float* xcorr;
  int kpad, gpad;
  // KernelSet::int8_x kernels: x rounded to int8 per weight group, (M, kpad) in the set's order (avx2i8: the 4-bit
  // xq order above; avx512vnnii8: qmm_vnni_i8.cpp), with xd/xcorr/xsum as above.
  const int8_t* xb = nullptr;
  // Weights in row tiles (qmm_vnni_tiled.cpp has the layout): decode runs KernelSet::qmv_tiled, 4-bit prefill the
  // integer GEMM's tiled repack (qmm_avx2i8gemm.cpp); N and every task's rows are multiples of kTileRows.
  bool tiled = false;
  // The caller's promise that biases == -2^(bits-1) * scales exactly (Q4_0 / Q8_0 imports): the tiled decode
  // matvecs then fold the bias into x's correction term and never read the biases (1/9 less traffic at group 32).
  bool symmetric = false;
};

constexpr int kTileRows = 16;

// Decode (M <= 8): rows [n0, n1) of the output for all M.
using QmvFn = void (*)(const QmmArgs&, int n0, int n1);

// Prefill (M > 8), output rows [n0, n1) with n1 - n0 <= kPackN. xpack: x transposed into m-blocks
// of KernelSet::pack_m columns, k permuted as above for 4-bit, zero-padded: xpack[mb][k][pack_m].
// scratch: kPackN * kKc floats. The caller zeroes out first (k-blocks accumulate into it).
constexpr int kPackN = 48;
constexpr int kKc = 512;
using QmmFn = void (*)(const QmmArgs&, const float* xpack, int n0, int n1, float* scratch);

// Prefill of KernelSet::qmm_i8 (4-bit weights): x (mpad, K) rounded to int8 per 32-element block, x ~= d * q,
// each block's k ordered [0, 2, ..., 30, 1, 3, ..., 31] (the weights' low, then high nibbles);
// d (mpad, K / 32); sum/corr (mpad, K / group): x's sum per group and the centring term (qmm_avx2i8gemm.cpp).
// Rows past M are zero; mpad = M rounded up to kI8RowBlock. scratch as for QmmFn; out need not be zeroed.
// KernelSet::qmm_i16 reads the same layout with x rounded to int16 (q16, d = max|x| / 32767; q unused): the
// precise integer prefill (~1e-5 of an output's scale, as the int16 decode), where int8 costs ~0.5%.
constexpr int kI8RowBlock = 4;
// Position p of a 32-chunk as unpacked from 4-bit words holds element perm4(p) of the chunk (the k order above).
constexpr int perm4(int p) { return p < 16 ? 2 * p : 2 * (p - 16) + 1; }
struct XInt8 {
  const int8_t* q;
  const float *d, *sum, *corr;
  int mpad;
  const int16_t* q16 = nullptr;
};
using QmmI8Fn = void (*)(const QmmArgs&, const XInt8& x, int n0, int n1, void* scratch);

// Prefill on AMX-BF16 tiles (qmm_amx.cpp): x split into bf16 hi + lo pairs, laid out as AMX's right operand.
// tiles: [mblock of 16 rows][chunk of 32 k][hi, lo][16 pair rows r][16 x rows m][2], element (r, m, e) =
// x[16 mb + m][32 c + 2 r + e]; xsum: [mblock][group][16] float32. Rows past M are zero.
struct XBf16 {
  int M;
  const uint16_t* tiles;
  const float* xsum;
};
using QmmBf16Fn = void (*)(const QmmArgs&, const XBf16& x, int n0, int n1);
constexpr int kBf16RowBlock = 16;

struct KernelSet {
  const char* isa;
  int pack_m;
  QmvFn qmv;
  QmmFn qmm;
  bool int16_x = false;  // qmv reads QmmArgs::xq/xd (int16 x) instead of the float32 x
  // out[i] = silu(g[i]) * u[i] (SwiGLU's gate), vectorised for this ISA.
  void (*silu_mul)(const float* g, const float* u, float* out, size_t n) = nullptr;
  // For int16_x sets: fills xq/xd/xcorr/xsum (layouts in QmmArgs) for x (M, K) float32; buffers are sized by
  // the caller (kpad, gpad) and zeroed.
  void (*prep_x16)(const float* x, int M, int K, int group_size, int bits, int kpad, int gpad, int16_t* xq,
                   float* xd, float* xcorr, float* xsum) = nullptr;
  // Sets whose qmv reads int8 x (QmmArgs::xb) for 4-bit weights, and with int8_x8 for 8-bit ones too (else those
  // get prep_x16's int16 x). prep_x8 prepares x for weights of `bits` (the layout and centring term differ).
  bool int8_x = false;
  bool int8_x8 = false;
  void (*prep_x8)(const float* x, int M, int K, int group_size, int bits, int kpad, int gpad, int8_t* xb, float* xd,
                  float* xcorr, float* xsum) = nullptr;
  int int8_kpad = 64;  // xb rows are padded to a multiple of this (the set's int8 layout: 64 or 128 per block)
  // Decode on tiled weights (QmmArgs::tiled) when set: int16 x from prep_x16, or int8 x from prep_x8_tiled.
  QmvFn qmv_tiled = nullptr;
  void (*prep_x8_tiled)(const float* x, int M, int K, int group_size, int bits, int kpad, int gpad, int8_t* xb,
                        float* xd, float* xcorr, float* xsum) = nullptr;
  // Int8 prefill (M > 8, 4-bit weights) when set, and its x preparation into XInt8's buffers.
  QmmI8Fn qmm_i8 = nullptr;
  void (*prep_x8_gemm)(const float* x, int M, int K, int group_size, int mpad, int8_t* q, float* d, float* sum,
                  float* corr) = nullptr;
  // Int16 prefill (the same GEMM with x rounded to int16: XInt8::q16) when set, and its x preparation.
  QmmI8Fn qmm_i16 = nullptr;
  void (*prep_x16_gemm)(const float* x, int M, int K, int group_size, int mpad, int16_t* q, float* d, float* sum,
                        float* corr) = nullptr;
  // AMX-BF16 prefill (4- and 8-bit weights) when set: the precise default where the CPU has it. prep_x_bf16 fills
  // XBf16's buffers for row blocks [mb0, mb1) of kBf16RowBlock rows (sized by the caller for all of them).
  QmmBf16Fn qmm_bf16 = nullptr;
  void (*prep_x_bf16)(const float* x, int M, int K, int group_size, uint16_t* tiles, float* xsum, int mb0,
                      int mb1) = nullptr;
};

KernelSet generic_kernels();
#if defined(__x86_64__) || defined(_M_X64)
KernelSet avx2_kernels();     // isa "avx2": float32 decode (MLXINFER_ISA=avx2float picks it)
KernelSet avx2int_kernels();  // isa "avx2": int16 x decode (qmm_avx2int.cpp), float32 prefill
KernelSet avx2i8_kernels();   // isa "avx2i8": int8 x decode for 4-bit weights (qmm_avx2i8.cpp), else avx2's
KernelSet avx512_kernels();
KernelSet avx512vnni_kernels();
KernelSet avx512vnnii8_kernels();  // isa "avx512vnnii8": int8 x decode, 4/8-bit (qmm_vnni_i8.cpp), else avx512vnni's
// + the integer prefill GEMMs: int8 on the AVX2 integer and VNNI sets (used when MLXINFER_PREFILL=int8 or
// set_int8_prefill(true); the name then ends in "+int8-prefill"), int16 on the same sets (the default there).
// MLXINFER_PREFILL=float: neither (float32 tiles).
KernelSet with_integer_prefill(KernelSet ks);
// ks with the tiled-weight decode matvecs (qmm_vnni_tiled.cpp; the VNNI sets).
KernelSet with_tiled_decode(KernelSet ks);
// Whether weights may be tiled for select_kernels(): it has qmv_tiled and 4-bit prefill is the integer GEMM (the
// only prefill that reads tiles). In quantized.cpp.
bool tiled_weights_supported();
// The process' prefill setting, read once from MLXINFER_PREFILL (quantized.cpp): int8, int16, float, or the
// default (unset or any other value; mlxinfer.native names an unknown one).
enum class PrefillMode { dflt, int8, int16, float32 };
PrefillMode prefill_mode();
// prefill_mode() == int8 (quantized.cpp's int8 switch starts there).
bool int8_prefill_requested();
// MLXINFER_DECODE=int8 (quantized.cpp): select_kernels() then picks the CPU's int8 decode set (avx512vnnii8 on
// AVX-512 VNNI, else avx2i8) unless MLXINFER_ISA forces one; any other value keeps the precise default.
bool int8_decode_requested();
// The integer prefill's micro-kernels on AVX-512 VNNI (qmm_vnni_gemm.cpp): tile[kI8RowBlock][16] = 4 x rows times one
// 16-column panel over one k-block, the layouts and arithmetic of qmm_avx2i8gemm.cpp's micro (which documents them).
// int8 x: one vpdpbusd per 4 k of 16 columns; its integer sums and float steps are the AVX2 kernel's, so are its
// results. int16 x (xq points at int16 elements): vpmovzxbw'd weights, vpdpwssd.
using I8MicroFn = void (*)(const uint8_t* wp, const float* sp, const float* bp, const void* xq, size_t xq_stride,
                           const float* xd, size_t xd_stride, const float* xs, const float* xc, size_t xs_stride,
                           int nchunk, float* tile);
I8MicroFn vnni_i8_micro(int chunks_per_group);   // 1, 2 or 4 (groups of 32, 64, 128)
I8MicroFn vnni_i16_micro(int chunks_per_group);  // the same for int16 x
// Whether this CPU has AMX-BF16 and Linux granted this process the tile state (asked once); qmm_amx.cpp.
bool amx_bf16_usable();
// ks with the AMX-BF16 prefill (qmm_bf16, prep_x_bf16); only where amx_bf16_usable().
KernelSet with_amx_prefill(KernelSet ks);
#elif defined(__aarch64__)
KernelSet neon_kernels();
#endif

// Best set for this CPU (runtime dispatch), or the one forced by
// MLXINFER_ISA=generic|avx2float|avx2|avx2i8|avx512|avx512vnni|avx512vnnii8|avx512amx
// (x86) or generic|neon (arm64).
const KernelSet& select_kernels();

// On (default): the decode matvecs of an int8_x set round x to int8 (avx2i8: 4-bit weights; avx512vnnii8: 4- and
// 8-bit); off: to int16 as their base sets (avx2, avx512vnni) do.
// Returns the previous setting. In quantized.cpp.
bool set_int8_decode(bool on);
// On (default): prefill of a set with qmm_i8 (4-bit weights) rounds x to int8 per 32-block; off: float32 tiles.
// Returns the previous setting. In quantized.cpp.
bool set_int8_prefill(bool on);

}  // namespace mlxinfer_cpu

namespace mlxinfer_cpu {

// Attention over float32 q (B, Hq, L, D), k/v (B, Hkv, S, D) float32 or float16 (kv_half), any strides but a unit
// last one. Query head h reads kv head h / (Hq / Hkv). causal: query i sees keys j <= i + S - L.
struct SdpaArgs {
  int B, Hq, Hkv, L, S, D;
  float scale;
  bool causal;
  const float* q;
  const void *k, *v;  // float or uint16_t (IEEE half) elements
  bool kv_half;
  int64_t qs[3], ks[3], vs[3];  // element strides of dims 0..2
  float* out;                    // (B, Hq, L, D) contiguous, or (B, L, Hq, D) when heads_last
  bool heads_last;               // output rows in (B, L, Hq, D) order: the o_proj input needs no transpose
  const int* start = nullptr;    // (B,): batch row b sees no key before start[b] (left padding); null: 0
  int window = 0;                // > 0: query i sees only its last `window` keys, j > i + S - L - window

  // Element offset of output row (b, h, i).
  int64_t out_row(int b, int h, int i) const {
    return (heads_last ? ((int64_t)b * L + i) * Hq + h : ((int64_t)b * Hq + h) * L + i) * D;
  }
};

// One task of the plan that run_sdpa (attention.cpp) chose: `plan` packs the query positions per unit and the
// number of key ranges (split-K); attn_impl.inc documents how a task index maps to (b, kv head, rows, keys).
using SdpaFn = void (*)(const SdpaArgs&, int task, int plan);

SdpaFn generic_sdpa();
#if defined(__x86_64__) || defined(_M_X64)
SdpaFn avx2_sdpa();
SdpaFn avx512_sdpa();
#elif defined(__aarch64__)
SdpaFn neon_sdpa();
#endif
SdpaFn select_sdpa();

}  // namespace mlxinfer_cpu
