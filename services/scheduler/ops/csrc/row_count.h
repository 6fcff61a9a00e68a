// A run-time row count (1 to 6) as a compile-time one: the kernels that keep a group of
// rows' accumulators in registers (bf16_pairs.h, w8a8.cpp) instantiate their loop per
// count, so the accumulator array has a fixed size the compiler can keep in registers.
#pragma once

#include <cstdint>
#include <type_traits>

namespace tokenline {

// f(std::integral_constant<int64_t, rows>{}) for rows in 2..6; 1 for anything else.
template <typename F>
inline void with_row_count(int64_t rows, F&& f) {
  switch (rows) {
    case 6: return f(std::integral_constant<int64_t, 6>{});
    case 5: return f(std::integral_constant<int64_t, 5>{});
    case 4: return f(std::integral_constant<int64_t, 4>{});
    case 3: return f(std::integral_constant<int64_t, 3>{});
    case 2: return f(std::integral_constant<int64_t, 2>{});
    default: return f(std::integral_constant<int64_t, 1>{});
  }
}

}  // namespace tokenline
