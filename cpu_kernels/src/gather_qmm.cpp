// gather_qmm: mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True) for a stack of affine-quantized
// expert weights (mlx-lm's QuantizedSwitchLinear: the experts of a mixture-of-experts MLP). MLX's CPU gather_qmm
// runs at ~0.5 GB/s (Qwen3-MoE's 768 x 2048 experts, top-8 of 128: 12.9 ms a matrix a token); here each expert's
// rows go through the same quantized-matmul driver as every other projection (qmm_float: the ISA's decode matvec
// for a few rows, its prefill GEMM for many).
//
// x (..., M, K) float32 and indices (...) broadcast against each other's batch dims; output batch element b is
// x[b] (M, K) @ dequant(w[indices[b]]).T -> (..., M, N). Work is grouped by expert (each expert's weights are read
// once per call, its x rows gathered into one block), and experts whose gathered rows are the same x rows (a
// decode step's gate and up: every chosen expert sees the token's one x row) share one x preparation and one
// pool job.
#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "mlx/primitives.h"
#include "ops.h"
#include "qmm_float.h"

namespace mlxinfer_cpu {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("[mlxinfer_cpu.gather_qmm] " + msg); }

class NativeGatherQmm : public mx::UnaryPrimitive {
 public:
  NativeGatherQmm(mx::Stream s, int group_size, int bits)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer_cpu] gather_qmm runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferGatherQmm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const NativeGatherQmm*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_;
  }

 private:
  int group_size_, bits_;
};

// Row-major strides of `shape` right-aligned to `rank` dims, 0 where the dim is 1 or absent (broadcast).
std::vector<size_t> broadcast_strides(const mx::Shape& shape, size_t rank) {
  std::vector<size_t> st(rank, 0);
  size_t s = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const size_t d = shape.size() - 1 - i;  // from the last dim
    st[rank - 1 - i] = shape[d] == 1 ? 0 : s;
    s *= shape[d];
  }
  return st;
}

void run_gather(const std::vector<mx::array>& in, mx::array& out, int gs, int bits) {
  const mx::array &x = in[0], &w = in[1], &scales = in[2], &biases = in[3], &indices = in[4];
  const int M = x.shape(-2), K = x.shape(-1), E = w.shape(0), N = w.shape(1);
  const mx::Shape xb(x.shape().begin(), x.shape().end() - 2);
  const mx::Shape ob(out.shape().begin(), out.shape().end() - 2);
  const size_t rank = ob.size();
  const std::vector<size_t> xs = broadcast_strides(xb, rank), is = broadcast_strides(indices.shape(), rank);
  const std::vector<int> experts = row_ints(indices);
  size_t n_out = 1;
  for (int d : ob) n_out *= d;

  // Each output batch element: its expert and the x batch element it reads.
  std::vector<std::vector<std::pair<int, int>>> by_expert(E);  // expert -> (output element, x element)
  std::vector<int> pos(rank, 0);
  for (size_t o = 0; o < n_out; ++o) {
    size_t x_src = 0, i_src = 0;
    for (size_t d = 0; d < rank; ++d) {
      x_src += pos[d] * xs[d];
      i_src += pos[d] * is[d];
    }
    const int e = experts[i_src];
    if (e < 0 || e >= E) throw std::out_of_range("[mlxinfer_cpu.gather_qmm] expert index out of range");
    by_expert[e].emplace_back(static_cast<int>(o), static_cast<int>(x_src));
    for (int d = static_cast<int>(rank) - 1; d >= 0; --d) {  // next multi-index
      if (++pos[d] < ob[d]) break;
      pos[d] = 0;
    }
  }
  // Experts that read the same x elements share one preparation of those rows.
  std::map<std::vector<int>, std::vector<int>> groups;
  for (int e = 0; e < E; ++e) {
    if (by_expert[e].empty()) continue;
    std::vector<int> key;
    for (const auto& p : by_expert[e]) key.push_back(p.second);
    groups[key].push_back(e);
  }
  const float* xf = x.data<float>();
  float* y = out.data<float>();
  thread_local std::vector<float> xbuf, obuf;
  for (const auto& [srcs, group] : groups) {
    const int rows = static_cast<int>(srcs.size()) * M;
    xbuf.resize((size_t)rows * K);
    for (size_t j = 0; j < srcs.size(); ++j)  // x element srcs[j]: M rows (M, K)
      std::memcpy(xbuf.data() + j * M * K, xf + (size_t)srcs[j] * M * K, sizeof(float) * M * K);
    obuf.resize((size_t)group.size() * rows * N);
    std::vector<QWeight> ws;
    for (size_t g = 0; g < group.size(); ++g)
      ws.push_back({&w, &scales, &biases, obuf.data() + g * rows * N, group[g]});
    qmm_float(xbuf.data(), rows, K, ws, gs, bits);
    for (size_t g = 0; g < group.size(); ++g) {
      const auto& pairs = by_expert[group[g]];
      for (size_t j = 0; j < pairs.size(); ++j)  // rows j*M.. of this expert's result -> output element pairs[j]
        std::memcpy(y + (size_t)pairs[j].first * M * N, obuf.data() + (g * rows + j * M) * N, sizeof(float) * M * N);
    }
  }
}

void NativeGatherQmm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const int gs = group_size_, bits = bits_;
  dispatch_contiguous(stream(), inputs, out,
                      [gs, bits](std::vector<mx::array>& in, mx::array& o) { run_gather(in, o, gs, bits); });
}

}  // namespace

mx::array gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     const mx::array& indices, int group_size, int bits) {
  if (x.dtype() != mx::float32 || x.ndim() < 2) fail("x must be float32 (..., M, K)");
  const int N = check_quantized_weight(x.shape(-1), w, scales, biases, group_size, bits, "gather_qmm", true);
  if (x.shape(-1) % group_size) fail("K must be a multiple of group_size");
  if (!mx::issubdtype(indices.dtype(), mx::integer)) fail("indices must be integers");
  const mx::Shape xb(x.shape().begin(), x.shape().end() - 2);
  mx::Shape shape;
  try {
    shape = mx::broadcast_shapes(xb, indices.shape());
  } catch (const std::invalid_argument&) {
    fail("x's batch dims and indices do not broadcast");
  }
  shape.push_back(x.shape(-2));
  shape.push_back(N);
  return mx::array(shape, mx::float32,
                   std::make_shared<NativeGatherQmm>(mx::to_stream({}, mx::Device::cpu), group_size, bits),
                   {x, w, scales, biases, indices});
}

}  // namespace mlxinfer_cpu
