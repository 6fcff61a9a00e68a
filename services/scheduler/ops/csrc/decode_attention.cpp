// Decode attention on CPU: one query token per request against its keys and values where
// they lie in the KV pool. Built per machine with the sampler's kernel by
// services/scheduler/ops/cpu_kernels.py; used by model_executor/attention/torch_backend.py.
//
// The SDPA path gathers every request's keys and values into a padded [B, S, kv_heads, D]
// copy, converts it to float32 and runs torch's SDPA: for the small heads of the models
// served on CPU that is memory traffic and op overhead, not arithmetic (3.9 ms a layer at
// batch 64 and ~160 keys on the 2-core EPYC here). Here each (request, kv head) reads its
// keys and values once, straight from their slots, in the pool's dtype, and accumulates in
// float32: scores for the head group's queries, their softmax, the weighted sum of values.
// Grouped-query attention is the head group: query head h reads kv head h / (H / kv_heads).

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
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using tokenline::kLanes;
using tokenline::lane_sum;
using tokenline::load_floats;
using tokenline::Vec;

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// sum_d a[d] * b[d], `a` in float32, `b` in the pool's dtype.
template <typename T>
inline float dot(const float* a, const T* b, int64_t dim) {
  int64_t d = 0;
  Vec acc(0.0f);
  for (; d + kLanes <= dim; d += kLanes) {
    acc = at::vec::fmadd(Vec::loadu(a + d), load_floats(b + d), acc);
  }
  float sum = lane_sum(acc);
  for (; d < dim; ++d) sum += a[d] * to_float(b[d]);
  return sum;
}

// out[d] += w * v[d], `v` in the pool's dtype.
template <typename T>
inline void axpy(float* out, float w, const T* v, int64_t dim) {
  int64_t d = 0;
  const Vec weight(w);
  for (; d + kLanes <= dim; d += kLanes) {
    at::vec::fmadd(weight, load_floats(v + d), Vec::loadu(out + d)).store(out + d);
  }
  for (; d < dim; ++d) out[d] += w * to_float(v[d]);
}

// Keys ahead whose rows are prefetched. Inside the engine the pool's rows come from memory,
// not cache (the layers between two calls evict them), and a row is read and used in a
// few nanoseconds: without prefetching each key waits for its own load.
constexpr int64_t kPrefetchAhead = 8;

// Asks for the `bytes` at `p` ahead of their use (a hint: no effect on results).
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(c + offset);
}

template <typename T>
void run(
    const at::Tensor& q,
    const at::Tensor& k_buf,
    const at::Tensor& v_buf,
    const at::Tensor& slots,
    const at::Tensor& seq_lens,
    double scale,
    at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_buf.size(1), group = heads / kv_heads;
  const int64_t table_width = slots.size(1);
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k_buf.data_ptr<T>();
  const T* v_data = v_buf.data_ptr<T>();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const int64_t* len_data = seq_lens.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  const int64_t k_slot_stride = k_buf.stride(0), k_head_stride = k_buf.stride(1);
  const int64_t v_slot_stride = v_buf.stride(0), v_head_stride = v_buf.stride(1);

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * dim), acc(group * dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kv = item % kv_heads;
      const int64_t len = len_data[b];
      const int64_t* row_slots = slot_data + b * table_width;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_data + (b * heads + kv * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) queries[g * dim + d] = to_float(src[d]) * scale;
      }
      scores.assign(group * len, 0.0f);
      std::vector<float> max_score(group, -std::numeric_limits<float>::infinity());
      const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
      for (int64_t s = 0; s < len; ++s) {
        if (s + kPrefetchAhead < len) {
          const int64_t ahead = row_slots[s + kPrefetchAhead];
          prefetch_row(k_data + ahead * k_slot_stride + kv * k_head_stride, row_bytes);
        }
        const T* key = k_data + row_slots[s] * k_slot_stride + kv * k_head_stride;
        for (int64_t g = 0; g < group; ++g) {
          const float x = dot(queries.data() + g * dim, key, dim);
          scores[g * len + s] = x;
          max_score[g] = std::max(max_score[g], x);
        }
      }
      std::vector<float> total(group, 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        for (int64_t s = 0; s < len; ++s) {
          row[s] = std::exp(row[s] - max_score[g]);
          total[g] += row[s];
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s = 0; s < len; ++s) {
        if (s + kPrefetchAhead < len) {
          const int64_t ahead = row_slots[s + kPrefetchAhead];
          prefetch_row(v_data + ahead * v_slot_stride + kv * v_head_stride, row_bytes);
        }
        const T* value = v_data + row_slots[s] * v_slot_stride + kv * v_head_stride;
        for (int64_t g = 0; g < group; ++g) {
          axpy(acc.data() + g * dim, scores[g * len + s], value, dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out_data + (b * heads + kv * group + g) * dim;
        const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

// q [B, H, D]; k_buf, v_buf [N, kv_heads, D] (the pool's layers, any slot stride); slots
// [B, S] int64, request b's keys at slots[b, :seq_lens[b]]; seq_lens [B] int64, each in
// [1, S]. Returns [B, H, D] in q's dtype. Every slot must be < N: checked, since a wrong
// one would read another request's memory.
at::Tensor decode_attention(
    const at::Tensor& q,
    const at::Tensor& k_buf,
    const at::Tensor& v_buf,
    const at::Tensor& slots,
    const at::Tensor& seq_lens,
    double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_buf.device().is_cpu(), "decode_attention runs on CPU");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D]");
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.dim() == 3, "k_buf and v_buf must be [N, kv_heads, D]");
  TORCH_CHECK(k_buf.sizes() == v_buf.sizes(), "k_buf and v_buf must have one shape");
  TORCH_CHECK(k_buf.stride(2) == 1 && v_buf.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && q.scalar_type() == v_buf.scalar_type(),
              "q, k_buf and v_buf must share a dtype");
  TORCH_CHECK(k_buf.size(2) == q.size(2), "q and the pool must share head_dim");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(0) && slots.is_contiguous() &&
                  slots.scalar_type() == at::kLong,
              "slots must be a contiguous int64 [B, S]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) &&
                  seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong,
              "seq_lens must be a contiguous int64 [B]");
  const int64_t num_slots = k_buf.size(0);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= slots.size(1), "seq_lens out of range");
    for (int64_t s = 0; s < lens[b]; ++s) {
      const int64_t slot = table[b * slots.size(1) + s];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot out of range");
    }
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_V2(
      q.scalar_type(), "decode_attention",
      AT_WRAP([&] { run<scalar_t>(q, k_buf, v_buf, slots, seq_lens, scale, out); }), at::kFloat,
      at::kBFloat16, at::kHalf);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor seq_lens, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenline, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
