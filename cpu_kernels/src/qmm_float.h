#pragma once
// Helpers shared between primitives: the float32 quantized-matmul driver (quantized.cpp) for ops that run
// several weights in one job, RMSNorm and RoPE row loops (norm_rope.cpp), the weight check.
#include <vector>

#include "ops.h"
#include "qmm_kernels.h"

namespace mlxinfer_cpu {

struct QWeight {
  const mx::array* w;  // (N, K * bits / 32) uint32, or (E, N, K * bits / 32) with expert >= 0
  const mx::array* scales;
  const mx::array* biases;
  float* out;  // (M, N) float32
  int expert = -1;  // >= 0: w/scales/biases hold one weight per expert (leading dim E); this one multiplies
  bool tiled = false;  // 4-bit weights in row tiles (QmmArgs::tiled); every weight of one call alike
  bool symmetric = false;  // biases == -2^(bits-1) * scales (QmmArgs::symmetric)
};

// out_i = x @ dequant(w_i).T for weights sharing K, group_size and bits (N may differ): x (..., K) is prepared
// once and the row tasks of all weights go to the thread pool as one job.
void qmm_float(const mx::array& x, const std::vector<QWeight>& ws, int group_size, int bits);
// The same for a float32 x (M, K) in memory (the fused block's intermediate rows).
void qmm_float(const float* x, int M, int K, const std::vector<QWeight>& ws, int group_size, int bits);

// RMSNorm of float32 rows (as mx.fast.rms_norm), in norm_rope.cpp; rms_normed returns a new evaluated array
// (for ops that normalise their input first: the x of a fused block step is read once per row anyway).
void rms_norm_rows(const float* x, const float* w, float* y, size_t rows, int D, float eps);
mx::array rms_normed(const mx::array& x, const mx::array& w, float eps);

// RoPE as mx.fast.rope, in norm_rope.cpp: rope_table fills cos/sin (L, half) of theta = (offset + l) * scale * f_i,
// f_i = base^(-i / half), or 1 / periods[i] when periods (half,) is given; rope_row rotates the first dims of one
// row (halves, or interleaved pairs when traditional) with one row of that table and copies the rest.
void rope_table(int L, int half, float base, float scale, int offset, const float* periods, std::vector<float>& cs,
                std::vector<float>& sn);
void rope_row(const float* x, float* y, int D, int dims, bool traditional, const float* c, const float* s);

// Attention as the sdpa op runs it (attention.cpp): the task plan (query blocks, split-K for decode) on the pool.
void sdpa_exec(const SdpaArgs& a);

struct RopeSpec {
  int dims;  // rotated leading dims of each head (<= head_dim, even); 0 = no RoPE
  bool traditional;
  float base, scale;
};

// flat (B*L, H*D) row-major -> out (B, H, cap, D) at positions pos0 + l (cap = L, pos0 = 0: a plain (B, H, L, D)
// tensor; else a KV-cache buffer), rotating the first `dims` of each head at position offset + l as mx.fast.rope
// does (base, or Llama-3 style periods); with row_offsets (B,), batch row b at row_offsets[b] + l instead. In
// norm_rope.cpp.
void scatter_heads(const float* flat, float* out, int B, int L, int H, int D, const RopeSpec& rope, int offset,
                   const float* periods, int cap, int pos0, const int* row_offsets = nullptr);

// An integer array (any int dtype, row-contiguous) as ints: per-row positions/offsets inputs. In norm_rope.cpp.
std::vector<int> row_ints(const mx::array& a);

// n elements float32 <-> float16 (or a plain copy for equal dtypes), in kv_append.cpp.
void convert_floats(const void* src, mx::Dtype src_type, void* dst, mx::Dtype dst_type, size_t n);

// Checks one (w, scales, biases) against x for an op named `op` (throws std::invalid_argument); returns N.
int check_quantized_weight(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, const char* op);
// The same for an x whose last dim is x_k; with experts, w/scales/biases are stacks (E, N, ...) of such weights.
int check_quantized_weight(int x_k, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, const char* op, bool experts = false);

}  // namespace mlxinfer_cpu
