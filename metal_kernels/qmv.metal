// qmv.metal — y = x · Wᵀ for affine-quantized W (MLX format), M = 1…8 activation rows.
//
// inputs:  x (..., K) T, row-major, M = prod(...) rows | w (N, K*BITS/32) uint32 | scales, biases (N, K/GS) T
//          | params (2,) int32 = [N, K]
// outputs: y (..., N) T
// template: T (float16/bfloat16/float32), GS (32/64/128), BITS (4/8), M (1…8)
// grid (64, ceil(N/8), 1), threadgroup (64, 1, 1): 2 simdgroups × 4 output rows each; lanes split K.
// constraints: K % GS == 0 (MLX's quantization guarantees it); any N, any K (no multiple-of-512 rule, unlike
//   MLX's qmv_fast); the weight rows are read once for all M activation rows.
// [[body]]
constexpr int ROWS = 4;
const int N = params[0];
const int K = params[1];
const uint lane = thread_index_in_simdgroup;
const int row0 = (int(threadgroup_position_in_grid.y) * 2 + int(simdgroup_index_in_threadgroup)) * ROWS;
float acc[M * ROWS];
qmv_partial<T, GS, BITS, M, ROWS>(x, w, scales, biases, N, K, row0, lane, acc);
for (int m = 0; m < M; ++m) {
  for (int r = 0; r < ROWS; ++r) {
    const float v = simd_sum(acc[m * ROWS + r]);
    if (lane == 0 && row0 + r < N) {
      y[m * N + row0 + r] = static_cast<T>(v);
    }
  }
}
