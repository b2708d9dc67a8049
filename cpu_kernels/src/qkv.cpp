// The QkvRope primitive: an attention block's three input projections, RoPE and the head-major layout in one
// graph node. In decode, mlx-lm's Attention spends 3 matmuls, 3 reshapes, 3 transposes and 2 RoPE calls here
// (11 MLX ops at several microseconds of dispatch each, and the k/v matvecs are too small to share the pool);
// this is one op whose three matvecs run as one pool job.
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "dispatch.h"
#include "ops.h"
#include "qmm_float.h"

namespace mlxinfer_cpu {

namespace {

class NativeQkvRope : public mx::Primitive {
 public:
  NativeQkvRope(mx::Stream s, int group_size, int bits, int n_heads, int n_kv_heads, int head_dim, RopeSpec rope,
                int offset, bool has_norm, float norm_eps, bool has_freqs, bool has_offsets)
      : mx::Primitive(s), gs_(group_size), bits_(bits), hq_(n_heads), hkv_(n_kv_heads), d_(head_dim), rope_(rope),
        offset_(offset), has_norm_(has_norm), norm_eps_(norm_eps), has_freqs_(has_freqs), has_offsets_(has_offsets) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[mlxinfer_cpu] qkv_rope runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferQkvRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const NativeQkvRope*>(&other);
    return o && o->gs_ == gs_ && o->bits_ == bits_ && o->hq_ == hq_ && o->hkv_ == hkv_ && o->d_ == d_ &&
           o->rope_.dims == rope_.dims && o->rope_.traditional == rope_.traditional && o->rope_.base == rope_.base &&
           o->rope_.scale == rope_.scale && o->offset_ == offset_ && o->has_norm_ == has_norm_ &&
           o->norm_eps_ == norm_eps_ && o->has_freqs_ == has_freqs_ && o->has_offsets_ == has_offsets_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int B = inputs[0].shape(0), L = inputs[0].shape(1);
    return {{B, hq_, L, d_}, {B, hkv_, L, d_}, {B, hkv_, L, d_}};
  }

 private:
  int gs_, bits_, hq_, hkv_, d_;
  RopeSpec rope_;
  int offset_;
  bool has_norm_;   // an RMSNorm weight follows the 9 weight inputs: x is normalised first
  float norm_eps_;
  bool has_freqs_;  // then RoPE periods (dims / 2,): theta_i = position * scale / freqs[i] (Llama-3 scaling)
  bool has_offsets_;  // then per-batch-row positions (B,) integer (a left-padded BatchKVCache's offsets)
};

void NativeQkvRope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  for (const auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  std::vector<mx::array> in, out;
  for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  for (const auto& o : outputs) out.push_back(mx::array::unsafe_weak_copy(o));
  enc.dispatch([in = std::move(in), out = std::move(out), gs = gs_, bits = bits_, hq = hq_, hkv = hkv_, d = d_,
                rope = rope_, offset = offset_, has_norm = has_norm_, eps = norm_eps_,
                has_freqs = has_freqs_, has_offsets = has_offsets_]() mutable {
    for (auto& a : in)
      if (!a.flags().row_contiguous) a = row_contiguous_copy(a);
    const int B = in[0].shape(0), L = in[0].shape(1);
    const size_t rows = (size_t)B * L;
    thread_local std::vector<float> fq, fk, fv;
    fq.resize(rows * hq * d);
    fk.resize(rows * hkv * d);
    fv.resize(rows * hkv * d);
    const mx::array x = has_norm ? rms_normed(in[0], in[10], eps) : in[0];
    const float* periods = has_freqs ? in[has_norm ? 11 : 10].data<float>() : nullptr;
    std::vector<int> rows_at;
    if (has_offsets) rows_at = row_ints(in[10 + has_norm + has_freqs]);
    const int* row_offsets = has_offsets ? rows_at.data() : nullptr;
    qmm_float(x, {{&in[1], &in[2], &in[3], fq.data()}, {&in[4], &in[5], &in[6], fk.data()},
                      {&in[7], &in[8], &in[9], fv.data()}},
              gs, bits);
    scatter_heads(fq.data(), out[0].data<float>(), B, L, hq, d, rope, offset, periods, L, 0, row_offsets);
    scatter_heads(fk.data(), out[1].data<float>(), B, L, hkv, d, rope, offset, periods, L, 0, row_offsets);
    scatter_heads(fv.data(), out[2].data<float>(), B, L, hkv, d, RopeSpec{0, false, 1.f, 1.f}, 0, nullptr, L, 0);
  });
}

}  // namespace

std::vector<mx::array> qkv_rope(const mx::array& x, const std::vector<mx::array>& wq, const std::vector<mx::array>& wk,
                                const std::vector<mx::array>& wv, int group_size, int bits, int n_heads,
                                int n_kv_heads, int head_dim, int rope_dims, bool traditional, float base, float scale,
                                int offset, const std::optional<mx::array>& norm_weight, float norm_eps,
                                const std::optional<mx::array>& freqs, const std::optional<mx::array>& offsets) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("[mlxinfer_cpu.qkv_rope] " + msg); };
  if (wq.size() != 3 || wk.size() != 3 || wv.size() != 3) fail("each projection is (w, scales, biases)");
  if (x.ndim() != 3 || x.dtype() != mx::float32) fail("x must be float32 (B, L, hidden)");
  if (n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0) fail("head counts and head_dim must be positive");
  if (rope_dims < 0 || rope_dims % 2 || rope_dims > head_dim) fail("rope dims must be even and <= head_dim");
  const int want[3] = {n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim};
  const std::vector<mx::array>* ws[3] = {&wq, &wk, &wv};
  for (int i = 0; i < 3; ++i) {
    const auto& w = *ws[i];
    if (check_quantized_weight(x, w[0], w[1], w[2], group_size, bits, "qkv_rope") != want[i])
      fail("projection output size does not match heads * head_dim");
  }
  std::vector<mx::array> inputs = {x, wq[0], wq[1], wq[2], wk[0], wk[1], wk[2], wv[0], wv[1], wv[2]};
  if (norm_weight) {
    if (norm_weight->dtype() != mx::float32 || norm_weight->ndim() != 1 || norm_weight->shape(0) != x.shape(2))
      fail("norm weight must be float32 (hidden,)");
    inputs.push_back(*norm_weight);
  }
  if (freqs) {
    if (freqs->dtype() != mx::float32 || freqs->ndim() != 1 || freqs->shape(0) != rope_dims / 2)
      fail("rope freqs must be float32 (rope_dims / 2,)");
    inputs.push_back(*freqs);
  }
  if (offsets) {
    if (offsets->ndim() != 1 || offsets->shape(0) != x.shape(0) || !mx::issubdtype(offsets->dtype(), mx::integer))
      fail("offsets must be an integer array (B,)");
    inputs.push_back(*offsets);
  }
  const int B = x.shape(0), L = x.shape(1);
  auto prim = std::make_shared<NativeQkvRope>(mx::to_stream({}, mx::Device::cpu), group_size, bits, n_heads,
                                              n_kv_heads, head_dim, RopeSpec{rope_dims, traditional, base, scale},
                                              offsets ? 0 : offset, norm_weight.has_value(), norm_eps,
                                              freqs.has_value(), offsets.has_value());
  return mx::array::make_arrays({{B, n_heads, L, head_dim}, {B, n_kv_heads, L, head_dim}, {B, n_kv_heads, L, head_dim}},
                                {mx::float32, mx::float32, mx::float32}, prim, std::move(inputs));
}

}  // namespace mlxinfer_cpu
