// emu_cuda_prelude.h — test infrastructure: stands in for MLX's CUDA default header (utils.cuh,
// cooperative_groups.h) so that the CUDA-route source (compat_cuda.h + the same kernel bodies, wrapped the way
// mlx/backend/cuda/custom_kernel.cpp wraps them) compiles with g++ and runs on compat_emu.h's fibers.
// It checks compat_cuda.h's mapping (warp shuffles for simd_*, threadIdx/blockIdx for Metal's attributes,
// __shared__ for threadgroup memory) and the header/namespace layout; not NVRTC itself, nor CUDA's memory model.
#ifndef MLXK_EMU_CUDA_PRELUDE_H
#define MLXK_EMU_CUDA_PRELUDE_H
#define MLXK_EMU_CUDA 1
#include "compat_emu.h"

#include <array>

#define __CUDACC__ 1
#define __device__
#define __global__
#define __grid_constant__
#define __shared__ static  // threadgroups run one at a time, as in compat_emu.h

typedef _Float16 __half;
typedef bfloat16_t __nv_bfloat16;

inline uint3 make_uint3(uint32_t x, uint32_t y, uint32_t z) { return {x, y, z}; }
namespace mlxemu {
inline const Attrs& cur() { return G->attrs[G->current]; }
}
#define threadIdx (mlxemu::cur().thread_position_in_threadgroup)
#define blockIdx (mlxemu::cur().threadgroup_position_in_grid)
#define blockDim (mlxemu::cur().threads_per_threadgroup)

inline void __syncthreads() { mlxemu::barrier(); }
template <typename U>
U __shfl_sync(unsigned, U x, int lane) { return mlxemu::exchange(x, lane); }
template <typename U>
U __shfl_xor_sync(unsigned, U x, int mask) { return mlxemu::exchange(x, int(mlxemu::G->current % 32) ^ mask); }
template <typename U>
U __shfl_down_sync(unsigned, U x, unsigned delta) {
  int lane = mlxemu::G->current % 32;
  return mlxemu::exchange(x, lane + int(delta) < 32 ? lane + int(delta) : lane);
}

namespace cooperative_groups {}
namespace mlx::core::cu {
using Shape = std::array<int32_t, 10>;  // MAX_NDIM in mlx/backend/cuda/device/config.h
using Strides = std::array<int64_t, 10>;
}  // namespace mlx::core::cu

#endif
