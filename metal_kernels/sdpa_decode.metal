// sdpa_decode.metal — decode attention over a float KV cache, read in place (strided slices, no copy).
//
// inputs:  q (B, Hq, L, D) T, row-contiguous | k, v (B, Hkv, S, D) T read in place with any strides (MLX passes
//          k_strides, v_strides because the body names them) | params (4,) int32 = [nsplit, block, causal, 0]
//          | fparams (1,) float32 = [scale]
// outputs: o (B, Hq, L, D) T (single pass) | part (B·Hq·L, nsplit, D) float32, pm, pl (B·Hq·L, nsplit) float32
//          (split pass; then sdpa_reduce.metal combines). The unused outputs are 1-element dummies.
// template: T, D (head dim ≤ 256, e.g. 64/80/96/128/256), QR (query rows per threadgroup, 1…8), NSG
//          (simdgroups, NSG·32 ≥ D), SPLIT (bool)
// grid (NSG·32, B·Hkv, ceil(R·L/QR)·nsplit), threadgroup (NSG·32, 1, 1); R = Hq/Hkv (any integer ratio).
// Each threadgroup serves one kv head and QR of its R·L query rows over keys [split·block, (split+1)·block).
// causal: query token t sees keys ≤ S − L + t (mlx's "causal" with the queries at the end).
// [[body]]
static_assert(NSG * 32 >= D, "need one thread per output element in the merge");
threadgroup float tg_m[NSG];
threadgroup float tg_l[NSG];
threadgroup float tg_acc[NSG * D];
const int Hkv = k_shape[1], S = k_shape[2];
const int Hq = q_shape[1], L = q_shape[2];
const int nsplit = params[0], block = params[1];
const int chunks = (Hq / Hkv * L + QR - 1) / QR;
const int bh = int(threadgroup_position_in_grid.y);
const int split = int(threadgroup_position_in_grid.z) / chunks;
const int row_base = (int(threadgroup_position_in_grid.z) % chunks) * QR;
DenseKV<T, D> kv;
kv.k = k;
kv.v = v;
for (int i = 0; i < 4; ++i) {
  kv.kst[i] = k_strides[i];
  kv.vst[i] = v_strides[i];
}
const int start = split * block;
const int stop = metal::min(S, start + block);
attn_decode<T, D, QR, NSG, SPLIT>(kv, q, fparams[0], Hq, Hkv, L, S, params[2] != 0, bh / Hkv, bh % Hkv, row_base,
                                  start, stop, split, nsplit, o, part, pm, pl, tg_m, tg_l, tg_acc,
                                  simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
                                  thread_index_in_threadgroup);
