// The KvAppend primitive: write this step's keys/values into the preallocated KV-cache buffers. mlx-lm's
// KVCache.update_and_fetch spends 4 MLX ops per layer and step on it (two slice updates, two slices); this is two
// (keys, values), and the attention then reads the buffers up to the valid length (sdpa's kv_len), not slices.
// Like MLX's own SliceUpdate, the outputs take over the input buffers when nothing else references them, so the
// cache is updated in place; otherwise the buffers are copied first. kv_reserve makes the fresh buffers that
// decoder_layer (layer.cpp) writes into.
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

namespace mlxinfer_cpu {

namespace {

// One buffer (keys or values) per op: a multi-output primitive would hold its inputs once per output, and an
// input referenced twice is never donatable.
class NativeKvWrite : public mx::UnaryPrimitive {
 public:
  NativeKvWrite(mx::Stream s, int offset) : mx::UnaryPrimitive(s), offset_(offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    const auto& buf = inputs[0];
    const bool copy = !(buf.is_donatable() && buf.flags().row_contiguous && buf.data_size() == buf.size());
    if (copy) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    } else {
      out.copy_shared_buffer(buf);
    }
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([buf = mx::array::unsafe_weak_copy(inputs[0]), upd = mx::array::unsafe_weak_copy(inputs[1]),
                  out = mx::array::unsafe_weak_copy(out), copy, offset = offset_]() mutable {
      if (copy) {
        if (!buf.flags().row_contiguous) buf = row_contiguous_copy(buf);
        std::memcpy(out.data<char>(), buf.data<char>(), out.nbytes());
      }
      if (!upd.flags().row_contiguous) upd = row_contiguous_copy(upd);
      // upd (B, H, L, D) -> out[b, h, offset:offset + L, :] of (B, H, capacity, D), converted to out's dtype
      const int B = upd.shape(0), H = upd.shape(1), L = upd.shape(2), D = upd.shape(3), cap = out.shape(2);
      const size_t ui = upd.itemsize(), oi = out.itemsize();
      const char* src = upd.data<char>();
      char* dst = out.data<char>();
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
          convert_floats(src + ((size_t)b * H + h) * L * D * ui, upd.dtype(),
                         dst + (((size_t)b * H + h) * cap + offset) * D * oi, out.dtype(), (size_t)L * D);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer_cpu] kv_append runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferKvWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const NativeKvWrite*>(&other);
    return o && o->offset_ == offset_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int offset_;
};

// A fresh buffer for decoder_layer's in-place KV writes: never a view, never another array's donated buffer.
class NativeKvReserve : public mx::UnaryPrimitive {
 public:
  NativeKvReserve(mx::Stream s, int valid) : mx::UnaryPrimitive(s), valid_(valid) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const int valid = valid_;
    dispatch_contiguous(stream(), inputs, out, [valid](std::vector<mx::array>& in, mx::array& o) {
      std::memset(o.data<char>(), 0, o.nbytes());
      if (in.empty() || valid == 0) return;
      // src (B, H, S, D) positions [0, valid) -> o (B, H, capacity, D), converted to o's dtype
      const int B = o.shape(0), H = o.shape(1), cap = o.shape(2), D = o.shape(3), S = in[0].shape(2);
      const size_t oi = o.itemsize(), si = in[0].itemsize();
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
          convert_floats(in[0].data<char>() + ((size_t)b * H + h) * S * D * si, in[0].dtype(),
                         o.data<char>() + ((size_t)b * H + h) * cap * D * oi, o.dtype(), (size_t)valid * D);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer_cpu] kv_reserve runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferKvReserve"; }
  // Never merged with another node (mx.compile's common-subexpression pass): every buffer must be its own memory.
  bool is_equivalent(const mx::Primitive& other) const override { return this == &other; }

 private:
  int valid_;
};

}  // namespace

void convert_floats(const void* src, mx::Dtype st, void* dst, mx::Dtype dt, size_t n) {
  if (st == dt) {
    std::memcpy(dst, src, n * mx::size_of(st));
  } else if (st == mx::float32) {  // -> float16
    const float* s = static_cast<const float*>(src);
    auto* d = static_cast<mx::float16_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<mx::float16_t>(s[i]);
  } else {  // float16 -> float32
    const auto* s = static_cast<const mx::float16_t*>(src);
    float* d = static_cast<float*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<float>(s[i]);
  }
}

mx::array kv_reserve(const std::vector<int>& shape, const std::optional<mx::array>& src, int valid, bool half) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("[mlxinfer_cpu.kv_reserve] " + msg); };
  if (shape.size() != 4 || shape[0] < 1 || shape[1] < 1 || shape[2] < 1 || shape[3] < 1)
    fail("shape must be (B, heads, capacity, dim), all positive");
  if (valid < 0 || valid > shape[2]) fail("valid must be within the capacity");
  std::vector<mx::array> inputs;
  if (src) {
    if (src->ndim() != 4 || (src->dtype() != mx::float32 && src->dtype() != mx::float16))
      fail("src must be a float32 or float16 (B, heads, len, dim) array");
    if (src->shape(0) != shape[0] || src->shape(1) != shape[1] || src->shape(3) != shape[3] || src->shape(2) < valid)
      fail("src does not match the shape or holds fewer than `valid` positions");
    inputs.push_back(*src);
  } else if (valid != 0) {
    fail("valid > 0 needs src");
  }
  return mx::array(mx::Shape(shape.begin(), shape.end()), half ? mx::float16 : mx::float32,
                   std::make_shared<NativeKvReserve>(mx::to_stream({}, mx::Device::cpu), valid), std::move(inputs));
}

std::vector<mx::array> kv_append(const mx::array& k_buf, const mx::array& v_buf, const mx::array& k,
                                 const mx::array& v, int offset) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("[mlxinfer_cpu.kv_append] " + msg); };
  for (const auto* a : {&k_buf, &v_buf, &k, &v})
    if (a->ndim() != 4 || (a->dtype() != mx::float32 && a->dtype() != mx::float16))
      fail("float32 or float16 4-D (B, heads, len, dim) arrays expected");
  if (k_buf.dtype() != v_buf.dtype()) fail("key and value buffers differ in dtype");
  for (int d : {0, 1, 3})
    if (k.shape(d) != k_buf.shape(d) || v.shape(d) != v_buf.shape(d)) fail("new keys/values do not match the cache");
  if (k.shape(2) != v.shape(2) || k_buf.shape(2) != v_buf.shape(2)) fail("keys and values differ in length");
  if (offset < 0 || offset + k.shape(2) > k_buf.shape(2)) fail("no room in the cache buffer at this offset");
  const auto s = mx::to_stream({}, mx::Device::cpu);
  return {mx::array(k_buf.shape(), k_buf.dtype(), std::make_shared<NativeKvWrite>(s, offset), {k_buf, k}),
          mx::array(v_buf.shape(), v_buf.dtype(), std::make_shared<NativeKvWrite>(s, offset), {v_buf, v})};
}

}  // namespace mlxinfer_cpu
