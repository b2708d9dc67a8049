// The Sdpa primitive: scaled-dot-product attention (decode and causal prefill) on the CPU stream.
#include <algorithm>
#include <cmath>
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
#include "threadpool.h"

namespace mlxinfer_cpu {

namespace {

class NativeSdpa : public mx::UnaryPrimitive {
 public:
  NativeSdpa(mx::Stream s, float scale, bool causal, bool heads_last, int kv_len, bool has_start)
      : mx::UnaryPrimitive(s), scale_(scale), causal_(causal), heads_last_(heads_last), kv_len_(kv_len),
        has_start_(has_start) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer_cpu] sdpa runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferSdpa"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const NativeSdpa*>(&other);
    return o && o->scale_ == scale_ && o->causal_ == causal_ && o->heads_last_ == heads_last_ &&
           o->kv_len_ == kv_len_ && o->has_start_ == has_start_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  bool causal_;
  bool heads_last_;
  int kv_len_;
  bool has_start_;  // a 4th input (B,) integer: the first key each batch row sees (a left-padded batch)
};

void run_sdpa(const mx::array& q, const mx::array& k, const mx::array& v, mx::array& out, float scale,
              bool causal, bool heads_last, int kv_len, const int* start = nullptr) {
  SdpaArgs a{};
  a.start = start;
  a.heads_last = heads_last;
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.L = q.shape(2);
  a.D = q.shape(3);
  a.Hkv = k.shape(1);
  a.S = kv_len >= 0 ? kv_len : k.shape(2);
  a.scale = scale;
  a.causal = causal;
  a.q = q.data<float>();
  a.k = k.data<void>();
  a.v = v.data<void>();
  a.kv_half = k.dtype() == mx::float16;
  for (int d = 0; d < 3; ++d) {
    a.qs[d] = q.strides()[d];
    a.ks[d] = k.strides()[d];
    a.vs[d] = v.strides()[d];
  }
  a.out = out.data<float>();
  sdpa_exec(a);
}

}  // namespace

void sdpa_exec(const SdpaArgs& a) {
  const SdpaFn fn = select_sdpa();
  SpinPool& pool = SpinPool::get();
  const int threads = pool.size();
  // A unit (see attn_impl.inc) is one kv head with all its query heads at nq query positions: K/V are read
  // once for its group * nq rows. Decode (small L) takes every position in one unit; prefill cuts L into
  // blocks of about 48 rows so that causal blocks (longer towards the end) balance over the threads.
  const int group = a.Hq / a.Hkv;
  const int nq = std::max(1, std::min({a.L, std::max(1, 48 / group), 4095}));
  const int units = a.B * a.Hkv * ((a.L + nq - 1) / nq);
  // Split-K for decode when there are too few units for the threads: each task takes a range of at least
  // 128 keys and the partial (max, sum, output) are combined below.
  int nsplit = 1;
  if (threads > 1 && units < 4 * threads) nsplit = std::max(1, std::min((8 * threads + units - 1) / units, a.S / 128));
  const int rows = a.B * a.Hq * a.L;
  const int plan = nq | (nsplit << 12);
  if (nsplit == 1) {
    pool.run(units, [&](int t, int) { fn(a, t, plan); });
    return;
  }
  thread_local std::vector<float> scratch;
  scratch.resize((size_t)nsplit * rows * (a.D + 2));
  SdpaArgs sa = a;
  sa.out = scratch.data();
  pool.run(units * nsplit, [&](int t, int) { fn(sa, t, plan); });
  const float* part = scratch.data();
  const float* ml = part + (size_t)nsplit * rows * a.D;
  const int D = a.D;
  for (int g = 0; g < rows; ++g) {
    float m = -INFINITY;
    for (int s = 0; s < nsplit; ++s) m = std::max(m, ml[((size_t)s * rows + g) * 2]);
    // Flattened row g = (b * Hq + h) * L + i.
    float* o = a.out + a.out_row(g / (a.Hq * a.L), (g / a.L) % a.Hq, g % a.L);
    for (int d = 0; d < D; ++d) o[d] = 0.f;
    float l = 0.f;
    for (int s = 0; s < nsplit; ++s) {
      const float ms = ml[((size_t)s * rows + g) * 2];
      if (ms == -INFINITY) continue;  // split saw no key of this row
      const float w = std::exp(ms - m);
      l += w * ml[((size_t)s * rows + g) * 2 + 1];
      const float* src = part + ((size_t)s * rows + g) * D;
      for (int d = 0; d < D; ++d) o[d] += w * src[d];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int d = 0; d < D; ++d) o[d] *= inv;
  }
}

namespace {

void NativeSdpa::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  std::vector<mx::array> in;
  for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  enc.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out), scale = scale_, causal = causal_,
                heads_last = heads_last_, kv_len = kv_len_, has_start = has_start_]() mutable {
    // The kernel reads any strides (a KV-cache slice, a transposed q) as long as the last is 1.
    for (auto& a : in)
      if (a.strides().back() != 1) a = row_contiguous_copy(a);
    std::vector<int> start;
    if (has_start) start = row_ints(in[3]);
    run_sdpa(in[0], in[1], in[2], out, scale, causal, heads_last, kv_len, has_start ? start.data() : nullptr);
  });
}

}  // namespace

mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
               bool heads_last, int kv_len, const std::optional<mx::array>& start) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("[mlxinfer_cpu.sdpa] " + msg); };
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) fail("q, k, v must be 4-D (B, heads, len, dim)");
  if (q.dtype() != mx::float32 || (k.dtype() != mx::float32 && k.dtype() != mx::float16) || v.dtype() != k.dtype())
    fail("float32 q, float32 or float16 k and v");
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3)) fail("shape mismatch");
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) fail("query heads must be a multiple of kv heads");
  if (q.shape(3) > 1024) fail("head dim > 1024");
  if (kv_len > k.shape(2)) fail("kv_len exceeds the keys' length");
  const int S = kv_len >= 0 ? kv_len : k.shape(2);
  if (S == 0) fail("no keys");
  if (causal && q.shape(2) > S) fail("causal needs L <= S");
  std::vector<mx::array> inputs = {q, k, v};
  if (start) {
    if (start->ndim() != 1 || start->shape(0) != q.shape(0) || !mx::issubdtype(start->dtype(), mx::integer))
      fail("start must be an integer array (B,)");
    inputs.push_back(*start);
  }
  // heads_last: (B, L, Hq * D), the layout o_proj takes (rows of (B, L, Hq, D) are the same memory).
  const mx::Shape shape = heads_last ? mx::Shape{q.shape(0), q.shape(2), q.shape(1) * q.shape(3)} : q.shape();
  return mx::array(shape, mx::float32,
                   std::make_shared<NativeSdpa>(mx::to_stream({}, mx::Device::cpu), scale, causal, heads_last, kv_len,
                                                start.has_value()),
                   std::move(inputs));
}

}  // namespace mlxinfer_cpu
