// What the engine's CPU kernels share: float32 vectors of at::vec loaded from the model's
// dtypes (float32, bfloat16, float16), and their sum.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

namespace tokenline {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// A full vector of entries from `p` as floats.
template <typename T>
inline Vec load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

inline float lane_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

}  // namespace tokenline
