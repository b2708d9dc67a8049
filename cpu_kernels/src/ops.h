#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mx = mlx::core;

namespace mlxinfer_cpu {

// Same result as mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)
// (affine mode): x (..., K) times the quantized (N, K) weight -> (..., N), plus `residual` (float32, the output's
// shape) when given. Runs on the CPU stream. tiled: w/scales/biases are in row tiles (qmm_vnni_tiled.cpp; N a
// multiple of 16, a kernel set with tiled_weights_supported(); 8-bit tiles run 8 x rows at a time). symmetric:
// the caller's promise that biases == -2^(bits-1) * scales exactly (QmmArgs::symmetric; tiled decode skips them).
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits,
                           const std::optional<mx::array>& residual = std::nullopt, bool tiled = false,
                           bool symmetric = false);

// mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True) (affine): w (E, N, K * bits / 32) a stack
// of quantized experts, x (..., M, K) float32 and indices (...) integer broadcast over their batch dims ->
// (..., M, N) float32, batch element b multiplied by expert indices[b] (mlx-lm's QuantizedSwitchLinear).
mx::array gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     const mx::array& indices, int group_size, int bits);

// silu(x @ dequant(wg).T) * (x @ dequant(wu).T), both weights quantized like quantized_matmul's.
// With norm_weight, x is RMS-normalised first (the block's post_attention_layernorm).
mx::array swiglu(const mx::array& x, const mx::array& wg, const mx::array& sg, const mx::array& bg,
                 const mx::array& wu, const mx::array& su, const mx::array& bu, int group_size, int bits,
                 const std::optional<mx::array>& norm_weight = std::nullopt, float norm_eps = 0.f);

// mx.fast.scaled_dot_product_attention for float32 q (B, Hq, L, D), k/v (B, Hkv, S, D) float32 or float16 (a
// float16 KV cache; the output is float32), no mask or a
// causal one (aligned to the end of the keys). Runs on the CPU stream. heads_last: the output is
// (B, L, Hq * D) instead of (B, Hq, L, D) (what an o_proj takes, without a transpose copy).
// kv_len >= 0: only the first kv_len keys/values count (k/v may be whole KV-cache buffers).
// start (B,) integer: batch row b sees no key before start[b] (mlx-lm's left-padded BatchKVCache).
mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
               bool heads_last = false, int kv_len = -1, const std::optional<mx::array>& start = std::nullopt);

// mx.fast.rms_norm(x, weight, eps) for float32.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps);

// mx.fast.rope(x, dims, traditional=, base=, scale=, offset=int) for float32 x (..., L, D); with offsets (B,)
// integer, x (B, ..., L, D) and batch row b starts at position offsets[b] (mx.fast.rope's array offset).
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, int offset,
               const std::optional<mx::array>& offsets = std::nullopt);

// nn.QuantizedEmbedding's lookup: ids (any shape, integer) -> dequantized rows (..., dim) float32 (scales/biases
// float32, float16 or bfloat16). Out-of-range ids give zero rows. tiled: the table is in row tiles.
mx::array quantized_embedding(const mx::array& ids, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits, bool tiled = false);

// KV-cache append: writes k/v (B, H, L, D) at [offset, offset + L) of the (B, H, capacity, D) buffers and returns
// the updated buffers (in place when the inputs are not referenced elsewhere). Buffers float32 or float16 (k/v
// converted to the buffers' dtype).
std::vector<mx::array> kv_append(const mx::array& k_buf, const mx::array& v_buf, const mx::array& k,
                                 const mx::array& v, int offset);

// An attention block's input side: x (B, L, hidden) float32 times the quantized q/k/v projections (each
// (w, scales, biases); scales/biases float32, float16 or bfloat16), split into heads and RoPE'd (first rope_dims of each head; 0 = none) at
// positions offset + l. Returns q (B, n_heads, L, head_dim), k and v (B, n_kv_heads, L, head_dim). With
// norm_weight, x is RMS-normalised first (the block's input_layernorm); with freqs (rope_dims / 2 periods, as
// mx.fast.rope's freqs) base is ignored. With offsets (B,) integer, batch row b's positions are offsets[b] + l
// (mlx-lm's BatchKVCache.offset) and `offset` is unused.
std::vector<mx::array> qkv_rope(const mx::array& x, const std::vector<mx::array>& wq, const std::vector<mx::array>& wk,
                                const std::vector<mx::array>& wv, int group_size, int bits, int n_heads,
                                int n_kv_heads, int head_dim, int rope_dims, bool traditional, float base, float scale,
                                int offset, const std::optional<mx::array>& norm_weight = std::nullopt,
                                float norm_eps = 0.f, const std::optional<mx::array>& freqs = std::nullopt,
                                const std::optional<mx::array>& offsets = std::nullopt);

// A fresh (B, heads, capacity, dim) buffer (zeros), float32 or float16 (`half`), holding src's first `valid`
// positions (converted): the KV-cache buffers decoder_layer writes in place (a new allocation, never a view or a
// donated buffer).
mx::array kv_reserve(const std::vector<int>& shape, const std::optional<mx::array>& src = std::nullopt,
                     int valid = 0, bool half = false);

// One decoder layer as one op, by a plan (layer.cpp; mlxinfer/kernels/spec.py describes the layer):
// decoder_layer_plan(names, config) resolves the weights' slot names (in the order decoder_layer will get the
// arrays) and the layer's numbers once and returns a plan id; decoder_layer(x, arrays, k_buf, v_buf, offset,
// causal, plan) then runs it, writing this step's keys/values IN PLACE into the kv_reserve buffers at offset.
// Returns [y, k_buf', v_buf'], the last two sharing k_buf's / v_buf's memory. A windowed cache (kv_cache.py's
// InPlaceRotatingKVCache) passes write (buffer index of this step's keys; -1: offset) and first (buffer index of
// the oldest key kept): offset stays the absolute position (RoPE), keys [first, write + L) are attended in order.
// starts (B,) integer, first 0: a left-padded batch (mlx-lm's BatchKVCache, every row written at the shared index
// write): row b attends keys [starts[b], write + L) and its RoPE positions are offset - starts[b] + l.
// q_scale (L or B*L floats, only and always for a plan with "q_row_scale"): each query row multiplied by its own
// factor (Ministral 3's position-dependent llama-4 scaling, computed by the model and passed in as it is).
int decoder_layer_plan(const std::vector<std::string>& names, const std::map<std::string, double>& config);
std::vector<mx::array> decoder_layer(const mx::array& x, const std::vector<mx::array>& arrays, const mx::array& k_buf,
                                     const mx::array& v_buf, int offset, bool causal, int plan_id, int write = -1,
                                     int first = 0, const std::optional<mx::array>& starts = std::nullopt,
                                     const std::optional<mx::array>& q_scale = std::nullopt);

}  // namespace mlxinfer_cpu
