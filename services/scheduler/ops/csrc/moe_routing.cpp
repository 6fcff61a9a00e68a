// A mixture-of-experts layer's routing and the weighted sum of its experts' rows, one call
// each, on CPU. Built per machine with the other kernels by services/scheduler/ops/
// cpu_kernels.py; used by model_executor/models/moe.py.
//
// Eagerly the routing is about fifteen small ops per layer (softmax in float32, top-k, the
// renormalisation, a stable argsort by expert, bincount, cumsum, the pad to offsets, the
// gathers) and the weighted sum four (a gather of the weights, their cast, the product, an
// index_add_ into zeros). In a one-request decode step of the MoE checkpoint they took
// about a tenth of the step beside the matmuls (torch.profiler, 2026-12-08). Here each is
// one pass.
//
// moe_route gives the same pairs in the same order as the eager path: sorted by expert,
// stably, so by token within an expert. Its weights differ from eager only in the last bits
// of float32 exps and sums (renormalised, it divides by the chosen ones' sum without the
// full softmax's), and in ties: where logits tie at the k-th place it takes the
// lower expert, where torch.topk's choice is its sort's. moe_combine rounds where the eager
// ops round (the weight to the model dtype, each product, then the float32 sum index_add_
// accumulates) and adds a token's rows in position order, so by expert: the eager bits in
// bf16 and fp16 (in float32 the compiler may fuse a product into the sum, a last-bit
// difference). Every token is routed and summed alone and in the same order whatever the
// batch: batch-invariant.

#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "float_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using tokenline::grain_rows;
using tokenline::kLanes;
using tokenline::load_floats;
using tokenline::round_to;
using tokenline::store;
using tokenline::Vec;

// One token's `top_k` experts by router probability (the logits' order), highest first, ties
// to the lower expert, in one pass over the logits; their softmax probabilities,
// renormalised to sum to one if asked (then only the chosen ones' exps are needed: the
// full sum cancels).
template <typename T>
void route_token(const T* logits, int64_t experts, int64_t top_k, bool renormalize,
                 int64_t* chosen, float* weights) {
  auto logit = [&](int64_t e) { return static_cast<float>(logits[e]); };
  int64_t count = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const float value = logit(e);
    if (count == top_k && !(value > logit(chosen[top_k - 1]))) {
      continue;  // not above the k-th: an equal one stays behind the lower expert
    }
    int64_t at = count < top_k ? count++ : top_k - 1;
    for (; at > 0 && value > logit(chosen[at - 1]); --at) chosen[at] = chosen[at - 1];
    chosen[at] = e;
  }
  const float top = logit(chosen[0]);
  float total = 0.0f;
  if (renormalize) {
    for (int64_t slot = 0; slot < top_k; ++slot) total += std::exp(logit(chosen[slot]) - top);
  } else {
    for (int64_t e = 0; e < experts; ++e) total += std::exp(logit(e) - top);
  }
  for (int64_t slot = 0; slot < top_k; ++slot) {
    weights[slot] = std::exp(logit(chosen[slot]) - top) / total;
  }
}

// A stable counting sort of n keys in [0, buckets): starts [buckets + 1], where each key's
// run begins, and order [n], the indices by key (by index within a key). Routing sorts the
// pairs by expert with it, the weighted sum by token.
void sort_by_bucket(const int64_t* keys, int64_t n, int64_t buckets, int64_t* starts,
                    int64_t* order) {
  std::fill(starts, starts + buckets + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    ++starts[keys[i] + 1];
  }
  for (int64_t b = 0; b < buckets; ++b) {
    starts[b + 1] += starts[b];
  }
  std::vector<int64_t> next(starts, starts + buckets);
  for (int64_t i = 0; i < n; ++i) {
    order[next[keys[i]]++] = i;
  }
}

// logits [T, E]: each token's top_k experts. Returns the T * top_k (token, expert) pairs
// sorted by expert, stably: the token of each (int64), its routing weight (float32), and
// offsets [E + 1] (int64) where expert e's pairs start.
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& logits,
                                                         int64_t top_k, bool renormalize) {
  TORCH_CHECK(logits.device().is_cpu(), "moe_route runs on CPU");
  TORCH_CHECK(logits.dim() == 2, "moe_route: logits must be [tokens, experts]");
  const int64_t tokens = logits.size(0);
  const int64_t experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe_route: top_k must be in 1..experts");
  const at::Tensor dense = logits.contiguous();
  const int64_t pairs = tokens * top_k;
  std::vector<int64_t> chosen(pairs);
  std::vector<float> weights(pairs);
  AT_DISPATCH_V2(
      dense.scalar_type(), "moe_route", AT_WRAP([&] {
        const scalar_t* rows = dense.data_ptr<scalar_t>();
        at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            route_token(rows + t * experts, experts, top_k, renormalize,
                        chosen.data() + t * top_k, weights.data() + t * top_k);
          }
        });
      }),
      at::kFloat, at::kBFloat16, at::kHalf);

  at::Tensor offsets = at::empty({experts + 1}, logits.options().dtype(at::kLong));
  std::vector<int64_t> order(pairs);  // pairs in (token, slot) order, sorted by expert
  sort_by_bucket(chosen.data(), pairs, experts, offsets.data_ptr<int64_t>(), order.data());
  at::Tensor token_of = at::empty({pairs}, offsets.options());
  at::Tensor sorted_weights = at::empty({pairs}, logits.options().dtype(at::kFloat));
  int64_t* token_out = token_of.data_ptr<int64_t>();
  float* weight_out = sorted_weights.data_ptr<float>();
  for (int64_t position = 0; position < pairs; ++position) {
    token_out[position] = order[position] / top_k;
    weight_out[position] = weights[order[position]];
  }
  return {token_of, sorted_weights, offsets};
}

// out[t] = the sum over token t's rows p (in position order) of weight[p] * rows[p]: the
// weight and each product rounded to T, the sum in float32, rounded to T once.
template <typename T>
void combine_rows(const T* rows, int64_t width, const float* weights, const int64_t* starts,
                  const int64_t* positions, int64_t tokens, T* out) {
  at::parallel_for(0, tokens, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* dst = out + t * width;
      int64_t d = 0;
      for (; d + 2 * kLanes <= width; d += 2 * kLanes) {
        Vec sum_a(0.0f);
        Vec sum_b(0.0f);
        for (int64_t i = starts[t]; i < starts[t + 1]; ++i) {
          const T* row = rows + positions[i] * width + d;
          const Vec weight(round_to<T>(weights[positions[i]]));
          Vec a = load_floats(row) * weight;
          Vec b = load_floats(row + kLanes) * weight;
          round_to<T>(a, b);
          sum_a = sum_a + a;
          sum_b = sum_b + b;
        }
        store<T>(dst + d, sum_a, sum_b);
      }
      for (; d < width; ++d) {
        float sum = 0.0f;
        for (int64_t i = starts[t]; i < starts[t + 1]; ++i) {
          const float weight = round_to<T>(weights[positions[i]]);
          const float row = static_cast<float>(rows[positions[i] * width + d]);
          sum += round_to<T>(row * weight);
        }
        dst[d] = static_cast<T>(sum);
      }
    }
  });
}

// rows [P, H] (the experts' outputs for the pairs moe_route sorted), weights [P] float32
// and token_of [P] as it returned them: [tokens, H] in rows' dtype, each token's rows
// weighted and summed; zero for a token with none.
at::Tensor moe_combine(const at::Tensor& rows, const at::Tensor& weights,
                       const at::Tensor& token_of, int64_t tokens) {
  TORCH_CHECK(rows.device().is_cpu(), "moe_combine runs on CPU");
  TORCH_CHECK(rows.dim() == 2, "moe_combine: rows must be [pairs, hidden]");
  const int64_t pairs = rows.size(0);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 1 &&
                  weights.size(0) == pairs,
              "moe_combine: weights must be float32 [pairs]");
  TORCH_CHECK(token_of.scalar_type() == at::kLong && token_of.dim() == 1 &&
                  token_of.size(0) == pairs,
              "moe_combine: token_of must be int64 [pairs]");
  TORCH_CHECK(tokens >= 0, "moe_combine: tokens must not be negative");
  const at::Tensor dense_rows = rows.contiguous();
  const at::Tensor dense_weights = weights.contiguous();
  const at::Tensor dense_tokens = token_of.contiguous();
  const int64_t* token_at = dense_tokens.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(token_at[p] >= 0 && token_at[p] < tokens, "moe_combine: token out of range");
  }
  // Each token's positions, in position order.
  std::vector<int64_t> starts(tokens + 1);
  std::vector<int64_t> positions(pairs);
  sort_by_bucket(token_at, pairs, tokens, starts.data(), positions.data());
  const int64_t width = rows.size(1);
  at::Tensor out = at::empty({tokens, width}, rows.options());
  AT_DISPATCH_V2(
      rows.scalar_type(), "moe_combine", AT_WRAP([&] {
        combine_rows<scalar_t>(dense_rows.data_ptr<scalar_t>(), width,
                               dense_weights.data_ptr<float>(), starts.data(),
                               positions.data(), tokens, out.data_ptr<scalar_t>());
      }),
      at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("moe_route(Tensor logits, int top_k, bool renormalize) -> (Tensor, Tensor, Tensor)");
  m.def("moe_combine(Tensor rows, Tensor weights, Tensor token_of, int tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenline, CPU, m) {
  m.impl("moe_route", &moe_route);
  m.impl("moe_combine", &moe_combine);
}
