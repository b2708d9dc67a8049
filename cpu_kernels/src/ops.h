#pragma once

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mx = mlx::core;

namespace mlxinfer_cpu {

// Same result as mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)
// (affine mode): x (..., K) times the quantized (N, K) weight -> (..., N). Runs on the CPU stream.
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits);

}  // namespace mlxinfer_cpu
