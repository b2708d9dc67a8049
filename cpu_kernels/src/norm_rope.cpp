// RMSNorm and RoPE primitives. MLX's CPU build runs mx.fast.rms_norm / mx.fast.rope as a chain of
// generic ops (~50 / ~75 us per decode call on SmolLM2 shapes); these are one small loop each.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "dispatch.h"
#include "ops.h"
#include "qmm_float.h"
#include "threadpool.h"

namespace mlxinfer_cpu {

void rms_norm_rows(const float* x, const float* w, float* y, size_t rows, int D, float eps) {
  parallel_rows(rows, 3 * (size_t)D, [&](size_t r0, size_t r1) {
    for (size_t r = r0; r < r1; ++r) {
      const float* xr = x + r * D;
      // 16 partial sums (a loop the compiler vectorises; one running sum is a serial chain of adds, ~6% of a
      // Gemma 3 prefill with its four norms a layer and its q/k norms).
      float part[16] = {};
      int d = 0;
      for (; d + 16 <= D; d += 16)
        for (int j = 0; j < 16; ++j) part[j] += xr[d + j] * xr[d + j];
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += part[j];
      for (; d < D; ++d) ss += xr[d] * xr[d];
      const float inv = 1.f / std::sqrt(ss / D + eps);
      for (int d = 0; d < D; ++d) y[r * D + d] = w[d] * (xr[d] * inv);
    }
  });
}

void rope_table(int L, int half, float base, float scale, int offset, const float* periods, std::vector<float>& cs,
                std::vector<float>& sn) {
  cs.resize((size_t)L * half);
  sn.resize((size_t)L * half);
  for (int l = 0; l < L; ++l)
    for (int i = 0; i < half; ++i) {
      // As MLX: freq_i = base^(-i / half) or 1 / periods[i], theta = (offset + l) * scale * freq_i.
      const float freq = periods ? 1.f / periods[i] : std::exp(-static_cast<float>(i) * (std::log(base) / half));
      const float theta = static_cast<float>(offset + l) * scale * freq;
      cs[(size_t)l * half + i] = std::cos(theta);
      sn[(size_t)l * half + i] = std::sin(theta);
    }
}

void rope_row(const float* x, float* y, int D, int dims, bool traditional, const float* c, const float* s) {
  const int half = dims / 2;
  for (int i = 0; i < half; ++i) {
    const int a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
    const float x1 = x[a], x2 = x[b];
    y[a] = x1 * c[i] - x2 * s[i];
    y[b] = x1 * s[i] + x2 * c[i];
  }
  for (int d = dims; d < D; ++d) y[d] = x[d];
}

namespace {
// The last few RoPE tables made on this thread: every layer of a step rotates q and k at the same positions, so
// one table serves them all (a step's first layer makes it; Gemma 3's two bases keep two).
struct RopeTable {
  int L = -1, half = 0, offset = 0;
  float base = 0.f, scale = 0.f;
  std::vector<float> periods, cs, sn;
};

const RopeTable& cached_rope_table(int L, int half, float base, float scale, int offset, const float* periods) {
  thread_local RopeTable tables[4];
  thread_local int next = 0;
  for (const RopeTable& t : tables)
    if (t.L == L && t.half == half && t.offset == offset && t.base == base && t.scale == scale &&
        (periods ? t.periods.size() == (size_t)half && std::memcmp(t.periods.data(), periods, half * sizeof(float)) == 0
                 : t.periods.empty()))
      return t;
  RopeTable& t = tables[next];
  next = (next + 1) % 4;
  t.L = -1;  // not a match while being filled
  rope_table(L, half, base, scale, offset, periods, t.cs, t.sn);
  if (periods)
    t.periods.assign(periods, periods + half);
  else
    t.periods.clear();
  t.half = half;
  t.offset = offset;
  t.base = base;
  t.scale = scale;
  t.L = L;
  return t;
}
}  // namespace

void scatter_heads(const float* flat, float* out, int B, int L, int H, int D, const RopeSpec& rope, int offset,
                   const float* periods, int cap, int pos0, const int* row_offsets) {
  const int half = rope.dims / 2;
  // Rows (b, l) go to the pool for a prompt (each writes its own H heads), a decode row is done inline.
  auto rows = [&](int b, const RopeTable* t, size_t l0, size_t l1) {
    for (size_t l = l0; l < l1; ++l)
      for (int h = 0; h < H; ++h)
        rope_row(flat + ((size_t)(b * L + l) * H + h) * D, out + (((size_t)b * H + h) * cap + pos0 + l) * D, D,
                 rope.dims, rope.traditional, t ? t->cs.data() + l * half : nullptr,
                 t ? t->sn.data() + l * half : nullptr);
  };
  const size_t cost = (size_t)H * D;
  if (!row_offsets) {
    const RopeTable* t = half > 0 ? &cached_rope_table(L, half, rope.base, rope.scale, offset, periods) : nullptr;
    parallel_rows((size_t)B * L, cost, [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1;) {  // rows of one b at a time
        const int b = static_cast<int>(r / L);
        const size_t end = std::min(r1, (size_t)(b + 1) * L);
        rows(b, t, r - (size_t)b * L, end - (size_t)b * L);
        r = end;
      }
    });
    return;
  }
  for (int b = 0; b < B; ++b) {
    // A left-padded batch: each row at its own position (padding rows go negative, as in mx.fast.rope).
    const RopeTable* t =
        half > 0 ? &cached_rope_table(L, half, rope.base, rope.scale, row_offsets[b], periods) : nullptr;
    parallel_rows((size_t)L, cost, [&](size_t l0, size_t l1) { rows(b, t, l0, l1); });
  }
}

std::vector<int> row_ints(const mx::array& a) {
  std::vector<int> out(a.size());
  switch (a.dtype()) {
    case mx::int32: for (size_t i = 0; i < out.size(); ++i) out[i] = a.data<int32_t>()[i]; break;
    case mx::int64: for (size_t i = 0; i < out.size(); ++i) out[i] = (int)a.data<int64_t>()[i]; break;
    case mx::uint32: for (size_t i = 0; i < out.size(); ++i) out[i] = (int)a.data<uint32_t>()[i]; break;
    case mx::int16: for (size_t i = 0; i < out.size(); ++i) out[i] = a.data<int16_t>()[i]; break;
    default: throw std::invalid_argument("[mlxinfer_cpu] positions must be int16, int32, int64 or uint32");
  }
  return out;
}

mx::array rms_normed(const mx::array& x, const mx::array& w, float eps) {
  mx::array y(x.shape(), mx::float32, nullptr, {});
  y.set_data(mx::allocator::malloc(y.nbytes()));
  const int D = x.shape(-1);
  rms_norm_rows(x.data<float>(), w.data<float>(), y.data<float>(), x.size() / D, D, eps);
  return y;
}

namespace {

class NativeRmsNorm : public mx::UnaryPrimitive {
 public:
  NativeRmsNorm(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const float eps = eps_;
    dispatch_contiguous(stream(), inputs, out, [eps](std::vector<mx::array>& in, mx::array& o) {
      const int D = in[0].shape(-1);
      rms_norm_rows(in[0].data<float>(), in[1].data<float>(), o.data<float>(), in[0].size() / D, D, eps);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer_cpu] rms_norm runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const NativeRmsNorm*>(&other);
    return o && o->eps_ == eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_;
};

class NativeRope : public mx::UnaryPrimitive {
 public:
  NativeRope(mx::Stream s, int dims, bool traditional, float base, float scale, int offset)
      : mx::UnaryPrimitive(s), dims_(dims), traditional_(traditional), base_(base), scale_(scale), offset_(offset) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const int dims = dims_, offset = offset_;
    const bool trad = traditional_;
    const float base = base_, scale = scale_;
    dispatch_contiguous(stream(), inputs, out, [=](std::vector<mx::array>& in, mx::array& o) {
      // x (..., L, D): position of row l is offset + l; with a 2nd input offsets (B,), x (B, ..., L, D) and
      // batch row b starts at offsets[b].
      const int D = in[0].shape(-1), L = in[0].shape(-2);
      const size_t mats = in[0].size() / ((size_t)L * D);
      std::vector<int> starts;
      if (in.size() > 1) starts = row_ints(in[1]);
      const size_t per_row = starts.empty() ? mats : mats / starts.size();
      std::vector<float> cs, sn;
      const float* x = in[0].data<float>();
      float* y = o.data<float>();
      for (size_t m = 0; m < mats; ++m) {
        if (m % per_row == 0 && (m == 0 || !starts.empty()))
          rope_table(L, dims / 2, base, scale, starts.empty() ? offset : starts[m / per_row], nullptr, cs, sn);
        for (int l = 0; l < L; ++l)
          rope_row(x + (m * L + l) * D, y + (m * L + l) * D, D, dims, trad, cs.data() + (size_t)l * (dims / 2),
                   sn.data() + (size_t)l * (dims / 2));
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer_cpu] rope runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const NativeRope*>(&other);
    return o && o->dims_ == dims_ && o->traditional_ == traditional_ && o->base_ == base_ && o->scale_ == scale_ &&
           o->offset_ == offset_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  int offset_;
};

}  // namespace

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 || weight.ndim() != 1 ||
      weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("[mlxinfer_cpu.rms_norm] float32 x (..., D) and weight (D,) expected");
  return mx::array(x.shape(), mx::float32, std::make_shared<NativeRmsNorm>(mx::to_stream({}, mx::Device::cpu), eps),
                   {x, weight});
}

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, int offset,
               const std::optional<mx::array>& offsets) {
  if (x.dtype() != mx::float32 || x.ndim() < 2 || dims <= 0 || dims % 2 || dims > x.shape(-1))
    throw std::invalid_argument("[mlxinfer_cpu.rope] float32 x (..., L, D) and an even dims <= D expected");
  std::vector<mx::array> inputs = {x};
  if (offsets) {
    if (x.ndim() < 3 || offsets->ndim() != 1 || offsets->shape(0) != x.shape(0) ||
        !mx::issubdtype(offsets->dtype(), mx::integer))
      throw std::invalid_argument("[mlxinfer_cpu.rope] offsets must be an integer array (B,) for x (B, ..., L, D)");
    inputs.push_back(*offsets);
  }
  // Same primitive with or without offsets: is_equivalent compares inputs too, and the int offset is then 0.
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<NativeRope>(mx::to_stream({}, mx::Device::cpu), dims, traditional, base, scale,
                                                offsets ? 0 : offset),
                   std::move(inputs));
}

}  // namespace mlxinfer_cpu
