// sdpa_reduce.metal — second pass of split-K decode attention: merge nsplit partial softmax results per row.
//
// inputs:  part (rows, nsplit, D) float32 | pm, pl (rows, nsplit) float32 (running max and denominator)
// outputs: o (rows, D) T, rows = B·Hq·L (the (B, Hq, L, D) output, row-major)
// template: T, D
// grid (32, rows, 1), threadgroup (32, 1, 1): one simdgroup per row, lane owns d = lane + 32·j.
// [[body]]
const int row = int(threadgroup_position_in_grid.y);
const int nsplit = pm_shape[1];
const uint lane = thread_index_in_simdgroup;
float mx = MK_NEG_BIG;
for (int p = 0; p < nsplit; ++p) mx = metal::max(mx, pm[row * nsplit + p]);
float den = 0.0f;
for (int p = 0; p < nsplit; ++p) den += pl[row * nsplit + p] * metal::exp(pm[row * nsplit + p] - mx);
for (int d = int(lane); d < D; d += 32) {
  float num = 0.0f;
  for (int p = 0; p < nsplit; ++p) num += part[(row * nsplit + p) * D + d] * metal::exp(pm[row * nsplit + p] - mx);
  o[row * D + d] = static_cast<T>(den > 0.0f ? num / den : 0.0f);
}
