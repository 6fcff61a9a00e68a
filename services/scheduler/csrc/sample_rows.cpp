// One token per row of the LM head's logits: the row's argmax where its inverse temperature
// is 0 (greedy), else an exact draw from softmax(x * inv_temperature) by inverse CDF with the
// row's uniform. Built per machine by services/scheduler/sample_kernel.py.
//
// A sampled row is read twice in full: once for its maximum, once for the mass of each
// 128-entry block (exp of every entry, torch's exp_u20: the same exp torch.softmax uses on
// CPU). A block is picked by its mass and only its 128 weights are computed again. Rows are
// independent (one per task of at::parallel_for), so a row draws the same token alone or
// in any batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kBlock = 128;  // the block size the Python sampler's search uses too
constexpr float kInf = std::numeric_limits<float>::infinity();

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

// The last `count` (< kLanes) entries of a row as floats; the lanes past them hold `pad`.
template <typename T>
inline Vec load_tail(const T* p, int64_t count, float pad) {
  alignas(64) float buffer[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) {
    buffer[i] = i < count ? static_cast<float>(p[i]) : pad;
  }
  return Vec::loadu(buffer);
}

// The row's maximum; NaN if it holds one (torch.argmax counts NaN as the maximum).
template <typename T>
float row_max(const T* x, int64_t n) {
  Vec best(-kInf);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    best = at::vec::maximum(best, load_floats(x + i));
  }
  if (i < n) {
    best = at::vec::maximum(best, load_tail(x + i, n - i, -kInf));
  }
  alignas(64) float lanes[kLanes];
  best.store(lanes);
  float result = -kInf;
  for (float v : lanes) {
    if (std::isnan(v)) return v;
    result = std::max(result, v);
  }
  return result;
}

// The first lane of `values` equal to `target` (NaN matches NaN), or -1.
inline int64_t first_match(const Vec& values, float target) {
  const Vec hits = std::isnan(target) ? values.isnan() : (values == Vec(target));
  const int misses = hits.zero_mask();  // bit j set: lane j is not a hit
  const int all = (1 << kLanes) - 1;
  return misses == all ? -1 : __builtin_ctz(~misses & all);
}

// The row's first maximum (its first NaN if it has one), as torch.argmax.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  const float target = row_max(x, n);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const int64_t lane = first_match(load_floats(x + i), target);
    if (lane >= 0) return i + lane;
  }
  const int64_t lane = first_match(load_tail(x + i, n - i, -kInf), target);
  return lane >= 0 && i + lane < n ? i + lane : n - 1;
}

// exp(x * inv - top) of a full vector of entries, and of a row's short tail (0 past it).
template <typename T>
inline Vec weights(const T* p, const Vec& inv, const Vec& top) {
  return (load_floats(p) * inv - top).exp_u20();
}

template <typename T>
inline Vec tail_weights(const T* p, int64_t count, const Vec& inv, const Vec& top) {
  return (load_tail(p, count, -kInf) * inv - top).exp_u20();
}

// The weights of x[start, end) summed, or stored to `out` when it is given.
template <typename T>
inline float block_weights(
    const T* x, int64_t start, int64_t end, const Vec& inv, const Vec& top, float* out) {
  Vec sum(0.0f);
  int64_t i = start;
  for (; i + kLanes <= end; i += kLanes) {
    const Vec w = weights(x + i, inv, top);
    if (out != nullptr) w.store(out + (i - start));
    sum = sum + w;
  }
  if (i < end) {
    const Vec w = tail_weights(x + i, end - i, inv, top);
    if (out != nullptr) w.store(out + (i - start), end - i);
    sum = sum + w;
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
}

template <typename T>
int64_t draw_row(const T* x, int64_t n, float inv, double u, std::vector<double>& mass) {
  const float row_top = row_max(x, n);
  const float top = row_top * inv;  // inv > 0: the same as the maximum of x * inv
  if (!std::isfinite(top)) return argmax_row(x, n);
  const Vec v_inv(inv), v_top(top);
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  mass.resize(num_blocks);
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    mass[b] = block_weights(x, b * kBlock, std::min(n, (b + 1) * kBlock), v_inv, v_top, nullptr);
    total += mass[b];
  }
  if (!(total > 0.0) || !std::isfinite(total)) return argmax_row(x, n);
  // The block where u * total falls, and what is left of the target inside it.
  double target = u * total;
  int64_t block = -1;
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (mass[b] > 0.0) {
      block = b;
      if (target < mass[b]) break;
      target -= mass[b];
    }
  }
  // Inside the block, the first weight whose running sum passes the target; rounding can
  // leave the target at the block's end, and then its last nonzero weight is taken.
  const int64_t start = block * kBlock, end = std::min(n, start + kBlock);
  alignas(64) float w[kBlock];
  block_weights(x, start, end, v_inv, v_top, w);
  double running = 0.0;
  int64_t last_kept = -1;
  for (int64_t i = 0; i < end - start; ++i) {
    if (w[i] > 0.0f) {
      running += w[i];
      last_kept = i;
      if (running > target) return start + i;
    }
  }
  return start + last_kept;
}

template <typename T>
void sample_rows_typed(
    const at::Tensor& logits, const float* inv, const float* uniforms, int64_t* out) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const T* data = logits.const_data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> mass;
    for (int64_t r = begin; r < end; ++r) {
      const T* x = data + r * n;
      out[r] = inv[r] > 0.0f ? draw_row(x, n, inv[r], static_cast<double>(uniforms[r]), mass)
                             : argmax_row(x, n);
    }
  });
}

at::Tensor sample_rows(
    const at::Tensor& logits, const at::Tensor& inv_temperature, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu(), "logits must be [rows, vocab] on CPU");
  TORCH_CHECK(logits.size(1) > 0, "logits need a vocabulary");
  const int64_t rows = logits.size(0);
  for (const at::Tensor* t : {&inv_temperature, &uniforms}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat &&
                    t->device().is_cpu(),
                "inv_temperature and uniforms must be float32 [rows] on CPU");
  }
  const at::Tensor x = logits.contiguous();
  const at::Tensor inv = inv_temperature.contiguous(), u = uniforms.contiguous();
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* inv_ptr = inv.const_data_ptr<float>();
  const float* u_ptr = u.const_data_ptr<float>();
  int64_t* out_ptr = out.mutable_data_ptr<int64_t>();
  switch (x.scalar_type()) {
    case at::kFloat:
      sample_rows_typed<float>(x, inv_ptr, u_ptr, out_ptr);
      break;
    case at::kBFloat16:
      sample_rows_typed<at::BFloat16>(x, inv_ptr, u_ptr, out_ptr);
      break;
    case at::kHalf:
      sample_rows_typed<at::Half>(x, inv_ptr, u_ptr, out_ptr);
      break;
    default:
      TORCH_CHECK(false, "logits must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenline, m) {
  m.def("sample_rows(Tensor logits, Tensor inv_temperature, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenline, CPU, m) {
  m.impl("sample_rows", &sample_rows);
}
