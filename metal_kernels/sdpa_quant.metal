// sdpa_quant.metal — decode attention over mlx-lm's QuantizedKVCache, dequantizing inside the score and value
// passes (the cache is read in place, packed; no dequantized copy).
//
// inputs:  q (B, Hq, L, D) T, row-contiguous | kq, vq (B, Hkv, S, D*BITS/32) uint32 | ks, kb, vs, vb
//          (B, Hkv, S, D/GS) T — all six read in place with any strides
//          | params (4,) int32 = [nsplit, block, causal, 0] | fparams (1,) float32 = [scale]
// outputs: as sdpa_decode.metal (o, or part/pm/pl for the split pass)
// template: T, D, QR, NSG, SPLIT as sdpa_decode.metal; GS (32/64/128), BITS (4/8)
// grid (NSG·32, B·Hkv, ceil(R·L/QR)·nsplit), threadgroup (NSG·32, 1, 1).
// [[body]]
static_assert(NSG * 32 >= D, "need one thread per output element in the merge");
threadgroup float tg_m[NSG];
threadgroup float tg_l[NSG];
threadgroup float tg_acc[NSG * D];
const int Hkv = kq_shape[1], S = kq_shape[2];
const int Hq = q_shape[1], L = q_shape[2];
const int nsplit = params[0], block = params[1];
const int chunks = (Hq / Hkv * L + QR - 1) / QR;
const int bh = int(threadgroup_position_in_grid.y);
const int split = int(threadgroup_position_in_grid.z) / chunks;
const int row_base = (int(threadgroup_position_in_grid.z) % chunks) * QR;
QuantKV<T, D, GS, BITS> kv;
kv.kq = kq; kv.kscale = ks; kv.kbias = kb;
kv.vq = vq; kv.vscale = vs; kv.vbias = vb;
for (int i = 0; i < 4; ++i) {
  kv.kq_st[i] = kq_strides[i]; kv.ks_st[i] = ks_strides[i]; kv.kb_st[i] = kb_strides[i];
  kv.vq_st[i] = vq_strides[i]; kv.vs_st[i] = vs_strides[i]; kv.vb_st[i] = vb_strides[i];
}
const int start = split * block;
const int stop = metal::min(S, start + block);
attn_decode<T, D, QR, NSG, SPLIT>(kv, q, fparams[0], Hq, Hkv, L, S, params[2] != 0, bh / Hkv, bh % Hkv, row_base,
                                  start, stop, split, nsplit, o, part, pm, pl, tg_m, tg_l, tg_acc,
                                  simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
                                  thread_index_in_threadgroup);
