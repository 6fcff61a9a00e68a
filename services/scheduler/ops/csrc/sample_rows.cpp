// One token per row of the LM head's logits: the row's argmax where its inverse temperature
// is 0 (greedy), else an exact draw from softmax(x * inv_temperature). Built per machine by
// services/scheduler/ops/cpu_kernels.py.
//
// Two exact ways to draw, both free of any full-row exp sum where they can be:
//
// * By proposals (rows without a uniform of their own: unseeded requests). The row is cut
//   into strided groups of 16 entries (group g holds g, g + G, g + 2G, ...), so one
//   vertical max over 16 slices gives every group's maximum m_g. A group's mass is at most
//   count_g * exp((m_g - M) * inv), M the row's maximum: a group is proposed in proportion
//   to that bound, a member uniformly within it, and accepted with probability
//   exp((x - m_g) * inv), so an accepted entry has probability proportional to
//   exp(x * inv) (to the rounding of the bound's exp_u20, about 2e-6 relative, as in
//   torch.softmax). At least 1 proposal in 16 is accepted whatever the row; a row that
//   accepts none of `max_proposals` falls back to the inverse CDF below with a fresh
//   uniform, which keeps the draw exact. Randomness: torch's Philox engine, seeded per
//   call, one subsequence per row.
// * By inverse CDF at the row's uniform (seeded requests, whose token must be a function of
//   their own generator's draw alone, as on the eager path). One read for the maximum, one
//   for the mass of each 128-entry block (exp of every entry, torch's exp_u20: the exp
//   torch.softmax uses on CPU); a block is picked by its mass and only its 128 weights are
//   computed again.
//
// Rows are independent (each is drawn by one thread), so a seeded row draws the same token
// alone or in any batch.

#include <ATen/Parallel.h>
#include <ATen/core/PhiloxRNGEngine.h>
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
constexpr int64_t kBlock = 128;  // the block size the Python sampler's search uses too
constexpr float kInf = std::numeric_limits<float>::infinity();

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
  return lane_sum(sum);
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

constexpr int64_t kGroupSize = 16;  // members of a strided proposal group

// Uniform doubles in [0, 1) from torch's Philox engine (53 random bits each).
class Uniforms {
 public:
  Uniforms(uint64_t seed, uint64_t subsequence) : engine_(seed, subsequence) {}
  double next() {
    const uint64_t high = engine_(), low = engine_();
    return static_cast<double>((high << 21) | (low >> 11)) * 0x1.0p-53;
  }

 private:
  at::Philox4_32 engine_;
};

// Per-thread buffers of the proposal draw.
struct ProposalScratch {
  std::vector<float> group_max;
  std::vector<float> bounds;
  std::vector<double> cumulative;
};

// A draw by proposals, or -1 when none of `max_proposals` was accepted (or the row's
// maximum is not finite: the caller decides what such a row gets).
template <typename T>
int64_t draw_by_proposals(
    const T* x, int64_t n, float inv, Uniforms& uniforms, int64_t max_proposals,
    ProposalScratch& scratch) {
  const int64_t groups = (n + kGroupSize - 1) / kGroupSize;
  std::vector<float>& group_max = scratch.group_max;
  group_max.assign(groups, -kInf);
  float* m = group_max.data();
  for (int64_t k = 0; k * groups < n; ++k) {  // slice k: entries [k * groups, (k + 1) * groups)
    const T* slice = x + k * groups;
    const int64_t len = std::min(groups, n - k * groups);
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes) {
      at::vec::maximum(Vec::loadu(m + i), load_floats(slice + i)).store(m + i);
    }
    if (i < len) {
      const int64_t count = len - i;
      at::vec::maximum(Vec::loadu(m + i, count), load_tail(slice + i, count, -kInf))
          .store(m + i, count);
    }
  }
  const float top = row_max(m, groups);  // NaN if the row holds one
  if (!std::isfinite(top)) return -1;
  // Each group's bound, count_g * exp((m_g - top) * inv), and the running total of the
  // bounds at the end of each vector's worth of groups (a proposal finds its vector by
  // binary search, then its group by a scan of that vector). The first `longer` groups
  // have one member more than the others: the last slice is short.
  const int64_t full_slices = n / groups, longer = n - full_slices * groups;
  const int64_t chunks = (groups + kLanes - 1) / kLanes;
  std::vector<float>& bounds = scratch.bounds;
  std::vector<double>& cumulative = scratch.cumulative;
  bounds.resize(chunks * kLanes);
  cumulative.resize(chunks);
  alignas(64) float lane_index[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) lane_index[j] = static_cast<float>(j);
  const Vec v_inv(inv), v_top(top), v_lanes = Vec::loadu(lane_index);
  const Vec v_full(static_cast<float>(full_slices)), v_one(1.0f);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t g = c * kLanes, count = std::min(kLanes, groups - g);
    const Vec index = v_lanes + Vec(static_cast<float>(g));
    const Vec members = Vec::blendv(v_full, v_full + v_one, index < Vec(longer));
    const Vec bound = ((Vec::loadu(m + g, count) - v_top) * v_inv).exp_u20() * members;
    const Vec kept = Vec::blendv(Vec(0.0f), bound, index < Vec(static_cast<float>(groups)));
    kept.store(bounds.data() + g);
    total += lane_sum(kept);
    cumulative[c] = total;
  }
  const double* cum = cumulative.data();
  const float* bound = bounds.data();
  for (int64_t t = 0; t < max_proposals; ++t) {
    const double target = uniforms.next() * total;
    const int64_t c = std::min<int64_t>(std::upper_bound(cum, cum + chunks, target) - cum, chunks - 1);
    double left = target - (c > 0 ? cum[c - 1] : 0.0);
    int64_t g = -1;
    for (int64_t j = c * kLanes; j < std::min(groups, (c + 1) * kLanes); ++j) {
      if (bound[j] > 0.0f) {
        g = j;  // rounding can leave `left` past the chunk's last group: that one, then
        left -= bound[j];
        if (left < 0.0) break;
      }
    }
    if (g < 0) continue;
    const int64_t members = g < longer ? full_slices + 1 : full_slices;
    const auto k = std::min<int64_t>(static_cast<int64_t>(uniforms.next() * members), members - 1);
    const int64_t index = k * groups + g;
    const double gap = (static_cast<double>(x[index]) - static_cast<double>(m[g])) * inv;
    if (uniforms.next() < std::exp(gap)) return index;
  }
  return -1;
}

template <typename T>
void sample_rows_typed(
    const at::Tensor& logits, const float* inv, const float* own_uniforms, uint64_t seed,
    int64_t max_proposals, int64_t* out) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const T* data = logits.const_data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> mass;
    ProposalScratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      const T* x = data + r * n;
      if (!(inv[r] > 0.0f)) {
        out[r] = argmax_row(x, n);
      } else if (own_uniforms[r] >= 0.0f) {
        out[r] = draw_row(x, n, inv[r], static_cast<double>(own_uniforms[r]), mass);
      } else {
        Uniforms uniforms(seed, static_cast<uint64_t>(r));
        const int64_t token = draw_by_proposals(x, n, inv[r], uniforms, max_proposals, scratch);
        out[r] = token >= 0 ? token : draw_row(x, n, inv[r], uniforms.next(), mass);
      }
    }
  });
}

at::Tensor sample_rows(
    const at::Tensor& logits, const at::Tensor& inv_temperature, const at::Tensor& uniforms,
    int64_t seed, int64_t max_proposals) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu(), "logits must be [rows, vocab] on CPU");
  TORCH_CHECK(logits.size(1) > 0, "logits need a vocabulary");
  TORCH_CHECK(max_proposals >= 0, "max_proposals must be >= 0");
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
  const auto key = static_cast<uint64_t>(seed);
  switch (x.scalar_type()) {
    case at::kFloat:
      sample_rows_typed<float>(x, inv_ptr, u_ptr, key, max_proposals, out_ptr);
      break;
    case at::kBFloat16:
      sample_rows_typed<at::BFloat16>(x, inv_ptr, u_ptr, key, max_proposals, out_ptr);
      break;
    case at::kHalf:
      sample_rows_typed<at::Half>(x, inv_ptr, u_ptr, key, max_proposals, out_ptr);
      break;
    default:
      TORCH_CHECK(false, "logits must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenline, m) {
  m.def(
      "sample_rows(Tensor logits, Tensor inv_temperature, Tensor uniforms, int seed, "
      "int max_proposals=256) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenline, CPU, m) {
  m.impl("sample_rows", &sample_rows);
}
