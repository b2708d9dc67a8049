#pragma once
// The float32 quantized-matmul driver (quantized.cpp) for primitives that run several weights in one job.
#include <vector>

#include "ops.h"

namespace mlxinfer_cpu {

struct QWeight {
  const mx::array* w;  // (N, K * bits / 32) uint32
  const mx::array* scales;
  const mx::array* biases;
  float* out;  // (M, N) float32
};

// out_i = x @ dequant(w_i).T for weights sharing K, group_size and bits (N may differ): x (..., K) is prepared
// once and the row tasks of all weights go to the thread pool as one job.
void qmm_float(const mx::array& x, const std::vector<QWeight>& ws, int group_size, int bits);

// RMSNorm of float32 rows (as mx.fast.rms_norm), in norm_rope.cpp; rms_normed returns a new evaluated array
// (for ops that normalise their input first: the x of a fused block step is read once per row anyway).
void rms_norm_rows(const float* x, const float* w, float* y, size_t rows, int D, float eps);
mx::array rms_normed(const mx::array& x, const mx::array& w, float eps);

// Checks one (w, scales, biases) against x for an op named `op` (throws std::invalid_argument); returns N.
int check_quantized_weight(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, const char* op);

}  // namespace mlxinfer_cpu
