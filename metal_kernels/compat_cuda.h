// compat_cuda.h — Metal vocabulary for CUDA, so mlxinfer's .metal kernel bodies compile unchanged with
// mx.fast.cuda_kernel (NVRTC). Prepended to the kernel header by mlxinfer/kernels/build.py on the CUDA route.
//
// Mapping: a threadgroup is a CUDA block (kernels use 1-D threadgroups only), a simdgroup is a 32-lane warp,
// threadgroup memory is __shared__, threadgroup_barrier is __syncthreads, simd_* are warp shuffles over a full
// mask (every kernel calls them with all 32 lanes converged, as Metal requires too). MLX's CUDA generator does
// not pass Metal's [[attribute]] parameters, so the attribute names become expressions over threadIdx/blockIdx.
#ifndef MLXK_COMPAT_CUDA_H
#define MLXK_COMPAT_CUDA_H

typedef unsigned int uint;

#define device
#define constant
#define thread
#define threadgroup __shared__
#define threadgroup_barrier(flags) __syncthreads()

#define thread_position_in_grid \
  make_uint3(blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, \
             blockIdx.z * blockDim.z + threadIdx.z)
#define threadgroup_position_in_grid blockIdx
#define threads_per_threadgroup blockDim
#define thread_index_in_threadgroup (threadIdx.x)
#define thread_index_in_simdgroup (threadIdx.x & 31u)
#define simdgroup_index_in_threadgroup (threadIdx.x >> 5)

template <typename U>
__device__ inline U simd_sum(U x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
template <typename U>
__device__ inline U simd_max(U x) {
  for (int off = 16; off > 0; off >>= 1) {
    U o = __shfl_xor_sync(0xffffffffu, x, off);
    x = o > x ? o : x;
  }
  return x;
}
template <typename U>
__device__ inline U simd_shuffle(U x, uint lane) { return __shfl_sync(0xffffffffu, x, lane); }
template <typename U>
__device__ inline U simd_broadcast(U x, uint lane) { return __shfl_sync(0xffffffffu, x, lane); }
template <typename U>
__device__ inline U simd_shuffle_xor(U x, uint mask) { return __shfl_xor_sync(0xffffffffu, x, mask); }
template <typename U>
__device__ inline U simd_shuffle_down(U x, uint delta) { return __shfl_down_sync(0xffffffffu, x, delta); }

namespace metal {
__device__ inline float exp(float x) { return ::expf(x); }
__device__ inline float max(float a, float b) { return ::fmaxf(a, b); }
__device__ inline float min(float a, float b) { return ::fminf(a, b); }
__device__ inline int max(int a, int b) { return a > b ? a : b; }
__device__ inline int min(int a, int b) { return a < b ? a : b; }
}  // namespace metal

#endif
