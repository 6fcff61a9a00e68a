// Causal attention of a prompt chunk on CPU in bf16, for CPUs with AVX512-BF16 but no AMX.
// Used by model_executor/attention/torch_backend.py for prefill spans.
//
// Why: torch's CPU flash attention reaches 50-100 GFLOP/s in bf16 on the 2-core AMD EPYC
// with AVX512_BF16 (Zen 4) at the 0.5B shape's heads (64 wide, 14 over 2), against the
// 430 GFLOP/s its linear layers reach there, so a 1,024-token chunk spent a fifth of its
// time in attention. Here both products are pair dot products (vdpbf16ps) into float32,
// blocked as a GEMM's micro-kernel is: keys packed once per kv head into tiles where one
// vector holds 16 keys' values of a head_dim pair, values packed into key pairs, and a
// flash loop (running max and sum per query row) over 32-key tiles. Grouped-query
// attention is the row set: a work item is a block of query positions times the kv head's
// group of query heads, so each packed key tile is read by all of them.
//
// With AMX, torch's kernel multiplies on tiles and is the faster; the caller keeps it
// there. The softmax weights are rounded to bf16 for the second product and their sum is
// taken of the rounded weights, as in decode_attention.cpp.
//
// Built only at the avx512_bf16 ISA level; prompt_attention_fits() says whether this
// library has it and the head size is one it takes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16_pairs.h"

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kKeyTile = 32;     // keys per score tile: two vectors of 16
constexpr int64_t kQueryBlock = 16;  // query positions per work item
constexpr int64_t kScoreRows = 8;    // query rows the scores micro-kernel keeps in registers

using Bits = uint16_t;  // bf16 bit patterns
using tokenline::broadcast_pair;
using tokenline::first_lanes;

// Where one (query position, query head) row's operands lie.
struct Rows {
  const at::BFloat16* q;
  at::BFloat16* out;
  int64_t heads, group, dim;
  const Bits* query(int64_t position, int64_t kv, int64_t g) const {
    return reinterpret_cast<const Bits*>(q + (position * heads + kv * group + g) * dim);
  }
  at::BFloat16* out_row(int64_t position, int64_t kv, int64_t g) const {
    return out + (position * heads + kv * group + g) * dim;
  }
};

// Keys of one kv head as score tiles: tile t, head_dim pair p holds keys 32t..32t+31 as
// [32][2] bf16 (two vectors), so one load feeds 16 keys' products. Keys past the end are 0.
void pack_keys(const at::BFloat16* k, int64_t stride, int64_t len, int64_t dim, Bits* dst) {
  const int64_t pairs = dim / 2, tiles = (len + kKeyTile - 1) / kKeyTile;
  std::memset(dst, 0, tiles * kKeyTile * dim * sizeof(Bits));
  for (int64_t s = 0; s < len; ++s) {
    const Bits* row = reinterpret_cast<const Bits*>(k + s * stride);
    Bits* tile = dst + (s / kKeyTile) * kKeyTile * dim;
    const int64_t j = s % kKeyTile;
    for (int64_t p = 0; p < pairs; ++p) {
      tile[(p * kKeyTile + j) * 2] = row[2 * p];
      tile[(p * kKeyTile + j) * 2 + 1] = row[2 * p + 1];
    }
  }
}

// Values of one kv head in key pairs: pair i, dim d holds (v[2i][d], v[2i + 1][d]), so one
// load feeds 16 dims' products over two keys. Padded with zero keys to whole tiles.
void pack_values(const at::BFloat16* v, int64_t stride, int64_t len, int64_t dim, Bits* dst) {
  const int64_t padded = (len + kKeyTile - 1) / kKeyTile * kKeyTile;
  std::memset(dst, 0, padded * dim * sizeof(Bits));
  for (int64_t s = 0; s < len; ++s) {
    const Bits* row = reinterpret_cast<const Bits*>(v + s * stride);
    Bits* pair = dst + (s / 2) * dim * 2 + (s % 2);
    for (int64_t d = 0; d < dim; ++d) pair[2 * d] = row[d];
  }
}

// scores[r][0..31] = q_r . key for the tile's 32 keys, for kScoreRows query rows.
template <int64_t Dim>
inline void score_tile(const Bits* const* queries, const Bits* tile, float scale,
                       float* scores) {
  __m512 acc[kScoreRows][2];
  for (int64_t r = 0; r < kScoreRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < Dim / 2; ++p) {
    const __m512bh low = (__m512bh)_mm512_loadu_si512(tile + p * kKeyTile * 2);
    const __m512bh high = (__m512bh)_mm512_loadu_si512(tile + p * kKeyTile * 2 + 32);
    for (int64_t r = 0; r < kScoreRows; ++r) {
      const __m512bh x = broadcast_pair(queries[r] + 2 * p);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], low, x);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], high, x);
    }
  }
  const __m512 by = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < kScoreRows; ++r) {
    _mm512_storeu_ps(scores + r * kKeyTile, _mm512_mul_ps(acc[r][0], by));
    _mm512_storeu_ps(scores + r * kKeyTile + 16, _mm512_mul_ps(acc[r][1], by));
  }
}

// sums[r] += weights_r . values over the tile's 16 key pairs, for Rows rows at once.
template <int64_t Dim, int64_t RowsAtOnce>
inline void weighted_tile(const Bits* const* weights, const Bits* values, float* const* sums,
                          const float* corrections) {
  constexpr int64_t kVecs = Dim / 16;
  __m512 acc[RowsAtOnce][kVecs];
  for (int64_t r = 0; r < RowsAtOnce; ++r) {
    for (int64_t c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < kKeyTile / 2; ++i) {
    __m512bh v[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) {
      v[c] = (__m512bh)_mm512_loadu_si512(values + (i * Dim + 16 * c) * 2);
    }
    for (int64_t r = 0; r < RowsAtOnce; ++r) {
      const __m512bh w = broadcast_pair(weights[r] + 2 * i);
      for (int64_t c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], w);
    }
  }
  for (int64_t r = 0; r < RowsAtOnce; ++r) {
    const __m512 by = _mm512_set1_ps(corrections[r]);
    for (int64_t c = 0; c < kVecs; ++c) {
      float* dst = sums[r] + 16 * c;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), by, acc[r][c]));
    }
  }
}

template <int64_t Dim>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
         at::Tensor& out) {
  const int64_t length = q.size(0), heads = q.size(1), keys = k.size(0);
  const int64_t kv_heads = k.size(1), group = heads / kv_heads, prefix = keys - length;
  const int64_t tiles = (keys + kKeyTile - 1) / kKeyTile, head_elems = tiles * kKeyTile * Dim;
  const Rows rows{q.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), heads, group, Dim};
  const float scale_f = static_cast<float>(scale);

  std::vector<Bits> packed_keys(kv_heads * head_elems), packed_values(kv_heads * head_elems);
  at::parallel_for(0, kv_heads * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / 2;
      if (item % 2 == 0) {
        pack_keys(k.data_ptr<at::BFloat16>() + kv * k.stride(1), k.stride(0), keys, Dim,
                  packed_keys.data() + kv * head_elems);
      } else {
        pack_values(v.data_ptr<at::BFloat16>() + kv * v.stride(1), v.stride(0), keys, Dim,
                    packed_values.data() + kv * head_elems);
      }
    }
  });

  // Later query blocks see more keys: items run in the order first, last, second, second
  // to last, ... so the contiguous halves parallel_for hands two threads weigh the same.
  const int64_t blocks = (length + kQueryBlock - 1) / kQueryBlock;
  auto block_of = [&](int64_t i) { return i % 2 == 0 ? i / 2 : blocks - 1 - i / 2; };
  constexpr int64_t kWeightRows = std::max<int64_t>(1, 256 / Dim);

  at::parallel_for(0, blocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kQueryBlock * group;
    const int64_t padded_rows = (max_rows + kScoreRows - 1) / kScoreRows * kScoreRows;
    std::vector<float> scores(padded_rows * kKeyTile), sums(max_rows * Dim);
    std::vector<float> running_max(max_rows), totals(max_rows), corrections(padded_rows);
    std::vector<Bits> weights(padded_rows * kKeyTile, 0);
    std::vector<Bits> zero_row(Dim, 0);
    std::vector<const Bits*> queries(padded_rows), weight_rows(padded_rows);
    std::vector<float*> sum_rows(padded_rows);
    std::vector<float> discard(Dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item % kv_heads, block = block_of(item / kv_heads);
      const int64_t first = block * kQueryBlock;
      const int64_t count = std::min(kQueryBlock, length - first), row_count = count * group;
      // Row r is query position first + r / group, head g = r % group; rows past the
      // block read a zero query and write nowhere.
      for (int64_t r = 0; r < padded_rows; ++r) {
        const bool real = r < row_count;
        queries[r] = real ? rows.query(first + r / group, kv, r % group) : zero_row.data();
        weight_rows[r] = weights.data() + r * kKeyTile;
        sum_rows[r] = real ? sums.data() + r * Dim : discard.data();
      }
      std::fill(sums.begin(), sums.end(), 0.0f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(totals.begin(), totals.end(), 0.0f);
      const int64_t visible = prefix + first + count;  // keys the block's last query sees
      const Bits* key_tiles = packed_keys.data() + kv * head_elems;
      const Bits* value_tiles = packed_values.data() + kv * head_elems;
      for (int64_t t = 0; t * kKeyTile < visible; ++t) {
        const int64_t first_key = t * kKeyTile;
        for (int64_t r = 0; r < padded_rows; r += kScoreRows) {
          score_tile<Dim>(queries.data() + r, key_tiles + t * kKeyTile * Dim, scale_f,
                          scores.data() + r * kKeyTile);
        }
        for (int64_t r = 0; r < row_count; ++r) {
          // Keys up to the row's own position, and none past the end.
          const int64_t sees = std::min(prefix + first + r / group + 1, keys) - first_key;
          float* row = scores.data() + r * kKeyTile;
          const __mmask16 low = first_lanes(sees), high = first_lanes(sees - 16);
          const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          const __m512 a = _mm512_mask_loadu_ps(ninf, low, row);
          const __m512 b = _mm512_mask_loadu_ps(ninf, high, row + 16);
          const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
          const float new_max = std::max(running_max[r], tile_max);
          corrections[r] = std::exp(running_max[r] - new_max);  // 0 on the first tile
          running_max[r] = new_max;
          const __m512 shift = _mm512_set1_ps(new_max);
          const at::vec::Vectorized<float> ea(_mm512_sub_ps(a, shift));
          const at::vec::Vectorized<float> eb(_mm512_sub_ps(b, shift));
          const __m512i rounded = (__m512i)_mm512_cvtne2ps_pbh(
              _mm512_maskz_mov_ps(high, eb.exp_u20()), _mm512_maskz_mov_ps(low, ea.exp_u20()));
          _mm512_storeu_si512(weights.data() + r * kKeyTile, rounded);
          __m512 wa, wb;
          at::vec::cvtbf16_fp32(_mm512_castsi512_si256(rounded), wa);
          at::vec::cvtbf16_fp32(_mm512_extracti64x4_epi64(rounded, 1), wb);
          totals[r] = totals[r] * corrections[r] + _mm512_reduce_add_ps(_mm512_add_ps(wa, wb));
        }
        for (int64_t r = 0; r < row_count; r += kWeightRows) {
          weighted_tile<Dim, kWeightRows>(weight_rows.data() + r,
                                          value_tiles + t * kKeyTile * Dim, sum_rows.data() + r,
                                          corrections.data() + r);
        }
      }
      for (int64_t r = 0; r < row_count; ++r) {
        at::BFloat16* dst = rows.out_row(first + r / group, kv, r % group);
        const float inv = 1.0f / totals[r];  // > 0: every row sees key 0
        const float* src = sums.data() + r * Dim;
        for (int64_t d = 0; d < Dim; ++d) dst[d] = static_cast<at::BFloat16>(src[d] * inv);
      }
    }
  });
}
#endif

// Whether this library runs prompt_attention for this head size.
bool prompt_attention_fits(int64_t head_dim) {
#if defined(__AVX512BF16__)
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
  (void)head_dim;
  return false;
#endif
}

// q [L, H, D] contiguous; k, v [S, kv_heads, D] with S >= L and head_dim contiguous: the
// queries are positions S - L .. S - 1 of a sequence whose keys are k and v, each seeing the
// keys up to its own position. Returns [L, H, D]. All bf16.
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "prompt_attention runs on CPU");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "prompt_attention takes bf16");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [L, H, D]");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must be one [S, kv_heads, D]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k.size(2) == q.size(2), "q, k and v must share head_dim");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(k.size(0) >= q.size(0) && q.size(0) >= 1, "needs 1 <= L <= S");
  TORCH_CHECK(prompt_attention_fits(q.size(2)),
              "prompt_attention needs an AVX512-BF16 build and head_dim 64, 128 or 256");
  at::Tensor out = at::empty(q.sizes(), q.options());
#if defined(__AVX512BF16__)
  switch (q.size(2)) {
    case 64:
      run<64>(q, k, v, scale, out);
      break;
    case 128:
      run<128>(q, k, v, scale, out);
      break;
    default:
      run<256>(q, k, v, scale, out);
  }
#else
  (void)scale;
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("prompt_attention_fits(int head_dim) -> bool", &prompt_attention_fits);
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenline, CPU, m) {
  m.impl("prompt_attention", &prompt_attention);
}
