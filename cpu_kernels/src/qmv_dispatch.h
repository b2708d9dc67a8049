// What the decode matvecs share that is plain C++: the dispatch of a call's run-time shape to template arguments
// (x rows 1..8, group size 32, 64, 128) and a view of a call past its first x rows. Internal linkage (static), so
// each ISA's translation unit keeps its own copy, compiled with its own flags.
#pragma once

#include <type_traits>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {

// Rows::template run<MM, BITS, GS>(a, n0, n1) for a.M x rows (more than 8: 8) and a.group_size (32, 64, else 128).
template <class Rows, int BITS>
static inline void dispatch_qmv(const QmmArgs& a, int n0, int n1) {
  const auto by_group = [&](auto mm) {
    constexpr int MM = decltype(mm)::value;
    switch (a.group_size) {
      case 32: return Rows::template run<MM, BITS, 32>(a, n0, n1);
      case 64: return Rows::template run<MM, BITS, 64>(a, n0, n1);
      default: return Rows::template run<MM, BITS, 128>(a, n0, n1);
    }
  };
  switch (a.M) {
    case 1: return by_group(std::integral_constant<int, 1>{});
    case 2: return by_group(std::integral_constant<int, 2>{});
    case 3: return by_group(std::integral_constant<int, 3>{});
    case 4: return by_group(std::integral_constant<int, 4>{});
    case 5: return by_group(std::integral_constant<int, 5>{});
    case 6: return by_group(std::integral_constant<int, 6>{});
    case 7: return by_group(std::integral_constant<int, 7>{});
    default: return by_group(std::integral_constant<int, 8>{});
  }
}

// The x-side arguments of `a` past its first `skip` x rows (int16 or int8 x, whichever the call prepared, with their
// group terms); the output stays where it is (the caller says where those rows' results go).
static inline QmmArgs past_x_rows(const QmmArgs& a, int skip) {
  QmmArgs b = a;
  if (a.xq != nullptr) b.xq = a.xq + (size_t)skip * a.kpad;
  if (a.xb != nullptr) b.xb = a.xb + (size_t)skip * a.kpad;
  b.xd = a.xd + (size_t)skip * a.gpad;
  b.xsum = a.xsum + (size_t)skip * a.gpad;
  b.xcorr = a.xcorr + (size_t)skip * a.gpad;
  return b;
}

}  // namespace mlxinfer_cpu
