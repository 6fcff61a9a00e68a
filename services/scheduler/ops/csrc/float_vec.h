// What the engine's CPU kernels share: float32 vectors of at::vec loaded from the model's
// dtypes (float32, bfloat16, float16), their sum, the rounding and stores that make a
// kernel round where the eager ops round (to the model dtype), and the row-wise kernels'
// parallel grain.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
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

// Two float vectors rounded to T and back, as the eager op's output in T would be.
template <typename T>
inline void round_to(Vec& a, Vec& b) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
  }
}

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
inline void store(T* p, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + kLanes);
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// Rows of `width` elements per parallel chunk in the row-wise kernels: enough elements that
// a thread's share is worth its start.
inline int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
}

}  // namespace tokenline
