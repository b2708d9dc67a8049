// swiglu.metal — fused SwiGLU decode step: h = silu(x · Wgᵀ) ⊙ (x · Wuᵀ), both weights affine-quantized.
//
// inputs:  x (..., K) T, M = prod(...) rows | wg, wu (N, K*BITS/32) uint32 | sg, bg, su, bu (N, K/GS) T
//          | params (2,) int32 = [N, K]
// outputs: h (..., N) T
// template: T (float16/bfloat16/float32), GS (32/64/128), BITS (4/8), M (1…8)
// grid (64, ceil(N/8), 1), threadgroup (64, 1, 1): 2 simdgroups × 4 rows of both matrices each.
// Why fused: one launch instead of three (gate, up, activation), x is loaded once per chunk for both matrices,
//   and the gate/up products never round-trip through memory in T precision.
// [[body]]
constexpr int ROWS = 4;
const int N = params[0];
const int K = params[1];
const uint lane = thread_index_in_simdgroup;
const int row0 = (int(threadgroup_position_in_grid.y) * 2 + int(simdgroup_index_in_threadgroup)) * ROWS;
float ga[M * ROWS];
float ua[M * ROWS];
qmv_partial<T, GS, BITS, M, ROWS>(x, wg, sg, bg, N, K, row0, lane, ga);
qmv_partial<T, GS, BITS, M, ROWS>(x, wu, su, bu, N, K, row0, lane, ua);
for (int m = 0; m < M; ++m) {
  for (int r = 0; r < ROWS; ++r) {
    const float g = simd_sum(ga[m * ROWS + r]);
    const float u = simd_sum(ua[m * ROWS + r]);
    if (lane == 0 && row0 + r < N) {
      h[m * N + row0 + r] = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);
    }
  }
}
