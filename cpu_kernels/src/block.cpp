// The DecoderBlock primitive: a whole llama-style decoder layer as one graph node,
//   h = x + o_proj(attention(rope(q(norm1(x))), K, V))     K, V: the KV cache with this step's rope(k), v
// (llama; also Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorms before RoPE)
//   y = h + down(silu(gate(norm2(h))) * up(norm2(h)))
// Why: on the CPU backend every MLX op costs ~7 us of graph building and dispatch, and a SmolLM2 decode step
// spent ~1.5 ms of its ~7.5 ms there with 7 fused ops per layer; this is one per layer. The pieces are the same
// kernels as the separate ops (qmm_float, scatter_heads, sdpa_exec), so results match them.
//
// KV cache: the step's keys/values are written IN PLACE into the k_buf / v_buf inputs at [offset, offset + L);
// the op's outputs are (y, k_buf', v_buf'), the last two sharing the input buffers, so that evaluating the cache
// (mx.eval(cache.state)) runs the op. That breaks MLX's value semantics for those buffers on purpose: it is safe
// because the caller (mlxinfer/kernels/fused_block.py) only passes buffers it allocated itself with kv_reserve
// (never views, never shared) and writes only past every position a holder of them may read (it copies into a
// fresh buffer after a trim). MLX's own alternative, buffer donation, needs each buffer to be an input
// referenced once, which a multi-output primitive cannot give (every output holds the input list).
#include <cmath>
#include <cstring>
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
#include "qmm_kernels.h"

namespace mlxinfer_cpu {

namespace {

// Input order: x, then (w, scales, biases) of q, k, v, o, gate, up, down, then norm1, norm2, k_buf, v_buf, then
// the optional ones: [q, k, v biases] [q_norm, k_norm weights] [freqs].
enum : int { kX = 0, kQ = 1, kK = 4, kV = 7, kO = 10, kGate = 13, kUp = 16, kDown = 19, kNorm1 = 22, kNorm2 = 23,
             kKBuf = 24, kVBuf = 25, kOptional = 26 };

struct BlockSpec {
  DecoderBlockConfig c;
  bool causal;
  int bias_at = -1, qk_norm_at = -1, freqs_at = -1;  // input index of each optional group, -1 when absent
};

class NativeDecoderBlock : public mx::Primitive {
 public:
  NativeDecoderBlock(mx::Stream s, BlockSpec spec, int offset) : mx::Primitive(s), spec_(spec), offset_(offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[mlxinfer_cpu] decoder_block runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferDecoderBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    // Never merged with another node: each one writes its own KV positions.
    return this == &other;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[kX].shape(), inputs[kKBuf].shape(), inputs[kVBuf].shape()};
  }

 private:
  BlockSpec spec_;
  int offset_;
};

QWeight qweight(const std::vector<mx::array>& in, int first, float* out) {
  return {&in[first], &in[first + 1], &in[first + 2], out};
}

void run_block(std::vector<mx::array>& in, mx::array& out, const BlockSpec& p, int offset) {
  const DecoderBlockConfig& c = p.c;
  const int hq = c.n_heads, hkv = c.n_kv_heads, d = c.head_dim, gs = c.group_size, bits = c.bits;
  const mx::array& x = in[kX];
  mx::array& kbuf = in[kKBuf];
  mx::array& vbuf = in[kVBuf];
  if (!kbuf.flags().row_contiguous || kbuf.data_size() != kbuf.size() || !vbuf.flags().row_contiguous ||
      vbuf.data_size() != vbuf.size())
    throw std::runtime_error("[mlxinfer_cpu.decoder_block] KV buffers must be whole row-major buffers (kv_reserve)");
  const int B = x.shape(0), L = x.shape(1), E = x.shape(2), rows = B * L;
  const int qd = hq * d, kvd = hkv * d, I = in[kGate].shape(0), cap = kbuf.shape(2);
  // Intermediates in one buffer from MLX's allocator (a prefill chunk's are tens of MB): counted in MLX's peak
  // memory, returned to its cache when this task ends and released by mx.clear_cache() like any array's.
  const size_t n_xn = (size_t)rows * E, n_q = (size_t)rows * qd, n_kv = (size_t)rows * kvd, n_i = (size_t)rows * I;
  const bool half = kbuf.dtype() == mx::float16;
  const size_t n_stage = half ? n_kv : 0;  // k/v staged in float32 before the conversion into a float16 cache
  mx::array scratch(mx::Shape{static_cast<int>(2 * n_xn + 3 * n_q + 2 * n_kv + 2 * n_stage + 2 * n_i)}, mx::float32,
                    nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));
  float* xn = scratch.data<float>();  // (rows, E): norm1(x), later norm2(h)
  float* h = xn + n_xn;               // (rows, E): x + o_proj(attention)
  float* fq = h + n_xn;               // (rows, Hq * D) projections, then q in (B, Hq, L, D)
  float* qh = fq + n_q;
  float* attn = qh + n_q;             // (rows, Hq * D): attention output in o_proj's layout
  float* fk = attn + n_q;             // (rows, Hkv * D) each
  float* fv = fk + n_kv;
  float* kh = fv + n_kv;              // (B, Hkv, L, D) each, float16 cache only: this step's k (RoPE'd) and v
  float* vh = kh + n_stage;
  float* g = vh + n_stage;            // (rows, I): gate, then silu(gate) * up
  float* u = g + n_i;
  const float* xf = x.data<float>();
  const float* periods = p.freqs_at >= 0 ? in[p.freqs_at].data<float>() : nullptr;
  const RopeSpec rope{c.rope_dims, c.traditional, c.base, c.rope_scale};

  // Attention input side: (rows, E) -> q (B, Hq, L, D) RoPE'd; k RoPE'd and v straight into the cache buffers.
  rms_norm_rows(xf, in[kNorm1].data<float>(), xn, rows, E, c.eps1);
  qmm_float(xn, rows, E, {qweight(in, kQ, fq), qweight(in, kK, fk), qweight(in, kV, fv)},
            gs, bits);
  if (p.bias_at >= 0) {  // Qwen2: q/k/v projections with a bias
    float* outs[3] = {fq, fk, fv};
    const int widths[3] = {qd, kvd, kvd};
    for (int j = 0; j < 3; ++j) {
      const float* b = in[p.bias_at + j].data<float>();
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < widths[j]; ++i) outs[j][(size_t)r * widths[j] + i] += b[i];
    }
  }
  if (p.qk_norm_at >= 0) {  // Qwen3: an RMSNorm over each head of q and k before RoPE
    rms_norm_rows(fq, in[p.qk_norm_at].data<float>(), fq, (size_t)rows * hq, d, c.qk_eps);
    rms_norm_rows(fk, in[p.qk_norm_at + 1].data<float>(), fk, (size_t)rows * hkv, d, c.qk_eps);
  }
  scatter_heads(fq, qh, B, L, hq, d, rope, offset, periods, L, 0);
  const RopeSpec no_rope{0, false, 1.f, 1.f};
  if (!half) {
    scatter_heads(fk, kbuf.data<float>(), B, L, hkv, d, rope, offset, periods, cap, offset);
    scatter_heads(fv, vbuf.data<float>(), B, L, hkv, d, no_rope, 0, nullptr, cap, offset);
  } else {  // float16 cache: heads split in float32, then each (b, h) run of L rows converted into place
    scatter_heads(fk, kh, B, L, hkv, d, rope, offset, periods, L, 0);
    scatter_heads(fv, vh, B, L, hkv, d, no_rope, 0, nullptr, L, 0);
    for (int bh = 0; bh < B * hkv; ++bh) {
      const size_t src = (size_t)bh * L * d, dst = ((size_t)bh * cap + offset) * d * sizeof(uint16_t);
      convert_floats(kh + src, mx::float32, kbuf.data<char>() + dst, mx::float16, (size_t)L * d);
      convert_floats(vh + src, mx::float32, vbuf.data<char>() + dst, mx::float16, (size_t)L * d);
    }
  }

  // Attention over the cache's first offset + L positions, written in o_proj's (B, L, Hq * D) layout.
  SdpaArgs a{};
  a.B = B;
  a.Hq = hq;
  a.Hkv = hkv;
  a.L = L;
  a.S = offset + L;
  a.D = d;
  a.scale = c.attn_scale;
  a.causal = p.causal && L > 1;
  a.q = qh;
  a.k = kbuf.data<void>();
  a.v = vbuf.data<void>();
  a.kv_half = half;
  const int64_t qs[3] = {(int64_t)hq * L * d, (int64_t)L * d, d};
  const int64_t ks[3] = {(int64_t)hkv * cap * d, (int64_t)cap * d, d};
  for (int i = 0; i < 3; ++i) {
    a.qs[i] = qs[i];
    a.ks[i] = a.vs[i] = ks[i];
  }
  a.out = attn;
  a.heads_last = true;
  sdpa_exec(a);

  // h = x + o_proj(attn); y = h + down(silu(gate(norm2(h))) * up(norm2(h))).
  qmm_float(attn, rows, qd, {qweight(in, kO, h)}, gs, bits);
  for (size_t i = 0; i < n_xn; ++i) h[i] += xf[i];
  rms_norm_rows(h, in[kNorm2].data<float>(), xn, rows, E, c.eps2);
  qmm_float(xn, rows, E, {qweight(in, kGate, g), qweight(in, kUp, u)}, gs, bits);
  select_kernels().silu_mul(g, u, g, n_i);
  float* y = out.data<float>();
  qmm_float(g, rows, I, {qweight(in, kDown, y)}, gs, bits);
  for (size_t i = 0; i < n_xn; ++i) y[i] += h[i];
}

void NativeDecoderBlock::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  outputs[1].copy_shared_buffer(inputs[kKBuf]);  // the same memory, now holding this step's keys
  outputs[2].copy_shared_buffer(inputs[kVBuf]);
  for (const auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  std::vector<mx::array> in;
  for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  enc.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(outputs[0]), spec = spec_,
                offset = offset_]() mutable {
    for (int i = 0; i < static_cast<int>(in.size()); ++i)
      if (i != kKBuf && i != kVBuf && !in[i].flags().row_contiguous) in[i] = row_contiguous_copy(in[i]);
    run_block(in, out, spec, offset);
  });
}

}  // namespace

std::vector<mx::array> decoder_block(const mx::array& x, const std::vector<mx::array>& weights, const mx::array& k_buf,
                                     const mx::array& v_buf, int offset, bool causal, const DecoderBlockConfig& c,
                                     const std::optional<mx::array>& freqs) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("[mlxinfer_cpu.decoder_block] " + msg); };
  if (x.ndim() != 3 || x.dtype() != mx::float32) fail("x must be float32 (B, L, hidden)");
  const size_t n_weights = 23 + (c.qkv_bias ? 3 : 0) + (c.qk_norm ? 2 : 0);
  if (weights.size() != n_weights)
    fail("weights: (w, scales, biases) of q, k, v, o, gate, up, down, the two norms, then q/k/v biases and q/k "
         "norms when the config has them");
  if (c.n_heads <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 || c.n_heads % c.n_kv_heads)
    fail("heads must be positive, n_heads a multiple of n_kv_heads");
  if (c.rope_dims < 0 || c.rope_dims % 2 || c.rope_dims > c.head_dim) fail("rope dims must be even and <= head_dim");
  const int E = x.shape(2), qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
  const int I = weights[kGate - 1].ndim() == 2 ? weights[kGate - 1].shape(0) : 0;
  if (I <= 0) fail("empty MLP");
  // (input width, output width) of q, k, v, o, gate, up, down
  const int dims[7][2] = {{E, qd}, {E, kvd}, {E, kvd}, {qd, E}, {E, I}, {E, I}, {I, E}};
  for (int i = 0; i < 7; ++i)
    if (check_quantized_weight(dims[i][0], weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], c.group_size,
                               c.bits, "decoder_block") != dims[i][1])
      fail("projection " + std::to_string(i) + " has the wrong output size for the block");
  for (int i : {21, 22})
    if (weights[i].dtype() != mx::float32 || weights[i].ndim() != 1 || weights[i].shape(0) != E)
      fail("norm weights must be float32 (hidden,)");
  for (const auto* b : {&k_buf, &v_buf})
    if (b->ndim() != 4 || (b->dtype() != mx::float32 && b->dtype() != mx::float16) || b->dtype() != k_buf.dtype() ||
        b->shape(0) != x.shape(0) || b->shape(1) != c.n_kv_heads || b->shape(3) != c.head_dim ||
        b->shape() != k_buf.shape())
      fail("KV buffers must be float32 or float16 (B, n_kv_heads, capacity, head_dim), the same for both");
  if (offset < 0 || offset + x.shape(1) > k_buf.shape(2)) fail("no room in the KV buffers at this offset");
  // Whole row-major buffers (kv_reserve's, or this op's earlier outputs): checked here when already evaluated,
  // so that the task (where an exception cannot be turned into a fallback) never sees anything else.
  for (const auto* b : {&k_buf, &v_buf})
    if (b->is_available() && !(b->flags().row_contiguous && b->data_size() == b->size()))
      fail("KV buffers must be whole row-major buffers (from kv_reserve)");
  BlockSpec spec{c, causal};
  std::vector<mx::array> inputs;
  inputs.reserve(32);
  inputs.push_back(x);
  inputs.insert(inputs.end(), weights.begin(), weights.begin() + 23);
  inputs.push_back(k_buf);
  inputs.push_back(v_buf);
  size_t next = 23;
  if (c.qkv_bias) {
    spec.bias_at = static_cast<int>(inputs.size());
    for (int j = 0; j < 3; ++j) {
      const auto& b = weights[next++];
      if (b.dtype() != mx::float32 || b.ndim() != 1 || b.shape(0) != (j == 0 ? qd : kvd))
        fail("q/k/v biases must be float32 (projection width,)");
      inputs.push_back(b);
    }
  }
  if (c.qk_norm) {
    spec.qk_norm_at = static_cast<int>(inputs.size());
    for (int j = 0; j < 2; ++j) {
      const auto& w = weights[next++];
      if (w.dtype() != mx::float32 || w.ndim() != 1 || w.shape(0) != c.head_dim)
        fail("q/k norm weights must be float32 (head_dim,)");
      inputs.push_back(w);
    }
  }
  if (freqs) {
    if (freqs->dtype() != mx::float32 || freqs->ndim() != 1 || freqs->shape(0) != c.rope_dims / 2)
      fail("rope freqs must be float32 (rope_dims / 2,)");
    spec.freqs_at = static_cast<int>(inputs.size());
    inputs.push_back(*freqs);
  }
  return mx::array::make_arrays({x.shape(), k_buf.shape(), v_buf.shape()}, {mx::float32, k_buf.dtype(), v_buf.dtype()},
                                std::make_shared<NativeDecoderBlock>(mx::to_stream({}, mx::Device::cpu), spec, offset),
                                std::move(inputs));
}

}  // namespace mlxinfer_cpu
