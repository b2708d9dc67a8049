// Python module `_mlxinfer_cpu`. Import mlx.core first: it registers mx.array with nanobind
// (shared NB_DOMAIN mlx) and loads libmlx.so.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>

#include "mlx/version.h"
#include "ops.h"
#include "qmm_kernels.h"
#include "threadpool.h"

namespace nb = nanobind;
using namespace nb::literals;

#define MLXINFER_STR2(x) #x
#define MLXINFER_STR(x) MLXINFER_STR2(x)

NB_MODULE(_mlxinfer_cpu, m) {
  m.doc() = "mlxinfer native CPU kernels (MLX custom primitives)";
  m.def("quantized_matmul", &mlxinfer_cpu::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        nb::kw_only(), "group_size"_a, "bits"_a, "residual"_a = nb::none(), "tiled"_a = false,
        "symmetric"_a = false,
        "Affine quantized x @ w.T on the CPU stream, as mx.quantized_matmul(transpose=True), + residual if given; "
        "tiled: the weight is in row tiles (mlxinfer.kernels.tiling); symmetric: the caller promises biases == "
        "-2**(bits-1) * scales exactly (tiled decode then reads no biases).");
  m.def("gather_qmm", &mlxinfer_cpu::gather_qmm, "x"_a, "w"_a, "scales"_a, "biases"_a, "indices"_a, nb::kw_only(),
        "group_size"_a, "bits"_a,
        "mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True) for affine-quantized experts "
        "(float32 x), on the CPU stream.");
  m.def("swiglu", &mlxinfer_cpu::swiglu, "x"_a, "wg"_a, "sg"_a, "bg"_a, "wu"_a, "su"_a, "bu"_a, nb::kw_only(),
        "group_size"_a, "bits"_a, "norm_weight"_a = nb::none(), "norm_eps"_a = 0.f,
        "silu(x @ Wg.T) * (x @ Wu.T) with both weights quantized (one pass over x); x RMS-normalised first if "
        "norm_weight is given.");
  m.def("sdpa", &mlxinfer_cpu::sdpa, "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a, "causal"_a = false,
        "heads_last"_a = false, "kv_len"_a = -1, "start"_a = nb::none(),
        "float32 attention, as mx.fast.scaled_dot_product_attention with mask None or 'causal'; heads_last: "
        "output (B, L, heads * D); kv_len >= 0: only the first kv_len keys count; start (B,) integer: batch row b "
        "sees no key before start[b] (left padding).");
  m.def("kv_append", &mlxinfer_cpu::kv_append, "k_buf"_a, "v_buf"_a, "k"_a, "v"_a, nb::kw_only(), "offset"_a,
        "Write k/v (B, H, L, D) into the KV-cache buffers at offset; returns the updated [k_buf, v_buf].");
  m.def("rms_norm", &mlxinfer_cpu::rms_norm, "x"_a, "weight"_a, nb::kw_only(), "eps"_a,
        "float32 mx.fast.rms_norm.");
  m.def("rope", &mlxinfer_cpu::rope, "x"_a, nb::kw_only(), "dims"_a, "traditional"_a, "base"_a, "scale"_a,
        "offset"_a, "offsets"_a = nb::none(),
        "float32 mx.fast.rope with an integer offset, or per batch row offsets (B,) (an integer array).");
  m.def("quantized_embedding", &mlxinfer_cpu::quantized_embedding, "ids"_a, "w"_a, "scales"_a, "biases"_a,
        nb::kw_only(), "group_size"_a, "bits"_a, "tiled"_a = false,
        "nn.QuantizedEmbedding lookup: ids -> dequantized float32 rows (tiled: a table in row tiles).");
  m.def("qkv_rope", &mlxinfer_cpu::qkv_rope, "x"_a, "wq"_a, "wk"_a, "wv"_a, nb::kw_only(), "group_size"_a, "bits"_a,
        "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "rope_dims"_a, "traditional"_a, "base"_a, "scale"_a, "offset"_a,
        "norm_weight"_a = nb::none(), "norm_eps"_a = 0.f, "freqs"_a = nb::none(), "offsets"_a = nb::none(),
        "q, k, v projections + head split + RoPE in one op: returns [q (B, Hq, L, D), k, v (B, Hkv, L, D)]; "
        "offsets (B,) integer: per batch row RoPE positions (then offset is unused).");
  m.def("kv_reserve", &mlxinfer_cpu::kv_reserve, "shape"_a, "src"_a = nb::none(), nb::kw_only(), "valid"_a = 0,
        "half"_a = false,
        "A fresh KV-cache buffer (B, heads, capacity, dim), zeros, float32 or float16 (half), holding src's first "
        "`valid` positions.");
  m.def("decoder_layer_plan", &mlxinfer_cpu::decoder_layer_plan, "names"_a, "config"_a,
        "A plan id for decoder_layer: the weights' slot names in the order the arrays will come, and the layer's "
        "numbers (mlxinfer/kernels/spec.py builds both).");
  m.def("decoder_layer", &mlxinfer_cpu::decoder_layer, "x"_a, "arrays"_a, "k_buf"_a, "v_buf"_a, "offset"_a,
        "causal"_a, "plan"_a, "write"_a = -1, "first"_a = 0, "starts"_a = nb::none(), "q_scale"_a = nb::none(),
        "One decoder layer as one op by a decoder_layer_plan; writes this step's keys/values into k_buf/v_buf IN "
        "PLACE (kv_reserve buffers only) at buffer index write (-1: offset, the RoPE position), attending to the "
        "keys [first, write + L); starts (B,) integer: a left-padded batch, row b from key starts[b] (RoPE at "
        "offset - starts[b]); q_scale (L or B*L float32): each query row's factor (plans with q_row_scale). Returns "
        "[y, k_buf', v_buf'].");
  m.def("array_id", [](const mx::array& a) { return reinterpret_cast<std::uintptr_t>(a.id()); }, "a"_a,
        "Identity of the array's descriptor (what Python's `is` cannot see after an in-place __setitem__).");
  m.def("array_handle", [](const mx::array& a) { return a; }, "a"_a,
        "A second Python handle on the same array (it keeps the descriptor alive without being `a`).");
  m.def("set_num_threads", [](int n) { mlxinfer_cpu::SpinPool::get().set_size(n); }, "n"_a);
  m.def("num_threads", [] { return mlxinfer_cpu::SpinPool::get().size(); });
  m.def("set_int8_decode", &mlxinfer_cpu::set_int8_decode, "on"_a,
        "avx2i8 only: round decode x to int8 (True, default) or int16 (False, the avx2 set's precision). Returns "
        "the previous setting.");
  m.def("set_int8_prefill", &mlxinfer_cpu::set_int8_prefill, "on"_a,
        "Sets with the int8 prefill GEMM (avx2, avx2i8, avx512vnni): round prefill x to int8 per 32-block (True; "
        "the start under MLXINFER_PREFILL=int8, whose set name ends in +int8-prefill) or run the precise path "
        "(False, the default: the int16 GEMM on these sets). Returns the previous setting.");
  m.def("has_int8_prefill", [] { return mlxinfer_cpu::select_kernels().qmm_i8 != nullptr; },
        "Whether this kernel set has the int8 prefill GEMM (set_int8_prefill(True) uses it).");
  m.def("isa", [] { return std::string(mlxinfer_cpu::select_kernels().isa); });
  m.def("tiled_weights_supported", &mlxinfer_cpu::tiled_weights_supported,
        "Whether this kernel set reads 4-bit weights in row tiles (decode and prefill alike).");
  // The MLX headers this module was compiled against; the C++ ABI is tied to that exact version.
  m.attr("mlx_version") = MLXINFER_STR(MLX_VERSION_MAJOR) "." MLXINFER_STR(MLX_VERSION_MINOR) "." MLXINFER_STR(MLX_VERSION_PATCH);
}
