// Internal to the DecoderLayer op (layer.cpp runs a layer, layer_plan.cpp makes plans and builds the graph node):
// the weight slots, the LayerPlan a decoder_layer_plan call resolves, and the primitive.
//
// Weights are passed BY NAME: decoder_layer_plan gets the slot names in the order the arrays will come (the
// names are the ones in kSlots below; Python builds the list from the spec), resolves them to input indexes once
// and returns a plan id. Nothing else knows a position.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/primitives.h"
#include "ops.h"

namespace mlxinfer_cpu::layer {

// The slot names a layer's arrays may have (a quantized linear "X" gives "X.weight", "X.scales", "X.biases").
enum Slot : int { sAttnNorm, sAttnOutNorm, sMlpNorm, sMlpOutNorm, sQNorm, sKNorm, sQBias, sKBias, sVBias, sFreqs,
                  sLinear0 };
inline constexpr const char* kNorms[] = {"attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm", "q_norm",
                                         "k_norm", "q.bias", "k.bias", "v.bias", "rope_freqs"};
enum Lin : int { lQ, lK, lV, lQKV, lO, lGate, lUp, lGateUp, lDown, kLinears };
inline constexpr const char* kLinearNames[] = {"q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down"};
inline constexpr const char* kParts[] = {"weight", "scales", "biases"};
inline constexpr int kSlots = sLinear0 + 3 * kLinears;

struct LayerPlan {
  int gs, bits, hq, hkv, d, rope_dims, act, window, n_arrays;
  bool traditional, qk_whole, q_row_scale;  // q_row_scale: a q_scale input multiplies each query row
  bool tiled;  // the linears' weights are in row tiles (QmmArgs::tiled; config key "tiled", optional)
  bool symmetric;  // every linear's biases == -8 * scales (QmmArgs::symmetric; key "symmetric", with "tiled")
  float base, rope_scale, rope_mscale, attn_scale, eps, qk_eps, norm_offset;
  int at[kSlots];  // input index of each slot (x is input 0, arrays follow), -1 when absent
  int lin(int l, int part = 0) const { return at[sLinear0 + 3 * l + part]; }
};

// The plans by id (a model makes one per distinct layer configuration), in layer_plan.cpp: intern_plan returns the
// id of an equal plan or appends this one; plan_by_id copies one out (both under the registry's lock).
int intern_plan(const LayerPlan& p);
LayerPlan plan_by_id(int id);

class NativeDecoderLayer : public mx::Primitive {
 public:
  // held: the layer's weights when every one is already evaluated (a loaded model's): the op keeps them itself and
  // its graph inputs are x, k_buf and v_buf only. MLX's eval does bookkeeping per graph input (hash-map nodes,
  // allocations) on the Python thread, ~25 per layer and token otherwise, which on 2 cores takes CPU from the pool.
  NativeDecoderLayer(mx::Stream s, int plan, int offset, bool causal, int write, int first, bool has_starts,
                     bool has_q_scale, std::vector<mx::array> held = {})
      : mx::Primitive(s), plan_(plan), offset_(offset), causal_(causal), write_(write), first_(first),
        has_starts_(has_starts), has_q_scale_(has_q_scale), held_(std::move(held)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[mlxinfer_cpu] decoder_layer runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferDecoderLayer"; }
  bool is_equivalent(const mx::Primitive& other) const override { return this == &other; }  // writes its own KV
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const size_t n = inputs.size();
    return {inputs[0].shape(), inputs[n - 2].shape(), inputs[n - 1].shape()};
  }

 private:
  int plan_, offset_;
  bool causal_;
  int write_, first_;  // buffer index of this step's first key / of the oldest key attended (see decoder_layer)
  // Inputs after the weights, before k_buf and v_buf: q_scale (L or B*L floats) when has_q_scale_, then starts
  // (B,) when has_starts_ (a left-padded batch, each row's first key); see decoder_layer.
  bool has_starts_, has_q_scale_;
  std::vector<mx::array> held_;  // the weights, when not graph inputs (in the plan's order, between x and k_buf)
};

}  // namespace mlxinfer_cpu::layer
