// bf16 linear layers, on a copy of the weight packed at load into blocks of 64 output
// channels in VNNI pairs: block b holds W[64b + c][2i + j] at [b][i][c][j], i < K/2, so
// each K pair of a block is 256 contiguous bytes and a block is one front-to-back stream.
// Used by model_executor/models/linear.py (and, grouped by expert, moe.py) for steps of up
// to decode_copy_max_rows() rows when the decode copy is on.
//
// Why: a decode step at one row waits on the weight bytes, and oneDNN's packed bf16 matmul
// streamed the 0.5B shape's layers at 13-14 GB/s on the 2-core AMX Xeon (model 207). This
// loop reads 20-23 there: for each K pair, AVX512-BF16's pair dot product (vdpbf16ps) of
// the block's four vectors of 16 channels against each row's broadcast x pair, up to six
// rows at once (24 accumulators), with software prefetch ahead of the loads. Above four rows
// it is bound by the dot products: with AMX the layer keeps oneDNN's packed weight for
// those; without, oneDNN runs the same dot products, this loop is faster or level at every
// step size measured, and the copy takes every step in place of the packed weight.
//
// Built only at the avx512_bf16 ISA level (the instruction needs it); bf16_blocks() says
// whether this library has it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "bf16_pairs.h"
#include "parallel_shared.h"

namespace {

using tokenline::kBlock;

bool bf16_blocks() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_bf16_blocks(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_bf16_blocks: weight must be bf16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_bf16_blocks: K must be even");
  const at::Tensor plain = weight.contiguous();
  const int64_t num_blocks = (N + kBlock - 1) / kBlock;
  at::Tensor packed = at::zeros({num_blocks, K / 2, kBlock, 2}, weight.options());
  const at::BFloat16* wp = plain.data_ptr<at::BFloat16>();
  at::BFloat16* pp = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t channels = std::min(kBlock, N - b * kBlock);
      at::BFloat16* block = pp + b * K * kBlock;
      for (int64_t c = 0; c < channels; ++c) {
        const at::BFloat16* row = wp + (b * kBlock + c) * K;
        for (int64_t k = 0; k < K; ++k) block[(k / 2) * kBlock * 2 + c * 2 + k % 2] = row[k];
      }
    }
  });
  return packed;
}

#if defined(__AVX512BF16__)
// Rows first..first + rows - 1 of x, to be multiplied by one packed weight's blocks.
struct RowGroup {
  int64_t first, rows;
  const at::BFloat16* blocks;
};

// Each group's rows of x [R, K] times its weight's num_blocks blocks, into the same rows of
// out [R, N]: one parallel region sharing out every (group, block) piece.
void groups_times_blocks(const at::BFloat16* x, int64_t K, const std::vector<RowGroup>& groups,
                         int64_t num_blocks, int64_t N, at::BFloat16* out) {
  const auto pieces = static_cast<int64_t>(groups.size()) * num_blocks;
  tokenline::parallel_for_shared(pieces, [&](int64_t begin, int64_t end) {
    for (int64_t piece = begin; piece < end; ++piece) {
      const RowGroup& group = groups[piece / num_blocks];
      const int64_t n = (piece % num_blocks) * kBlock, channels = std::min(kBlock, N - n);
      tokenline::rows_times_block(x + group.first * K, group.rows, K, group.blocks + n * K,
                                  channels, out + group.first * N + n, N, /*stream=*/true);
    }
  });
}
#endif

// x [M, K] bf16 times the packed weight's [N, K]^T: [M, N] bf16. Any M (rows beyond four
// take more passes over each block, from cache), though it pays only for few.
at::Tensor bf16_blocks_mm(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "bf16_blocks_mm: x must be bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "bf16_blocks_mm: packed must come from pack_bf16_blocks");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K && (N + kBlock - 1) / kBlock == num_blocks,
              "bf16_blocks_mm: x, packed and N disagree");
#if defined(__AVX512BF16__)
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  groups_times_blocks(rows.data_ptr<at::BFloat16>(), K,
                      {{0, M, packed.data_ptr<at::BFloat16>()}}, num_blocks, N,
                      out.data_ptr<at::BFloat16>());
  return out;
#else
  TORCH_CHECK(false, "bf16_blocks_mm: this library was built without AVX512-BF16");
#endif
}

// Grouped by expert: rows offsets[e]..offsets[e+1]-1 of x [R, K] times expert e's packed
// weight (packed [E, blocks, K/2, 64, 2], each expert's from pack_bf16_blocks): [R, N] bf16.
// One parallel region shares out every (expert with rows, block) piece, where a loop over
// the experts would open one per expert per projection (two per expert and layer in a
// mixture-of-experts step); each row's sums are those of bf16_blocks_mm on its expert alone.
at::Tensor bf16_grouped_blocks_mm(const at::Tensor& x, const at::Tensor& offsets,
                                  const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "bf16_grouped_blocks_mm: x must be bf16 [R, K]");
  TORCH_CHECK(packed.dim() == 5 && packed.size(3) == kBlock && packed.size(4) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "bf16_grouped_blocks_mm: packed must stack pack_bf16_blocks' outputs");
  const int64_t R = x.size(0), K = x.size(1), experts = packed.size(0), num_blocks = packed.size(1);
  TORCH_CHECK(packed.size(2) * 2 == K && (N + kBlock - 1) / kBlock == num_blocks,
              "bf16_grouped_blocks_mm: x, packed and N disagree");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == experts + 1 &&
                  offsets.scalar_type() == at::kLong,
              "bf16_grouped_blocks_mm: offsets must be int64 [E + 1]");
  const at::Tensor bounds = offsets.contiguous();
  const int64_t* starts = bounds.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[experts] == R,
              "bf16_grouped_blocks_mm: offsets must run from 0 to x's rows");
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(starts[e] <= starts[e + 1], "bf16_grouped_blocks_mm: offsets must not fall");
  }
#if defined(__AVX512BF16__)
  const at::Tensor rows = x.contiguous();
  const at::BFloat16* pp = packed.data_ptr<at::BFloat16>();
  std::vector<RowGroup> groups;  // the experts with rows
  for (int64_t e = 0; e < experts; ++e) {
    if (starts[e] < starts[e + 1]) {
      groups.push_back({starts[e], starts[e + 1] - starts[e], pp + e * num_blocks * K * kBlock});
    }
  }
  at::Tensor out = at::empty({R, N}, x.options());
  groups_times_blocks(rows.data_ptr<at::BFloat16>(), K, groups, num_blocks, N,
                      out.data_ptr<at::BFloat16>());
  return out;
#else
  TORCH_CHECK(false, "bf16_grouped_blocks_mm: this library was built without AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("bf16_blocks() -> bool", &bf16_blocks);
  m.def("pack_bf16_blocks(Tensor weight) -> Tensor");
  m.def("bf16_blocks_mm(Tensor x, Tensor packed, int N) -> Tensor");
  m.def("bf16_grouped_blocks_mm(Tensor x, Tensor offsets, Tensor packed, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenline, CPU, m) {
  m.impl("pack_bf16_blocks", &pack_bf16_blocks);
  m.impl("bf16_blocks_mm", &bf16_blocks_mm);
  m.impl("bf16_grouped_blocks_mm", &bf16_grouped_blocks_mm);
}
