// Weight-only int8 matmul on CPU: out[m, n] = scale[n] * sum_k x[m, k] * q[n, k], with q int8
// [N, K] in its plain row-major layout and one float32 scale per output channel. Built per
// machine with the other kernels by services/scheduler/ops/cpu_kernels.py; used by
// model_executor/models/int8/int8_weight.py for decode-sized batches (the float loop below) and
// for bf16 batches of more rows on oneDNN's tile kernels where they run (AMX, the tile path
// further down). Where AVX512-BF16 runs without AMX, bf16 models' int8 matmuls take the w8a8
// kernel with two-part rows instead (w8a8.cpp), which replaced a pair path here.
//
// A decode step at a few rows waits on the weight bytes. torch's own kernel
// (aten._weight_int8pack_mm) streamed the 0.5B shape's int8 weights at 9-14 GB/s at one row on
// the AMX Xeon (model 207), below the 13-34 GB/s oneDNN's packed bf16 matmul streams twice the
// bytes at, so int8 gained little there and lost on the LM head. This kernel is built to stay
// on the memory: each output channel's int8 row is read once per call (the row blocks reuse it
// from cache), widened to float32 sixteen lanes at a time (eight with AVX2) and multiplied
// into up to 4 x 4 float32 accumulators (2 x 4 with AVX2), the rows read in float32 once per
// call.
//
// Each output element is one float32 sum over K in the same order whatever the row count or
// the thread split (rows only share the weight's loads), so a row's result does not depend on
// its batch: batch-invariant. K needs no particular multiple (a scalar loop takes the tail).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "float_vec.h"

#include <algorithm>
#include <cstdint>
#include <memory>

namespace {

using tokenline::kLanes;
using tokenline::lane_sum;
using tokenline::Vec;

// Rows of x kept in registers together. Two rows by four channels are eight float32
// accumulators, which GCC 12 keeps in registers as at::vec vectors; with four rows (16) it
// kept that array in memory and loaded and stored it on every step, and two passes of two
// rows took 0.5-0.75x the time at 4 and 8 rows on the Zen 4 EPYC. On AVX-512, block512
// holds four rows' sixteen accumulators as raw __m512 (in registers): one pass where two
// were, 0.75-0.85x their time at 4 and 6 rows there, level at 1 and 2. AVX2's sixteen
// registers stay at two rows.
constexpr int64_t kRowBlock = kLanes == 16 ? 4 : 2;
constexpr int64_t kChannelBlock = 4;  // output channels read together
constexpr int64_t kGrainChannels = 64;
constexpr int64_t kLine = 64;  // bytes of a cache line
// Software prefetch this many bytes ahead in the weight (a thread's channels are one
// contiguous run), into L2 (prefetcht1): without prefetch the loop read 8-9 GB/s on the AMX
// Xeon, with it 15-23. On the Zen 4 EPYC, two channel blocks ahead (7 KiB at K = 896) into
// L1 left the LM head and the gate-up projection at 9-11 GB/s; 4-128 KiB ahead into L1,
// 16-18; 16-64 KiB into L2 (or L3), 23-36 (the LM head 4.3-5.1 ms against the bf16 decode
// copy's 9.3).
constexpr int64_t kPrefetchBytes = 32 * 1024;

// Sixteen int8 weights (eight with AVX2) as float lanes.
inline Vec widen(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return at::vec::convert_int8_to_float<int8_t>(at::vec::Vectorized<int8_t>::loadu_one_fourth(p));
#else
  __at_align__ float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(p[i]);
  return Vec::loadu(lanes);
#endif
}

// dots[m, j]: the lane sum of acc[m][j] (by `lane_total`) plus the scalar tail of its dot
// product over [vector_end, K). The lane sums come first, in loops of fixed trip counts that
// unroll: an epilogue that indexed acc inside the tail's loop kept acc in memory for the
// whole block, and its main loop then loaded and stored the accumulators on every step
// (GCC 12: one row read 21 GB/s of int8 from L3 on the Zen 4 EPYC, 34-38 in registers).
template <int64_t MR, int64_t NR, typename Acc, typename LaneTotal>
inline void finish_block(const Acc (&acc)[MR][NR], LaneTotal lane_total, const float* x,
                         const int8_t* q, int64_t K, int64_t vector_end, float* dots,
                         int64_t dots_stride) {
  float totals[MR][NR];
#pragma GCC unroll 4
  for (int64_t m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int64_t j = 0; j < NR; ++j) totals[m][j] = lane_total(acc[m][j]);
  }
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t j = 0; j < NR; ++j) {
      float total = totals[m][j];
      for (int64_t k = vector_end; k < K; ++k) total += x[m * K + k] * static_cast<float>(q[j * K + k]);
      dots[m * dots_stride + j] = total;
    }
  }
}

// out[m, n] for MR rows from `x` (float32, row stride K) and NR channels from `q` (row stride
// K), each a float32 dot product summed lane-wise over the vector part, then its lanes, then
// the scalar tail: the same order for every (MR, NR).
template <int64_t MR, int64_t NR>
void block(const float* x, const int8_t* q, int64_t K, float* dots, int64_t dots_stride) {
  Vec acc[MR][NR];
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t j = 0; j < NR; ++j) acc[m][j] = Vec(0.0f);
  }
  const int64_t vector_end = K - K % kLanes;
  for (int64_t k = 0; k < vector_end; k += kLanes) {
    if (k % kLine == 0) {  // each channel's line kPrefetchBytes ahead
      const int8_t* ahead = q + kPrefetchBytes + k;
      for (int64_t j = 0; j < NR; ++j) __builtin_prefetch(ahead + j * K, 0, 2);
    }
    Vec w[NR];
    for (int64_t j = 0; j < NR; ++j) w[j] = widen(q + j * K + k);
    for (int64_t m = 0; m < MR; ++m) {
      const Vec xv = Vec::loadu(x + m * K + k);
      for (int64_t j = 0; j < NR; ++j) acc[m][j] = at::vec::fmadd(xv, w[j], acc[m][j]);
    }
  }
  finish_block<MR, NR>(acc, [](const Vec& v) { return lane_sum(v); }, x, q, K, vector_end, dots,
                       dots_stride);
}

#if defined(CPU_CAPABILITY_AVX512)
// block's loop on raw AVX-512 registers, for four rows: GCC 12 keeps an array of sixteen
// at::vec vectors in memory, but sixteen __m512 accumulators (of 32 registers) in registers,
// so four rows take one pass over the channels' bytes instead of two.
template <int64_t MR, int64_t NR>
void block512(const float* x, const int8_t* q, int64_t K, float* dots, int64_t dots_stride) {
  __m512 acc[MR][NR];
#pragma GCC unroll 4
  for (int64_t m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int64_t j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  const int64_t vector_end = K - K % 16;
  for (int64_t k = 0; k < vector_end; k += 16) {
    if (k % kLine == 0) {
      const int8_t* ahead = q + kPrefetchBytes + k;
#pragma GCC unroll 4
      for (int64_t j = 0; j < NR; ++j) __builtin_prefetch(ahead + j * K, 0, 2);
    }
    __m512 w[NR];
#pragma GCC unroll 4
    for (int64_t j = 0; j < NR; ++j) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * K + k));
      w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    }
#pragma GCC unroll 4
    for (int64_t m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
#pragma GCC unroll 4
      for (int64_t j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(xv, w[j], acc[m][j]);
    }
  }
  finish_block<MR, NR>(acc, [](__m512 v) { return _mm512_reduce_add_ps(v); }, x, q, K, vector_end,
                       dots, dots_stride);
}
#endif

// One block of the float loop: on raw AVX-512 registers where the build has them.
template <int64_t MR, int64_t NR>
inline void run_block(const float* x, const int8_t* q, int64_t K, float* dots, int64_t stride) {
#if defined(CPU_CAPABILITY_AVX512)
  block512<MR, NR>(x, q, K, dots, stride);
#else
  block<MR, NR>(x, q, K, dots, stride);
#endif
}

template <int64_t MR>
void block_rows(int64_t nr, const float* x, const int8_t* q, int64_t K, float* dots, int64_t stride) {
  switch (nr) {
    case 4: return run_block<MR, 4>(x, q, K, dots, stride);
    case 3: return run_block<MR, 3>(x, q, K, dots, stride);
    case 2: return run_block<MR, 2>(x, q, K, dots, stride);
    default: return run_block<MR, 1>(x, q, K, dots, stride);
  }
}

void any_block(int64_t mr, int64_t nr, const float* x, const int8_t* q, int64_t K, float* dots,
               int64_t stride) {
  switch (mr) {
    case 4: return block_rows<4>(nr, x, q, K, dots, stride);
    case 3: return block_rows<3>(nr, x, q, K, dots, stride);
    case 2: return block_rows<2>(nr, x, q, K, dots, stride);
    default: return block_rows<1>(nr, x, q, K, dots, stride);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// More rows, bf16, where oneDNN's tile kernels run (AMX): the transposed product
// out^T = W x^T, a block of kTileChannels output channels at a time. Each block's int8
// rows are widened once into bf16 scratch (exact: |q| <= 127 fits bf16's 8 significant
// bits), which is the brgemm's plain row-major A; x^T is packed for it once per call, a
// tile of up to kTileRows rows at a time. The weight is read from memory once and widened
// once whatever the row count, and the tiles do the multiplies. A row's bits depend on
// whether its batch took this path, so row-independent calls never do.
constexpr int64_t kTileChannels = 64;  // A's rows per brgemm
constexpr int64_t kTileRows = 64;      // packed columns: oneDNN packs at most 64
// Up to this many rows the float path is as fast or faster (at 8 rows: the 0.5B shape's
// gate-up level, its down projection 0.5 against 1.1 ms; the LM head 16 against 12.5).
constexpr int64_t kTileMinRows = 8;

// A tile's packed columns: its rows rounded up to what oneDNN packs (a multiple of 16).
inline int64_t tile_columns(int64_t rows) { return (rows + 15) / 16 * 16; }

// Scratch that every element of is written before it is read: no zeroing pass.
template <typename T>
std::unique_ptr<T[]> uninitialized(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

bool tiles_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

void widen_block_to_bf16(const int8_t* q, int64_t elements, at::BFloat16* out) {
  using Bf16Vec = at::vec::Vectorized<at::BFloat16>;
  const int64_t step = Bf16Vec::size();  // two float vectors' worth
  int64_t i = 0;
  for (; i + step <= elements; i += step) {
    const Vec low = widen(q + i), high = widen(q + i + kLanes);
    at::vec::convert_from_float<at::BFloat16>(low, high).store(out + i);
  }
  for (; i < elements; ++i) out[i] = static_cast<float>(q[i]);
}

at::Tensor int8_tiles_mm(const at::Tensor& x, const int8_t* qp, const float* sp, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor rows = x.contiguous();
  const at::BFloat16* xp = rows.data_ptr<at::BFloat16>();
  const int64_t num_tiles = (M + kTileRows - 1) / kTileRows;
  const auto packed = uninitialized<at::BFloat16>(num_tiles * K * kTileRows);
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    const auto transposed = uninitialized<at::BFloat16>(K * kTileRows);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTileRows, rows_in = std::min(kTileRows, M - first);
      const int64_t cols = tile_columns(rows_in);
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t r = 0; r < cols; ++r) {
          transposed[k * cols + r] = r < rows_in ? xp[(first + r) * K + k] : at::BFloat16(0.0f);
        }
      }
      at::native::cpublas::pack(K, cols, cols, cols, at::kBFloat16, at::kBFloat16,
                                transposed.get(), packed.get() + t * K * kTileRows);
    }
  });
  at::Tensor out = at::empty({M, N}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t num_blocks = (N + kTileChannels - 1) / kTileChannels;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    const auto weights = uninitialized<at::BFloat16>(kTileChannels * K);
    const auto products = uninitialized<float>(kTileChannels * kTileRows);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kTileChannels, channels = std::min(kTileChannels, N - n);
      widen_block_to_bf16(qp + n * K, channels * K, weights.get());
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t first = t * kTileRows, rows_in = std::min(kTileRows, M - first);
        const int64_t cols = tile_columns(rows_in);
        at::native::cpublas::brgemm(channels, cols, K, K, cols, cols, false, weights.get(),
                                    packed.get() + t * K * kTileRows, products.get());
        for (int64_t c = 0; c < channels; ++c) {
          const float scale = sp[n + c];
          for (int64_t r = 0; r < rows_in; ++r) {
            op[(first + r) * N + n + c] = products[c * cols + r] * scale;
          }
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}
#endif

// Whether int8_rows_mm multiplies many bf16 rows on tiles here (built for AVX-512 and the
// CPU has oneDNN's tile kernels): then it beats dequantising at any row count.
bool int8_tiles() {
#if defined(CPU_CAPABILITY_AVX512)
  return tiles_available();
#else
  return false;
#endif
}

at::Tensor int8_rows_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        bool row_independent) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2, "int8_rows_mm: x [M, K] and qweight [N, K]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "int8_rows_mm: qweight must be contiguous int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == qweight.size(0),
              "int8_rows_mm: scales must be float32 [N]");
  TORCH_CHECK(x.size(1) == qweight.size(1), "int8_rows_mm: x and qweight disagree on K");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const at::Tensor scale = scales.contiguous();
#if defined(CPU_CAPABILITY_AVX512)
  if (M > kTileMinRows && x.scalar_type() == at::kBFloat16 && !row_independent && K % 2 == 0 &&
      tiles_available()) {
    return int8_tiles_mm(x, qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), N);
  }
#endif
  const at::Tensor rows = x.to(at::kFloat).contiguous();
  at::Tensor dots = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = rows.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* dp = dots.data_ptr<float>();
  at::parallel_for(0, N, kGrainChannels, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += kChannelBlock) {
      const int64_t nr = std::min(kChannelBlock, end - n);
      for (int64_t m = 0; m < M; m += kRowBlock) {  // the channels' rows stay in cache
        any_block(std::min(kRowBlock, M - m), nr, xp + m * K, qp + n * K, K, dp + m * N + n, N);
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < nr; ++j) dp[m * N + n + j] *= sp[n + j];
      }
    }
  });
  return x.scalar_type() == at::kFloat ? dots : dots.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("int8_rows_mm(Tensor x, Tensor qweight, Tensor scales, bool row_independent=False) -> Tensor");
  m.def("int8_tiles() -> bool", &int8_tiles);
}

TORCH_LIBRARY_IMPL(tokenline, CPU, m) {
  m.impl("int8_rows_mm", &int8_rows_mm);
}
