// decoder_layer_plan (names and numbers -> a LayerPlan, once per layer configuration) and decoder_layer (the graph
// node: every input checked against its plan when the graph is built, weights held by the op when evaluated).
// The maths is in layer.cpp; the slots and the plan in layer_plan.h.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "layer_plan.h"
#include "qmm_float.h"

namespace mlxinfer_cpu {
namespace layer {
namespace {

std::mutex plans_mutex;
std::vector<LayerPlan> plans;  // by plan id; a model makes one per distinct layer configuration

int slot_of(const std::string& name) {
  for (int i = 0; i < sLinear0; ++i)
    if (name == kNorms[i]) return i;
  for (int l = 0; l < kLinears; ++l)
    for (int p = 0; p < 3; ++p)
      if (name == std::string(kLinearNames[l]) + "." + kParts[p]) return sLinear0 + 3 * l + p;
  return -1;
}

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("[mlxinfer_cpu.decoder_layer] " + msg); }

}  // namespace

int intern_plan(const LayerPlan& p) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  for (size_t i = 0; i < plans.size(); ++i)
    if (std::memcmp(&plans[i], &p, sizeof(LayerPlan)) == 0) return static_cast<int>(i);
  plans.push_back(p);
  return static_cast<int>(plans.size() - 1);
}

LayerPlan plan_by_id(int id) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (id < 0 || id >= static_cast<int>(plans.size())) fail("no such plan");
  return plans[id];
}

}  // namespace layer

using namespace layer;

int decoder_layer_plan(const std::vector<std::string>& names, const std::map<std::string, double>& config) {
  LayerPlan p{};
  auto get = [&](const char* key) {
    auto it = config.find(key);
    if (it == config.end()) fail(std::string("config lacks '") + key + "'");
    return it->second;
  };
  p.gs = (int)get("group_size"), p.bits = (int)get("bits"), p.hq = (int)get("n_heads");
  p.hkv = (int)get("n_kv_heads"), p.d = (int)get("head_dim"), p.rope_dims = (int)get("rope_dims");
  p.act = (int)get("activation"), p.window = (int)get("window"), p.traditional = get("traditional") != 0;
  p.base = (float)get("rope_base"), p.rope_scale = (float)get("rope_scale"), p.rope_mscale = (float)get("rope_mscale");
  p.attn_scale = (float)get("attn_scale"), p.eps = (float)get("norm_eps"), p.qk_eps = (float)get("qk_norm_eps");
  p.norm_offset = (float)get("norm_offset"), p.qk_whole = get("qk_norm_whole") != 0;
  p.q_row_scale = get("q_row_scale") != 0;
  p.tiled = config.count("tiled") && config.at("tiled") != 0;
  p.symmetric = config.count("symmetric") && config.at("symmetric") != 0;
  if (config.size() != 18 + config.count("tiled") + config.count("symmetric")) fail("config has unknown keys");
  if (p.tiled && (p.bits != 4 || !tiled_weights_supported()))
    fail("tiled weights need 4-bit linears and a kernel set that reads them (tiled_weights_supported)");
  if (p.symmetric && !p.tiled) fail("symmetric is a promise about tiled weights: it needs \"tiled\"");
  if (p.hq <= 0 || p.hkv <= 0 || p.d <= 0 || p.hq % p.hkv) fail("heads must be positive, n_heads a multiple of n_kv_heads");
  if (p.rope_dims < 0 || p.rope_dims % 2 || p.rope_dims > p.d) fail("rope dims must be even and <= head_dim");
  if (p.act != 0 && p.act != 1) fail("activation is 0 (silu) or 1 (gelu_tanh)");
  for (int& i : p.at) i = -1;
  p.n_arrays = static_cast<int>(names.size());
  for (int i = 0; i < p.n_arrays; ++i) {
    const int s = slot_of(names[i]);
    if (s < 0) fail("unknown weight name '" + names[i] + "'");
    if (p.at[s] >= 0) fail("weight '" + names[i] + "' given twice");
    p.at[s] = i + 1;  // input 0 is x
  }
  auto whole = [&](int l) { return p.lin(l) >= 0 && p.lin(l, 1) >= 0 && p.lin(l, 2) >= 0; };
  auto none = [&](int l) { return p.lin(l) < 0 && p.lin(l, 1) < 0 && p.lin(l, 2) < 0; };
  const bool sep_qkv = whole(lQ) && whole(lK) && whole(lV) && none(lQKV);
  const bool one_qkv = whole(lQKV) && none(lQ) && none(lK) && none(lV);
  const bool sep_gu = whole(lGate) && whole(lUp) && none(lGateUp);
  const bool one_gu = whole(lGateUp) && none(lGate) && none(lUp);
  if (!(sep_qkv || one_qkv) || !(sep_gu || one_gu) || !whole(lO) || !whole(lDown))
    fail("needs q, k, v (or qkv), o, gate, up (or gate_up) and down, each as weight, scales, biases");
  if ((p.at[sQNorm] < 0) != (p.at[sKNorm] < 0)) fail("q_norm and k_norm come together");
  if ((p.at[sQBias] < 0) != (p.at[sKBias] < 0) || (p.at[sQBias] < 0) != (p.at[sVBias] < 0) ||
      (p.at[sQBias] >= 0 && !sep_qkv))
    fail("q/k/v biases come together, with separate projections");
  return intern_plan(p);
}

std::vector<mx::array> decoder_layer(const mx::array& x, const std::vector<mx::array>& arrays, const mx::array& k_buf,
                                     const mx::array& v_buf, int offset, bool causal, int plan_id, int write,
                                     int first, const std::optional<mx::array>& starts,
                                     const std::optional<mx::array>& q_scale) {
  const LayerPlan p = plan_by_id(plan_id);
  if (x.ndim() != 3 || x.dtype() != mx::float32) fail("x must be float32 (B, L, hidden)");
  if (static_cast<int>(arrays.size()) != p.n_arrays) fail("the arrays must match the plan's names");
  std::vector<mx::array> inputs;
  inputs.reserve(arrays.size() + 3);
  inputs.push_back(x);
  inputs.insert(inputs.end(), arrays.begin(), arrays.end());
  auto arr = [&](int slot) -> const mx::array& { return inputs[p.at[slot]]; };
  const int E = x.shape(2), qd = p.hq * p.d, kvd = p.hkv * p.d;
  const bool fused_gu = p.lin(lGateUp) >= 0;
  const mx::array& gw = inputs[p.lin(fused_gu ? lGateUp : lGate)];
  const int I = gw.ndim() == 2 ? gw.shape(0) / (fused_gu ? 2 : 1) : 0;
  if (I <= 0) fail("empty MLP");
  const int dims[kLinears][2] = {{E, qd}, {E, kvd}, {E, kvd}, {E, qd + 2 * kvd}, {qd, E},
                                 {E, I}, {E, I}, {E, 2 * I}, {I, E}};
  for (int l = 0; l < kLinears; ++l)
    if (p.lin(l) >= 0 && check_quantized_weight(dims[l][0], inputs[p.lin(l)], inputs[p.lin(l, 1)],
                                                inputs[p.lin(l, 2)], p.gs, p.bits, "decoder_layer") != dims[l][1])
      fail(std::string("projection ") + kLinearNames[l] + " has the wrong output size for the layer");
  for (int l = 0; l < kLinears && p.tiled; ++l)
    if (p.lin(l) >= 0 && dims[l][1] % kTileRows != 0)
      fail(std::string("projection ") + kLinearNames[l] + ": tiled weights need a multiple of 16 output rows");
  auto vec = [&](int slot, int n, const char* what) {
    if (p.at[slot] < 0) return;
    const auto& w = arr(slot);
    if (w.dtype() != mx::float32 || w.ndim() != 1 || w.shape(0) != n)
      fail(std::string(what) + " must be float32 (" + std::to_string(n) + ",)");
  };
  for (int s : {sAttnNorm, sAttnOutNorm, sMlpNorm, sMlpOutNorm}) vec(s, E, kNorms[s]);
  vec(sQNorm, p.qk_whole ? qd : p.d, "q_norm");
  vec(sKNorm, p.qk_whole ? kvd : p.d, "k_norm");
  vec(sQBias, qd, "q.bias");
  vec(sKBias, kvd, "k.bias");
  vec(sVBias, kvd, "v.bias");
  vec(sFreqs, p.rope_dims / 2, "rope_freqs");
  for (const auto* b : {&k_buf, &v_buf})
    if (b->ndim() != 4 || (b->dtype() != mx::float32 && b->dtype() != mx::float16) || b->dtype() != k_buf.dtype() ||
        b->shape(0) != x.shape(0) || b->shape(1) != p.hkv || b->shape(3) != p.d || b->shape() != k_buf.shape())
      fail("KV buffers must be float32 or float16 (B, n_kv_heads, capacity, head_dim), the same for both");
  if (write < 0) write = offset;  // a cache holding every position: key i at buffer index i
  if (offset < 0 || first < 0 || first > write || write + x.shape(1) > k_buf.shape(2))
    fail("no room in the KV buffers at this write index (or first is past it)");
  if (starts && (starts->ndim() != 1 || starts->shape(0) != x.shape(0) || !mx::issubdtype(starts->dtype(), mx::integer) ||
                 first != 0))
    fail("starts must be integer (B,), with first 0");
  if (q_scale.has_value() != p.q_row_scale)
    fail(p.q_row_scale ? "this layer's plan needs q_scale (a factor per query row)" : "this layer's plan takes no q_scale");
  if (q_scale && (q_scale->dtype() != mx::float32 || (q_scale->size() != (size_t)x.shape(1) &&
                                                      q_scale->size() != (size_t)x.shape(0) * x.shape(1))))
    fail("q_scale must be float32 with L or B * L values (one per query row)");
  for (const auto* b : {&k_buf, &v_buf})
    if (b->is_available() && !(b->flags().row_contiguous && b->data_size() == b->size()))
      fail("KV buffers must be whole row-major buffers (from kv_reserve)");
  std::vector<mx::array> held;
  const bool all_evaluated = std::all_of(arrays.begin(), arrays.end(), [](const mx::array& a) {
    return a.is_available() && !a.has_primitive();
  });
  if (all_evaluated) {  // a loaded model's weights: held by the op, not graph inputs (see NativeDecoderLayer)
    held.assign(inputs.begin() + 1, inputs.end());
    inputs.erase(inputs.begin() + 1, inputs.end());
  }
  if (q_scale) inputs.push_back(*q_scale);
  if (starts) inputs.push_back(*starts);
  inputs.push_back(k_buf);
  inputs.push_back(v_buf);
  return mx::array::make_arrays({x.shape(), k_buf.shape(), v_buf.shape()}, {mx::float32, k_buf.dtype(), v_buf.dtype()},
                                std::make_shared<NativeDecoderLayer>(mx::to_stream({}, mx::Device::cpu), plan_id,
                                                                     offset, causal, write, first, starts.has_value(),
                                                                     q_scale.has_value(), std::move(held)),
                                std::move(inputs));
}

}  // namespace mlxinfer_cpu
