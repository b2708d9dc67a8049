// The DecoderLayer primitive: one decoder layer as one graph node, driven by a layer plan (mlxinfer/kernels/spec.py
// describes the layer; decoder_layer_plan turns that description into this file's LayerPlan once per layer).
//   a = attn(norm_a(x) | x),  h = x + (norm_ao(a) | a),  m = mlp(norm_m(h) | h),  y = h + (norm_mo(m) | m)
// Each norm is there or not: pre norms only (llama/qwen/phi), all four (Gemma's sandwich), post norms only
// (OLMo 2/3). attn: q/k/v (separate or one fused qkv projection, Phi-3), optional biases (Qwen2), RMSNorms on q and
// k before RoPE, per head (Qwen3, Gemma 3) or over the whole projection (OLMo: qk_norm_whole), RoPE over the first
// rope_dims of each head (base, or precomputed periods: Llama-3, YaRN, Phi-3 SuScaled/LongRoPE, the last two with
// an input scale), optionally a factor per query row (q_scale: Ministral 3), attention over the KV cache, optionally
// only its last `window` positions (sliding layers).
// mlp: act(gate) * up (separate or one fused gate_up projection), act SiLU or GELU-tanh, then down.
// Norm weights may be stored as w - 1 (Gemma: the norm multiplies by 1 + w; norm_offset = 1).
//
// Weights are passed BY NAME (layer_plan.h); the plans and the graph node are made in layer_plan.cpp.
//
// KV cache: this step's keys/values are written IN PLACE into the k_buf / v_buf inputs at [write, write + L)
// (write = offset unless a sliding layer's cache keeps only its window: then RoPE uses offset, the buffer write);
// the op's outputs are (y, k_buf', v_buf'), the last two sharing the input buffers, so that evaluating the cache
// (mx.eval(cache.state)) runs the op. That breaks MLX's value semantics for those buffers on purpose: it is safe
// because the only caller (mlxinfer/kernels/fused_block.py, through kernels.kv_cache.InPlaceKVCache) passes
// buffers it allocated itself with kv_reserve (never views, never shared) and writes only past every position a
// holder of them may read (it copies into a fresh buffer after a trim). MLX's own alternative, buffer donation,
// needs each buffer to be an input referenced once, which a multi-output primitive cannot give.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "dispatch.h"
#include "layer_plan.h"
#include "ops.h"
#include "qmm_float.h"
#include "qmm_kernels.h"
#include "threadpool.h"

namespace mlxinfer_cpu::layer {

namespace {

QWeight qw(const std::vector<mx::array>& in, const LayerPlan& p, int l, float* out) {
  QWeight w{&in[p.lin(l)], &in[p.lin(l, 1)], &in[p.lin(l, 2)], out};
  w.tiled = p.tiled;
  w.symmetric = p.symmetric;
  return w;
}

// RMSNorm rows with the plan's stored-weight convention (w, or 1 + w for Gemma).
void norm_rows(const LayerPlan& p, const mx::array& w, const float* x, float* y, size_t rows, int D, float eps,
               std::vector<float>& tmp) {
  const float* wd = w.data<float>();
  if (p.norm_offset != 0.f) {
    tmp.resize(D);
    for (int i = 0; i < D; ++i) tmp[i] = p.norm_offset + wd[i];
    wd = tmp.data();
  }
  rms_norm_rows(x, wd, y, rows, D, eps);
}

// out[r, i] = act(g[r, i]) * u[r, i]; g and u rows `stride` apart (a fused gate_up: u = g + I, stride 2I). out
// rows are I apart and must not overlap g or u (rows run in parallel for a prompt). g and u are scratch: GELU
// rewrites them.
void act_mul(int act, float* g, float* u, float* out, size_t rows, int I, size_t stride) {
  parallel_rows(rows, 8 * (size_t)I, [&](size_t r0, size_t r1) {
    if (act == 1) {
      // GELU-tanh through the vectorised SiLU kernel: 0.5 a (1 + tanh(z)) = a sigmoid(2z), z = k0 a (1 + c a^2), so
      // gelu(a) b = silu(g') u' with g' = 2z and u' = b a / 2z = b / (2 k0 (1 + c a^2)) (never 0 / 0): a loop the
      // compiler vectorises and the ISA's SiLU instead of a scalar std::tanh per element.
      const float k2 = 2.f * std::sqrt(2.f / static_cast<float>(M_PI)), c = 0.044715f;
      for (size_t r = r0; r < r1; ++r) {
        float* gr = g + r * stride;
        float* ur = u + r * stride;
        for (int i = 0; i < I; ++i) {
          const float a = gr[i], t = k2 * (1.f + c * a * a);
          gr[i] = a * t;
          ur[i] = ur[i] / t;
        }
      }
    }
    // The vectorised SiLU kernel, per row when gate and up interleave by rows (fused gate_up).
    if (stride == (size_t)I) {
      select_kernels().silu_mul(g + r0 * I, u + r0 * I, out + r0 * I, (r1 - r0) * I);
    } else {
      for (size_t r = r0; r < r1; ++r) select_kernels().silu_mul(g + r * stride, u + r * stride, out + r * I, I);
    }
  });
}

// a[i] += b[i] over rows of E (the residual connections).
void add_rows(float* a, const float* b, size_t rows, int E) {
  parallel_rows(rows, E, [&](size_t r0, size_t r1) {
    for (size_t i = r0 * E; i < r1 * E; ++i) a[i] += b[i];
  });
}

// starts (null, or B ints): a left-padded batch (mlx-lm's BatchKVCache): row b's first key is at buffer index
// starts[b] (first is 0 then) and its positions count from there (RoPE at offset - starts[b] + l).
// q_scale (null, or n_q_scale = L or B * L floats): query row (b, l) multiplied by q_scale[l] or q_scale[b * L + l].
void run_layer(std::vector<mx::array>& in, mx::array& out, const LayerPlan& p, int offset, bool causal, int write,
               int first, const int* starts, const float* q_scale, size_t n_q_scale) {
  const int hq = p.hq, hkv = p.hkv, d = p.d, gs = p.gs, bits = p.bits;
  const int n_in = static_cast<int>(in.size());
  const mx::array& x = in[0];
  mx::array& kbuf = in[n_in - 2];
  mx::array& vbuf = in[n_in - 1];
  if (!kbuf.flags().row_contiguous || kbuf.data_size() != kbuf.size() || !vbuf.flags().row_contiguous ||
      vbuf.data_size() != vbuf.size())
    throw std::runtime_error("[mlxinfer_cpu.decoder_layer] KV buffers must be whole row-major buffers (kv_reserve)");
  const int B = x.shape(0), L = x.shape(1), E = x.shape(2), rows = B * L;
  const bool fused_gu = p.lin(lGateUp) >= 0, fused_qkv = p.lin(lQKV) >= 0;
  const int I = fused_gu ? in[p.lin(lGateUp)].shape(0) / 2 : in[p.lin(lGate)].shape(0);
  const int qd = hq * d, kvd = hkv * d, cap = kbuf.shape(2);
  const size_t n_xn = (size_t)rows * E, n_q = (size_t)rows * qd, n_kv = (size_t)rows * kvd, n_i = (size_t)rows * I;
  const bool half = kbuf.dtype() == mx::float16;
  const size_t n_stage = half ? n_kv : 0;
  const size_t n_qkv = fused_qkv ? (size_t)rows * (qd + 2 * kvd) : 0;
  const size_t n_act = fused_gu ? n_i : 0;
  mx::array scratch(
      mx::Shape{static_cast<int>(2 * n_xn + 3 * n_q + 2 * n_kv + 2 * n_stage + 2 * n_i + n_qkv + n_act)},
                    mx::float32, nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));
  float* xn = scratch.data<float>();  // (rows, E): norm_a(x), later norm_m(h), the sandwich norms' outputs
  float* h = xn + n_xn;               // (rows, E): the residual stream after attention
  float* fq = h + n_xn;               // (rows, Hq * D) projections, then q in (B, Hq, L, D)
  float* qh = fq + n_q;
  float* attn = qh + n_q;             // (rows, Hq * D): attention output in o_proj's layout
  float* fk = attn + n_q;
  float* fv = fk + n_kv;
  float* kh = fv + n_kv;              // float16 cache only: this step's k (RoPE'd) and v in (B, Hkv, L, D)
  float* vh = kh + n_stage;
  float* g = vh + n_stage;            // (rows, I) gate; with gate_up (rows, 2I) from g on
  float* u = g + n_i;                 // (rows, I) up, then act(gate) * up
  float* fqkv = u + n_i;              // (rows, Hq*D + 2*Hkv*D): a fused qkv projection's output
  float* act = fused_gu ? fqkv + n_qkv : u;  // (rows, I): act(gate) * up, apart from a fused gate_up's rows
  const float* xf = x.data<float>();
  std::vector<float> wtmp;
  const float* periods = p.at[sFreqs] >= 0 ? in[p.at[sFreqs]].data<float>() : nullptr;
  const RopeSpec rope{p.rope_dims, p.traditional, p.base, p.rope_scale};

  // The projections' input: norm_a(x), or x itself when the layer has no pre norm (OLMo).
  const float* xa = xf;
  if (p.at[sAttnNorm] >= 0) {
    norm_rows(p, in[p.at[sAttnNorm]], xf, xn, rows, E, p.eps, wtmp);
    xa = xn;
  }
  if (fused_qkv) {  // Phi-3: one projection, split into q | k | v per row
    qmm_float(xa, rows, E, {qw(in, p, lQKV, fqkv)}, gs, bits);
    const size_t w = qd + 2 * kvd;
    for (int r = 0; r < rows; ++r) {
      std::memcpy(fq + (size_t)r * qd, fqkv + r * w, qd * sizeof(float));
      std::memcpy(fk + (size_t)r * kvd, fqkv + r * w + qd, kvd * sizeof(float));
      std::memcpy(fv + (size_t)r * kvd, fqkv + r * w + qd + kvd, kvd * sizeof(float));
    }
  } else {
    qmm_float(xa, rows, E, {qw(in, p, lQ, fq), qw(in, p, lK, fk), qw(in, p, lV, fv)}, gs, bits);
  }
  float* outs[3] = {fq, fk, fv};
  const int widths[3] = {qd, kvd, kvd};
  for (int j = 0; j < 3; ++j)  // Qwen2: q/k/v biases
    if (p.at[sQBias + j] >= 0) {
      const float* b = in[p.at[sQBias + j]].data<float>();
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < widths[j]; ++i) outs[j][(size_t)r * widths[j] + i] += b[i];
    }
  if (p.at[sQNorm] >= 0 && p.qk_whole) {  // OLMo: one RMSNorm over each row of q (Hq * D) and of k (Hkv * D)
    norm_rows(p, in[p.at[sQNorm]], fq, fq, rows, qd, p.qk_eps, wtmp);
    norm_rows(p, in[p.at[sKNorm]], fk, fk, rows, kvd, p.qk_eps, wtmp);
  } else if (p.at[sQNorm] >= 0) {  // Qwen3 / Gemma 3: an RMSNorm over each head of q and k before RoPE
    norm_rows(p, in[p.at[sQNorm]], fq, fq, (size_t)rows * hq, d, p.qk_eps, wtmp);
    norm_rows(p, in[p.at[sKNorm]], fk, fk, (size_t)rows * hkv, d, p.qk_eps, wtmp);
  }
  if (p.rope_mscale != 1.f) {  // Phi-3 SuScaledRoPE: the rotated dims are scaled before the rotation
    for (size_t r = 0; r < (size_t)rows * hq; ++r)
      for (int i = 0; i < p.rope_dims; ++i) fq[r * d + i] *= p.rope_mscale;
    for (size_t r = 0; r < (size_t)rows * hkv; ++r)
      for (int i = 0; i < p.rope_dims; ++i) fk[r * d + i] *= p.rope_mscale;
  }
  if (q_scale)  // Ministral 3: a factor per query row (it commutes with RoPE, a rotation of each head's pairs)
    for (int r = 0; r < rows; ++r) {
      const float f = q_scale[n_q_scale == (size_t)L ? r % L : r];
      for (int i = 0; i < qd; ++i) fq[(size_t)r * qd + i] *= f;
    }
  std::vector<int> row_pos;  // a left-padded batch: each row's position of its first query
  if (starts)
    for (int b = 0; b < B; ++b) row_pos.push_back(offset - starts[b]);
  const int* rp = starts ? row_pos.data() : nullptr;
  scatter_heads(fq, qh, B, L, hq, d, rope, offset, periods, L, 0, rp);
  const RopeSpec no_rope{0, false, 1.f, 1.f};
  if (!half) {
    scatter_heads(fk, kbuf.data<float>(), B, L, hkv, d, rope, offset, periods, cap, write, rp);
    scatter_heads(fv, vbuf.data<float>(), B, L, hkv, d, no_rope, 0, nullptr, cap, write);
  } else {
    scatter_heads(fk, kh, B, L, hkv, d, rope, offset, periods, L, 0, rp);
    scatter_heads(fv, vh, B, L, hkv, d, no_rope, 0, nullptr, L, 0);
    // Rows (b, h, l) of d: this step's positions of each head, to the pool for a prompt.
    parallel_rows((size_t)B * hkv * L, 4 * (size_t)d, [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r) {
        const size_t bh = r / L, l = r % L;
        const size_t src = r * d, dst = ((bh * cap + write + l) * d) * sizeof(uint16_t);
        convert_floats(kh + src, mx::float32, kbuf.data<char>() + dst, mx::float16, (size_t)d);
        convert_floats(vh + src, mx::float32, vbuf.data<char>() + dst, mx::float16, (size_t)d);
      }
    });
  }

  // Attention over the buffer's keys [first, write + L) (in order, query l at write + l): all of them, or for a
  // sliding layer each query's last `window` (itself included), as mlx-lm's create_causal_mask(window_size=...).
  SdpaArgs a{};
  a.Hq = hq;
  a.Hkv = hkv;
  a.D = d;
  a.scale = p.attn_scale;
  a.kv_half = half;
  const int64_t qs[3] = {(int64_t)hq * L * d, (int64_t)L * d, d};
  const int64_t ks[3] = {(int64_t)hkv * cap * d, (int64_t)cap * d, d};
  for (int i = 0; i < 3; ++i) {
    a.qs[i] = qs[i];
    a.ks[i] = a.vs[i] = ks[i];
  }
  a.heads_last = true;
  const size_t esize = half ? sizeof(uint16_t) : sizeof(float);
  // One call: causal over [first, write + L), each batch row from its own start (a left-padded batch, first 0),
  // and for a sliding layer each query only its last `window` keys (the kernel's window bound).
  a.B = B;
  a.L = L;
  a.S = write + L - first;
  a.causal = causal && L > 1;
  a.start = starts;
  a.window = p.window > 0 ? p.window : 0;
  a.q = qh;
  a.k = kbuf.data<char>() + (int64_t)first * d * esize;
  a.v = vbuf.data<char>() + (int64_t)first * d * esize;
  a.out = attn;
  sdpa_exec(a);

  // h = x + (norm_ao(o(attn)) | o(attn))
  if (p.at[sAttnOutNorm] >= 0) {
    qmm_float(attn, rows, qd, {qw(in, p, lO, xn)}, gs, bits);
    norm_rows(p, in[p.at[sAttnOutNorm]], xn, h, rows, E, p.eps, wtmp);
  } else {
    qmm_float(attn, rows, qd, {qw(in, p, lO, h)}, gs, bits);
  }
  add_rows(h, xf, rows, E);
  const float* hm = h;  // the MLP's input: norm_m(h), or h itself (OLMo)
  if (p.at[sMlpNorm] >= 0) {
    norm_rows(p, in[p.at[sMlpNorm]], h, xn, rows, E, p.eps, wtmp);
    hm = xn;
  }
  if (fused_gu) {  // Phi-3: gate | up in one projection
    qmm_float(hm, rows, E, {qw(in, p, lGateUp, g)}, gs, bits);  // (rows, 2I) from g on
    act_mul(p.act, g, g + I, act, rows, I, 2 * (size_t)I);
  } else {
    qmm_float(hm, rows, E, {qw(in, p, lGate, g), qw(in, p, lUp, u)}, gs, bits);
    act_mul(p.act, g, u, act, rows, I, I);
  }
  float* y = out.data<float>();
  if (p.at[sMlpOutNorm] >= 0) {
    qmm_float(act, rows, I, {qw(in, p, lDown, xn)}, gs, bits);
    norm_rows(p, in[p.at[sMlpOutNorm]], xn, y, rows, E, p.eps, wtmp);
  } else {
    qmm_float(act, rows, I, {qw(in, p, lDown, y)}, gs, bits);
  }
  add_rows(y, h, rows, E);
}

}  // namespace

void NativeDecoderLayer::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const int n = static_cast<int>(inputs.size());
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  outputs[1].copy_shared_buffer(inputs[n - 2]);  // the same memory, now holding this step's keys
  outputs[2].copy_shared_buffer(inputs[n - 1]);
  for (const auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  std::vector<mx::array> in;
  in.reserve(inputs.size() + held_.size());  // ~25 arrays a layer: one allocation, not a regrowth every power of two
  // The weights (leaves: evaluated, no primitive) go as plain copies, a reference count each; a weak copy is a
  // new array descriptor, and ~23 of them a layer, freed on the stream thread, were ~20% of the Python thread's
  // time in a SmolLM2 decode step. x and the KV buffers (written in place) keep MLX's weak-copy convention.
  // q_scale and starts (a left-padded batch) are not the plan's arrays: they travel apart, read when the op runs.
  const int first_extra = n - 2 - (has_starts_ ? 1 : 0) - (has_q_scale_ ? 1 : 0);
  std::optional<mx::array> starts, q_scale;
  if (has_starts_) starts = mx::array::unsafe_weak_copy(inputs[n - 3]);
  if (has_q_scale_) q_scale = mx::array::unsafe_weak_copy(inputs[first_extra]);
  for (int i = 0; i < n; ++i) {
    if (i == first_extra) in.insert(in.end(), held_.begin(), held_.end());  // held weights: where the plan expects them
    if (i >= first_extra && i < n - 2) continue;
    in.push_back(i > 0 && i < first_extra && !inputs[i].has_primitive() ? inputs[i]
                                                                         : mx::array::unsafe_weak_copy(inputs[i]));
  }
  const LayerPlan plan = plan_by_id(plan_);
  enc.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(outputs[0]), plan, offset = offset_,
                causal = causal_, write = write_, first = first_, starts = std::move(starts),
                q_scale = std::move(q_scale)]() mutable {
    for (int i = 0; i < static_cast<int>(in.size()) - 2; ++i)
      if (!in[i].flags().row_contiguous) in[i] = row_contiguous_copy(in[i]);
    std::vector<int> rows;
    if (starts) {
      rows = row_ints(*starts);
      for (int r : rows)  // a row may be all padding so far (a left-padded prompt chunk), not past this step
        if (r < 0 || r > write + in[0].shape(1))
          throw std::invalid_argument("[mlxinfer_cpu.decoder_layer] a row starts past this step's keys");
    }
    if (q_scale && !q_scale->flags().row_contiguous) *q_scale = row_contiguous_copy(*q_scale);  // e.g. broadcast
    run_layer(in, out, plan, offset, causal, write, first, starts ? rows.data() : nullptr,
              q_scale ? q_scale->data<float>() : nullptr, q_scale ? q_scale->size() : 0);
  });
}

}  // namespace mlxinfer_cpu::layer
