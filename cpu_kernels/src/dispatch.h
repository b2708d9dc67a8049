#pragma once
// Plumbing shared by every primitive's eval_cpu: allocate the output, then run the kernel on row-contiguous
// inputs inside the CPU encoder's task (where the inputs' data is ready).
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"

namespace mlxinfer_cpu {

// Row-major copy of a strided array (libmlx does not export its own copy helpers); in quantized.cpp.
mx::array row_contiguous_copy(const mx::array& a);

template <typename Fn>
void dispatch_contiguous(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out, Fn fn) {
  auto& enc = mx::cpu::get_command_encoder(stream);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  std::vector<mx::array> in;
  for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  enc.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out), fn]() mutable {
    // Inputs are rarely strided (a transposed or sliced x); copy those here.
    for (auto& a : in)
      if (!a.flags().row_contiguous) a = row_contiguous_copy(a);
    fn(in, out);
  });
}

}  // namespace mlxinfer_cpu
