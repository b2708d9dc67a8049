// The QuantizedEmbedding primitive: token ids -> dequantized float32 rows. MLX composes
// nn.QuantizedEmbedding as three gathers and a dequantize, ~30 small CPU ops per decode step.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "dispatch.h"
#include "ops.h"
#include "qmm_kernels.h"

namespace mlxinfer_cpu {

namespace {

// Scales/biases of one table row as float32 (they are float32, float16 or bfloat16: the stored dtype is kept on
// the CPU so that a decode step reads fewer bytes).
void scale_row(const mx::array& a, int64_t row, int ng, float* dst) {
  const size_t off = (size_t)row * ng;
  switch (a.dtype()) {
    case mx::float32: std::memcpy(dst, a.data<float>() + off, (size_t)ng * sizeof(float)); break;
    case mx::float16: for (int g = 0; g < ng; ++g) dst[g] = static_cast<float>(a.data<mx::float16_t>()[off + g]); break;
    default: for (int g = 0; g < ng; ++g) dst[g] = static_cast<float>(a.data<mx::bfloat16_t>()[off + g]); break;
  }
}

// Row t of a table in row tiles (qmm_vnni_tiled.cpp: tile t / 16 holds each word of its 16 rows side by side, bytes
// 1 and 2 swapped; scales/biases side by side per group) back in MLX's layout: words into wr, scales into sr/br.
// tmp: scratch for one tile's scales (ng * 16 floats).
void untile_row(const uint8_t* w, const mx::array& s, const mx::array& b, int64_t t, int K, int bits, int ng,
                uint32_t* wr, float* sr, float* br, std::vector<float>& tmp) {
  const int nw = K * bits / 32, lane = static_cast<int>(t % kTileRows);
  const int64_t tile = t / kTileRows;
  const auto* words = reinterpret_cast<const uint32_t*>(w);
  for (int j = 0; j < nw; ++j) {
    const uint32_t v = words[((size_t)tile * nw + j) * kTileRows + lane];
    wr[j] = (v & 0xFF0000FFu) | ((v & 0x0000FF00u) << 8) | ((v >> 8) & 0x0000FF00u);
  }
  tmp.resize((size_t)ng * kTileRows);  // the tile's values of every group (16 each), then this row's
  scale_row(s, tile, ng * kTileRows, tmp.data());
  for (int g = 0; g < ng; ++g) sr[g] = tmp[(size_t)g * kTileRows + lane];
  scale_row(b, tile, ng * kTileRows, tmp.data());
  for (int g = 0; g < ng; ++g) br[g] = tmp[(size_t)g * kTileRows + lane];
}

template <typename T>
void gather_rows(const mx::array& ids, const uint8_t* w, const mx::array& s, const mx::array& b, float* out, int K,
                 int V, int group_size, int bits, bool tiled) {
  const T* id = ids.data<T>();
  const size_t row_bytes = (size_t)K * bits / 8;
  const int ng = K / group_size;
  std::vector<float> sr(ng), br(ng);
  std::vector<uint32_t> words(tiled ? K * bits / 32 : 0);
  std::vector<float> tile_scales;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t t = static_cast<int64_t>(id[i]);
    float* o = out + i * K;
    if (t < 0 || t >= V) {  // as a gather would not, but never read outside the table
      for (int k = 0; k < K; ++k) o[k] = 0.f;
      continue;
    }
    const uint8_t* wr = w + t * row_bytes;
    if (tiled) {
      untile_row(w, s, b, t, K, bits, ng, words.data(), sr.data(), br.data(), tile_scales);
      wr = reinterpret_cast<const uint8_t*>(words.data());
    } else {
      scale_row(s, t, ng, sr.data());
      scale_row(b, t, ng, br.data());
    }
    for (int k = 0; k < K; ++k) {
      // MLX's affine layout: element k at bits [bits * (k % (32 / bits)), ...) of little-endian word k / (32 / bits).
      const int q = bits == 4 ? (wr[k >> 1] >> ((k & 1) * 4)) & 0xF : wr[k];
      o[k] = sr[k / group_size] * static_cast<float>(q) + br[k / group_size];
    }
  }
}

class NativeQuantizedEmbedding : public mx::UnaryPrimitive {
 public:
  NativeQuantizedEmbedding(mx::Stream s, int group_size, int bits, bool tiled)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits), tiled_(tiled) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const int gs = group_size_, bits = bits_;
    const bool tiled = tiled_;
    dispatch_contiguous(stream(), inputs, out, [gs, bits, tiled](std::vector<mx::array>& in, mx::array& o) {
      const int V = in[1].shape(0), K = in[1].shape(1) * 32 / bits;
      const auto* w = reinterpret_cast<const uint8_t*>(in[1].data<uint32_t>());
      const mx::array &s = in[2], &b = in[3];
      float* y = o.data<float>();
      switch (in[0].dtype()) {
        case mx::int32: return gather_rows<int32_t>(in[0], w, s, b, y, K, V, gs, bits, tiled);
        case mx::uint32: return gather_rows<uint32_t>(in[0], w, s, b, y, K, V, gs, bits, tiled);
        case mx::int64: return gather_rows<int64_t>(in[0], w, s, b, y, K, V, gs, bits, tiled);
        default: return gather_rows<uint64_t>(in[0], w, s, b, y, K, V, gs, bits, tiled);
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer_cpu] quantized_embedding runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferQuantizedEmbedding"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const NativeQuantizedEmbedding*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->tiled_ == tiled_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.push_back(inputs[1].shape(1) * 32 / bits_);
    return {s};
  }

 private:
  int group_size_, bits_;
  bool tiled_;
};

}  // namespace

mx::array quantized_embedding(const mx::array& ids, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits, bool tiled) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("[mlxinfer_cpu.quantized_embedding] " + msg); };
  if (ids.dtype() != mx::int32 && ids.dtype() != mx::uint32 && ids.dtype() != mx::int64 && ids.dtype() != mx::uint64)
    fail("ids must be int32, uint32, int64 or uint64");
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128) fail("group_size must be 32, 64 or 128");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) fail("w must be a 2-D uint32 array");
  const int K = w.shape(1) * 32 / bits;
  if ((scales.dtype() != mx::float32 && scales.dtype() != mx::float16 && scales.dtype() != mx::bfloat16) ||
      biases.dtype() != scales.dtype())
    fail("scales and biases must share a float dtype (float32, float16 or bfloat16)");
  if (scales.ndim() != 2 || scales.shape(0) != w.shape(0) || scales.shape(1) != K / group_size ||
      biases.shape() != scales.shape())
    fail("scales/biases must have shape (vocab, dim / group_size)");
  if (tiled && w.shape(0) % kTileRows != 0) fail("a tiled table has a multiple of 16 rows");
  mx::Shape shape = ids.shape();
  shape.push_back(K);
  return mx::array(shape, mx::float32,
                   std::make_shared<NativeQuantizedEmbedding>(mx::to_stream({}, mx::Device::cpu), group_size, bits,
                                                              tiled),
                   {ids, w, scales, biases});
}

}  // namespace mlxinfer_cpu
