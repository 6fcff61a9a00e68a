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

#include "bf16_pairs.h"
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

// `src`'s `dim` entries as float32: `src` itself in a float32 pool, else widened into
// `buffer` (once per row, however many queries of the head group then read it).
template <typename T>
inline const float* as_floats(const T* src, float* buffer, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) load_floats(src + d).store(buffer + d);
    for (; d < dim; ++d) buffer[d] = to_float(src[d]);
    return buffer;
  }
}

// row[s] = exp(row[s] - shift) for s < len, vectorized; returns their sum.
inline float exp_shifted(float* row, int64_t len, float shift) {
  int64_t s = 0;
  const Vec by(shift);
  Vec sums(0.0f);
  for (; s + kLanes <= len; s += kLanes) {
    const Vec e = (Vec::loadu(row + s) - by).exp();
    e.store(row + s);
    sums = sums + e;
  }
  float total = lane_sum(sums);
  for (; s < len; ++s) {
    row[s] = std::exp(row[s] - shift);
    total += row[s];
  }
  return total;
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

// One call's operands as pointers and strides: request b's s-th key and value row of kv
// head kv, the query and output row of its g-th query head.
template <typename T>
struct Operands {
  int64_t batch, heads, dim, kv_heads, group;
  const T* q;
  const T* k;
  const T* v;
  const int64_t* slots;
  const int64_t* lens;
  T* out;
  int64_t table_width, k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;

  Operands(const at::Tensor& q_, const at::Tensor& k_buf, const at::Tensor& v_buf,
           const at::Tensor& slots_, const at::Tensor& seq_lens, at::Tensor& out_)
      : batch(q_.size(0)), heads(q_.size(1)), dim(q_.size(2)), kv_heads(k_buf.size(1)),
        group(heads / kv_heads), q(q_.data_ptr<T>()), k(k_buf.data_ptr<T>()),
        v(v_buf.data_ptr<T>()), slots(slots_.data_ptr<int64_t>()),
        lens(seq_lens.data_ptr<int64_t>()), out(out_.data_ptr<T>()),
        table_width(slots_.size(1)), k_slot_stride(k_buf.stride(0)),
        k_head_stride(k_buf.stride(1)), v_slot_stride(v_buf.stride(0)),
        v_head_stride(v_buf.stride(1)) {}

  const T* key(int64_t b, int64_t kv, int64_t s) const {
    return k + slots[b * table_width + s] * k_slot_stride + kv * k_head_stride;
  }
  const T* value(int64_t b, int64_t kv, int64_t s) const {
    return v + slots[b * table_width + s] * v_slot_stride + kv * v_head_stride;
  }
  const T* query(int64_t b, int64_t kv, int64_t g) const {
    return q + (b * heads + kv * group + g) * dim;
  }
  T* out_row(int64_t b, int64_t kv, int64_t g) const {
    return out + (b * heads + kv * group + g) * dim;
  }
};

#if defined(__AVX512BF16__)
using tokenline::first_lanes;

// The bf16 pool's path where the build has AVX512-BF16 and head_dim is a multiple of 32:
// both products by pair dot products (vdpbf16ps), float32 sums. Per key and query the
// float path widens the key, multiplies 64 lanes and reduces them across the vector; here
// a query meets 16 keys' products at once and one transpose-and-add (lane_sums16) reduces
// them, and the weighted sum takes two keys per instruction. 4-5x fewer instructions at
// head_dim 64, group 7 (the 0.5B shape), which the engine spent 10 % of a 16-request
// decode step on. The softmax weights are rounded to bf16 for the second product, and
// their sum is taken of the rounded weights, so they still sum to one.

// Lane j of the result: the sum of v[j]'s 16 lanes.
inline __m512 lane_sums16(const __m512* v) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {
    halves[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                              _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(halves[2 * i]), y = _mm512_castps_pd(halves[2 * i + 1]);
    quarters[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {
    eighths[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quarters[2 * i], quarters[2 * i + 1], 0x88),
                               _mm512_shuffle_f32x4(quarters[2 * i], quarters[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(eighths[0], eighths[1], 0x88),
                       _mm512_shuffle_f32x4(eighths[0], eighths[1], 0xDD));
}

// Lane 4k + t of a value pair vector's low half (unpacklo) holds dim 8k + t of its 32, of
// the high half dim 8k + 4 + t: these indices put dims 0-15 and 16-31 back in order.
inline __m512i first_dims() {
  return _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
}
inline __m512i last_dims() {
  return _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}

// The weighted sum of request b's values under kv head kv for `rows` (at most Rows) query
// rows of its group from `first`, two keys a step: their rows interleaved into pairs, each
// pair vector met by every row's weight pair. Written out scaled by 1 / the row's total.
// The Rows x 2 Vecs accumulators stay in registers: with the width and row count known
// only at run time they lived in memory, a load and a store around every product (a third
// of the kernel's time at the 0.5B shape's 7 heads per kv head, 16 requests).
template <int64_t Vecs, int64_t Rows>
inline void weighted_rows(const Operands<at::BFloat16>& ops, int64_t b, int64_t kv,
                          int64_t first, int64_t rows, const uint16_t* weights,
                          int64_t padded, const float* totals, const at::BFloat16* zeros) {
  constexpr int64_t kPairVecs = 2 * Vecs;
  constexpr int64_t kRowBytes = Vecs * 32 * 2;
  const int64_t len = ops.lens[b];
  __m512 acc[Rows][kPairVecs];
  for (int64_t r = 0; r < Rows; ++r) {
    for (int64_t c = 0; c < kPairVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t s = 0; s < len; s += 2) {
    for (int64_t ahead = s + 8; ahead < std::min(len, s + 10); ++ahead) {
      prefetch_row(ops.value(b, kv, ahead), kRowBytes);
    }
    const at::BFloat16* first_row = ops.value(b, kv, s);
    const at::BFloat16* second_row = s + 1 < len ? ops.value(b, kv, s + 1) : zeros;
    __m512i pairs[kPairVecs];
    for (int64_t c = 0; c < Vecs; ++c) {
      const __m512i x = _mm512_loadu_si512(first_row + 32 * c);
      const __m512i y = _mm512_loadu_si512(second_row + 32 * c);
      pairs[2 * c] = _mm512_unpacklo_epi16(x, y);
      pairs[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int64_t r = 0; r < Rows; ++r) {
      if (r < rows) {
        const __m512bh w = tokenline::broadcast_pair(weights + (first + r) * padded + s);
        for (int64_t c = 0; c < kPairVecs; ++c) {
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)pairs[c], w);
        }
      }
    }
  }
  for (int64_t r = 0; r < Rows; ++r) {
    if (r < rows) {
      const float total = totals[first + r];
      const __m512 inv = _mm512_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);
      at::BFloat16* dst = ops.out_row(b, kv, first + r);
      for (int64_t c = 0; c < Vecs; ++c) {
        const __m512 low = _mm512_permutex2var_ps(acc[r][2 * c], first_dims(), acc[r][2 * c + 1]);
        const __m512 high = _mm512_permutex2var_ps(acc[r][2 * c], last_dims(), acc[r][2 * c + 1]);
        // at::vec's rounding is c10::BFloat16's: the same bits as a scalar cast.
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * c),
                            at::vec::cvtfp32_bf16(_mm512_mul_ps(low, inv)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * c + 16),
                            at::vec::cvtfp32_bf16(_mm512_mul_ps(high, inv)));
      }
    }
  }
}

// Accumulators the weighted sum keeps in registers: 16 of the 32, so the pair vectors, the
// weight and the compiler's temporaries fit beside them.
constexpr int64_t kAccumulators = 16;

template <int64_t Vecs>
void weighted_group(const Operands<at::BFloat16>& ops, int64_t b, int64_t kv,
                    const uint16_t* weights, int64_t padded, const float* totals,
                    const at::BFloat16* zeros) {
  constexpr int64_t kRows = kAccumulators / (2 * Vecs);  // 8, 4, 2 and 2 rows
  for (int64_t first = 0; first < ops.group; first += kRows) {
    weighted_rows<Vecs, kRows>(ops, b, kv, first, std::min(kRows, ops.group - first), weights,
                               padded, totals, zeros);
  }
}

// The weighted sums of every query row of (b, kv), at the head width's instantiation.
inline void weighted_sums(const Operands<at::BFloat16>& ops, int64_t b, int64_t kv,
                          const uint16_t* weights, int64_t padded, const float* totals,
                          const at::BFloat16* zeros) {
  switch (ops.dim / 32) {
    case 1:
      return weighted_group<1>(ops, b, kv, weights, padded, totals, zeros);
    case 2:
      return weighted_group<2>(ops, b, kv, weights, padded, totals, zeros);
    case 3:
      return weighted_group<3>(ops, b, kv, weights, padded, totals, zeros);
    default:
      return weighted_group<4>(ops, b, kv, weights, padded, totals, zeros);
  }
}

void run_bf16_pairs(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                    const at::Tensor& slots, const at::Tensor& seq_lens, double scale,
                    at::Tensor& out) {
  using T = at::BFloat16;
  const Operands<T> ops(q, k_buf, v_buf, slots, seq_lens, out);
  const int64_t kv_heads = ops.kv_heads, group = ops.group, dim = ops.dim, vecs = dim / 32;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  const float scale_f = static_cast<float>(scale);

  at::parallel_for(0, ops.batch * ops.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, totals(group);
    std::vector<uint16_t> weights;  // bf16 bits, each group row padded to an even length
    std::vector<T> zeros(dim, T(0.0f));
    // Every key and value row of an item, asked for into L2 as one burst a whole item
    // ahead: the rows are 2 cache lines apart in the pool and come from memory, and asked
    // for one at a time each waited out its own latency (4 GB/s measured).
    auto prefetch_item = [&](int64_t item) {
      const int64_t b = item / kv_heads, kv = item % kv_heads;
      for (int64_t s = 0; s < ops.lens[b]; ++s) {
        const char* key = reinterpret_cast<const char*>(ops.key(b, kv, s));
        const char* value = reinterpret_cast<const char*>(ops.value(b, kv, s));
        for (int64_t offset = 0; offset < row_bytes; offset += 64) {
          _mm_prefetch(key + offset, _MM_HINT_T1);
          _mm_prefetch(value + offset, _MM_HINT_T1);
        }
      }
    };
    if (begin < end) prefetch_item(begin);
    for (int64_t item = begin; item < end; ++item) {
      if (item + 1 < end) prefetch_item(item + 1);
      const int64_t b = item / kv_heads, kv = item % kv_heads;
      const int64_t len = ops.lens[b], padded = len + (len & 1);
      scores.resize(group * len);
      weights.assign(group * padded, 0);
      // Scores, 16 keys at a time per query; the rows of the next 16 keys prefetched.
      for (int64_t first = 0; first < len; first += 16) {
        const int64_t count = std::min<int64_t>(16, len - first);
        for (int64_t s = first + 16; s < std::min(len, first + 32); ++s) {
          prefetch_row(ops.key(b, kv, s), row_bytes);
        }
        // The block's key rows, looked up once for the whole head group; past the last
        // key, a row of zeros, so every query runs sixteen independent chains.
        const T* keys[16];
        for (int64_t j = 0; j < 16; ++j) keys[j] = j < count ? ops.key(b, kv, first + j) : zeros.data();
        for (int64_t g = 0; g < group; ++g) {
          const T* query = ops.query(b, kv, g);
          __m512 products[16];
          for (int64_t j = 0; j < 16; ++j) products[j] = _mm512_setzero_ps();
          for (int64_t c = 0; c < vecs; ++c) {
            const __m512bh q_part = (__m512bh)_mm512_loadu_si512(query + 32 * c);
            for (int64_t j = 0; j < 16; ++j) {
              products[j] = _mm512_dpbf16_ps(
                  products[j], (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c), q_part);
            }
          }
          const __m512 tile = _mm512_mul_ps(lane_sums16(products), _mm512_set1_ps(scale_f));
          _mm512_mask_storeu_ps(scores.data() + g * len + first, first_lanes(count), tile);
        }
      }
      // Softmax weights per query, rounded to bf16; their sum, of the rounded weights.
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        __m512 maxima = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t s = 0; s < len; s += 16) {
          maxima = _mm512_mask_max_ps(maxima, first_lanes(len - s), maxima,
                                      _mm512_maskz_loadu_ps(first_lanes(len - s), row + s));
        }
        const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(maxima));
        __m512 sums = _mm512_setzero_ps();
        uint16_t* dst = weights.data() + g * padded;
        for (int64_t s = 0; s < len; s += 16) {
          const __mmask16 keep = first_lanes(len - s);
          const Vec e = Vec(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, row + s), shift)).exp();
          const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(keep, e));
          _mm256_mask_storeu_epi16(dst + s, keep, rounded);
          __m512 widened;
          at::vec::cvtbf16_fp32(rounded, widened);
          sums = _mm512_add_ps(sums, widened);
        }
        totals[g] = _mm512_reduce_add_ps(sums);
      }
      weighted_sums(ops, b, kv, weights.data(), padded, totals.data(), zeros.data());
    }
  });
}
#endif

template <typename T>
void run(
    const at::Tensor& q,
    const at::Tensor& k_buf,
    const at::Tensor& v_buf,
    const at::Tensor& slots,
    const at::Tensor& seq_lens,
    double scale,
    at::Tensor& out) {
  const Operands<T> ops(q, k_buf, v_buf, slots, seq_lens, out);
  const int64_t kv_heads = ops.kv_heads, group = ops.group, dim = ops.dim;

  at::parallel_for(0, ops.batch * ops.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * dim), acc(group * dim), row(dim), scores;
    std::vector<float> max_score(group), total(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kv = item % kv_heads;
      const int64_t len = ops.lens[b];
      for (int64_t g = 0; g < group; ++g) {
        const T* src = ops.query(b, kv, g);
        for (int64_t d = 0; d < dim; ++d) queries[g * dim + d] = to_float(src[d]) * scale;
      }
      scores.resize(group * len);
      std::fill(max_score.begin(), max_score.end(), -std::numeric_limits<float>::infinity());
      const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
      for (int64_t s = 0; s < len; ++s) {
        if (s + kPrefetchAhead < len) {
          prefetch_row(ops.key(b, kv, s + kPrefetchAhead), row_bytes);
        }
        // Each key is widened to float32 once for its whole head group.
        const float* key = as_floats(ops.key(b, kv, s), row.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float x = dot(queries.data() + g * dim, key, dim);
          scores[g * len + s] = x;
          max_score[g] = std::max(max_score[g], x);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        total[g] = exp_shifted(scores.data() + g * len, len, max_score[g]);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s = 0; s < len; ++s) {
        if (s + kPrefetchAhead < len) {
          prefetch_row(ops.value(b, kv, s + kPrefetchAhead), row_bytes);
        }
        const float* value = as_floats(ops.value(b, kv, s), row.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          axpy(acc.data() + g * dim, scores[g * len + s], value, dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = ops.out_row(b, kv, g);
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
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && q.size(2) % 32 == 0 && q.size(2) <= 128) {
    run_bf16_pairs(q, k_buf, v_buf, slots, seq_lens, scale, out);
    return out;
  }
#endif
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
