// Row-wise element work of a decoder layer in one pass each, on CPU: RMSNorm, RoPE and the
// gated MLP's SiLU-and-multiply. Built per machine with the other kernels by services/scheduler/
// ops/cpu_kernels.py; used by model_executor/models/layers.py.
//
// Eagerly, RMSNorm is six passes over the rows (a float32 copy, square, mean, rsqrt
// multiply, the cast back, the weight), RoPE five per tensor (rotate-half's negation and
// concatenation, two products, their sum) and SiLU-and-multiply three (the gate's half read
// strided, SiLU, the product); in a 1,024-token prefill of the 0.5B-shaped model they took
// a fifth of the step beside the matmuls (torch.profiler, 2026-12-04). Here each row is
// read once and written once. The results round where the eager ops round (to the model's
// dtype after the normalisation, the SiLU and each RoPE product), so they differ from eager only in the last bits of
// float32 sums and exponentials. Each row is computed alone and in the same order whatever
// the row count: batch-invariant.

#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "float_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

namespace {

using tokenline::grain_rows;
using tokenline::kLanes;
using tokenline::lane_sum;
using tokenline::load_floats;
using tokenline::round_to;
using tokenline::store;
using tokenline::Vec;

template <typename T>
void rms_norm_rows(
    const T* x, int64_t rows, int64_t stride, int64_t width, const T* weight, float eps, T* out) {
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * stride;
      T* dst = out + r * width;
      Vec acc(0.0f);
      int64_t d = 0;
      for (; d + kLanes <= width; d += kLanes) {
        const Vec v = load_floats(row + d);
        acc = at::vec::fmadd(v, v, acc);
      }
      float squares = lane_sum(acc);
      for (int64_t t = d; t < width; ++t) {
        const float v = static_cast<float>(row[t]);
        squares += v * v;
      }
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
      const Vec scale_v(scale);
      d = 0;
      for (; d + 2 * kLanes <= width; d += 2 * kLanes) {
        Vec a = load_floats(row + d) * scale_v;
        Vec b = load_floats(row + d + kLanes) * scale_v;
        round_to<T>(a, b);  // the eager op's cast back to the model dtype
        a = a * load_floats(weight + d);
        b = b * load_floats(weight + d + kLanes);
        store<T>(dst + d, a, b);
      }
      for (int64_t t = d; t < width; ++t) {
        const float normed = round_to<T>(static_cast<float>(row[t]) * scale);
        dst[t] = static_cast<T>(normed * static_cast<float>(weight[t]));
      }
    }
  });
}

// exp for the SiLU: torch's full-precision one in float32; where the result is rounded to
// 16 bits anyway, the faster approximation softmax uses (exp_u20), whose error the
// rounding hides.
template <typename T>
inline Vec exp_of(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v.exp();
  } else {
    return v.exp_u20();
  }
}

template <typename T>
void silu_and_mul_rows(const T* x, int64_t rows, int64_t stride, int64_t half, T* out) {
  const Vec one(1.0f);
  at::parallel_for(0, rows, grain_rows(half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * stride;
      const T* up = gate + half;
      T* dst = out + r * half;
      int64_t d = 0;
      for (; d + 2 * kLanes <= half; d += 2 * kLanes) {
        const Vec g0 = load_floats(gate + d);
        const Vec g1 = load_floats(gate + d + kLanes);
        Vec a = g0 / (one + exp_of<T>(g0.neg()));
        Vec b = g1 / (one + exp_of<T>(g1.neg()));
        round_to<T>(a, b);  // the eager SiLU's output in the model dtype
        store<T>(dst + d, a * load_floats(up + d), b * load_floats(up + d + kLanes));
      }
      for (int64_t t = d; t < half; ++t) {
        const float g = static_cast<float>(gate[t]);
        const float activated = round_to<T>(g / (1.0f + std::exp(-g)));
        dst[t] = static_cast<T>(activated * static_cast<float>(up[t]));
      }
    }
  });
}

// out[t, h] = x[t, h] rotated by (cos[t], sin[t]) over its first R dims (HF's rotate_half
// convention: the first half pairs with the second), the rest copied; each product and the
// sum rounded to T as the eager ops round them (in float32 the compiler may fuse a product
// into the sum, a last-bit difference).
template <typename T>
void rotary_rows(
    const T* x,
    int64_t tokens,
    int64_t heads,
    int64_t token_stride,
    int64_t head_stride,
    int64_t dim,
    const T* cos,
    const T* sin,
    int64_t rotary,
    T* out) {
  const int64_t half = rotary / 2;
  at::parallel_for(0, tokens * heads, grain_rows(dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads;
      const T* src = x + t * token_stride + (row % heads) * head_stride;
      const T* c = cos + t * rotary;
      const T* s = sin + t * rotary;
      T* dst = out + row * dim;
      int64_t d = 0;
      for (; d + 2 * kLanes <= half; d += 2 * kLanes) {
        for (int64_t side = 0; side < 2; ++side) {  // first half, then second
          const int64_t at = d + side * half;
          const int64_t other = d + (1 - side) * half;
          Vec a0 = load_floats(src + at) * load_floats(c + at);
          Vec a1 = load_floats(src + at + kLanes) * load_floats(c + at + kLanes);
          Vec b0 = load_floats(src + other) * load_floats(s + at);
          Vec b1 = load_floats(src + other + kLanes) * load_floats(s + at + kLanes);
          round_to<T>(a0, a1);
          round_to<T>(b0, b1);
          if (side == 0) {
            store<T>(dst + at, a0 - b0, a1 - b1);
          } else {
            store<T>(dst + at, a0 + b0, a1 + b1);
          }
        }
      }
      for (; d < half; ++d) {
        const float first = static_cast<float>(src[d]);
        const float second = static_cast<float>(src[d + half]);
        const float a = round_to<T>(first * static_cast<float>(c[d]));
        const float b = round_to<T>(second * static_cast<float>(s[d]));
        dst[d] = static_cast<T>(a - b);
        const float a2 = round_to<T>(second * static_cast<float>(c[d + half]));
        const float b2 = round_to<T>(first * static_cast<float>(s[d + half]));
        dst[d + half] = static_cast<T>(a2 + b2);
      }
      for (int64_t rest = rotary; rest < dim; ++rest) dst[rest] = src[rest];
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " runs on CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [rows, width], rows dense");
}

// x [rows, H] (each row contiguous), weight [H] in x's dtype: Llama's RMSNorm,
// weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), computed in float32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: weight must be a contiguous [H]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: x and weight share a dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const auto e = static_cast<float>(eps);
  AT_DISPATCH_V2(
      x.scalar_type(), "rms_norm", AT_WRAP([&] {
        rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.stride(0), x.size(1),
                                weight.data_ptr<scalar_t>(), e, out.data_ptr<scalar_t>());
      }),
      at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// x [rows, 2 * I] (each row contiguous: gate then up): silu(gate) * up, [rows, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the width holds gate and up halves");
  const int64_t half = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), half}, x.options());
  AT_DISPATCH_V2(
      x.scalar_type(), "silu_and_mul", AT_WRAP([&] {
        silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.stride(0), half,
                                    out.data_ptr<scalar_t>());
      }),
      at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// x [T, heads, D] (D contiguous), cos and sin [T, R] contiguous in x's dtype, R even and
// at most D: RoPE over the first R dims of every head, the rest passed through; returns a
// contiguous [T, heads, D].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu(), "rotary runs on CPU");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [T, heads, D], D dense");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && cos.size(0) == x.size(0),
              "rotary: cos and sin must be contiguous [T, R]");
  TORCH_CHECK(cos.size(1) % 2 == 0 && cos.size(1) <= x.size(2),
              "rotary: R must be even and at most D");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: x, cos and sin share a dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_V2(
      x.scalar_type(), "rotary", AT_WRAP([&] {
        rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                              x.stride(1), x.size(2), cos.data_ptr<scalar_t>(),
                              sin.data_ptr<scalar_t>(), cos.size(1), out.data_ptr<scalar_t>());
      }),
      at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenline, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
