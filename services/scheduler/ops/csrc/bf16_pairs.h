// What the kernels that multiply bf16 pairs (vdpbf16ps) share: a pair of bf16 broadcast to
// every lane, the mask of a vector's first lanes, and the block layout of 64 output
// channels in VNNI pairs with the loop that multiplies rows by it (bf16_blocks.cpp packs
// weights into it at load; the attention kernels and w8a8.cpp use the helpers). Only where
// the build has AVX512-BF16 (the layout's width at every level: packing needs no instruction).
#pragma once

#include <cstdint>

namespace tokenline {
constexpr int64_t kBlock = 64;  // output channels a block holds: [K / 2][64][2] bf16
}  // namespace tokenline

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>

#include "row_count.h"

namespace tokenline {

// The two bf16 at `p` in every 32-bit lane: one row's operand pair against a vector of pairs.
inline __m512bh broadcast_pair(const void* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// The first `count` lanes of a vector: none at 0 or below, all 16 from 16 up.
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

constexpr int64_t kPairBytes = kBlock * 2 * 2;  // one K pair of a block: 256 bytes
constexpr int64_t kLineBytes = 64;               // a cache line
constexpr int64_t kPairLines = kPairBytes / kLineBytes;
constexpr int64_t kMaxRows = 6;                  // rows kept in registers together
// Software prefetch this many K pairs (8 KiB) ahead of the loads, into L2 (prefetcht1). On
// the Zen 4 EPYC this took a one-row decode step's copies from 322-363 to 285-342 ms over
// ten steps (six alternations; medians 338 and 304), and 16-row calls 0.6-1.0x the time,
// against 2 KiB into L1.
constexpr int64_t kPrefetchPairs = 32;
// A step of more than kMaxRows rows goes over the block's K pairs a chunk at a time, each
// row group of its first kPanelRows rows in turn: the first group reads the chunk from
// memory, the others from L1 (8 KiB of 32), while the groups' prefetches, a chunk ahead,
// bring the next one. Passing over the whole block per group, as the loop did until
// 2026-12-07, left the memory idle after the first pass: on the Zen 4 EPYC the 0.5B shape's
// layers at 16 rows took 43-47 ms against 50-52, at 8 rows 29-32 against 39-40.
constexpr int64_t kChunkPairs = 32;
constexpr int64_t kPanelRows = 4 * kMaxRows;

// out[m, 0..63] for MR rows of x (row stride ldx) and one block's K2 pairs, in float32;
// with Resume, added to what out holds. With Prefetch, each pair prefetches `lines` cache
// lines of `fetch` onward, in order.
template <int64_t MR, bool Prefetch, bool Resume>
inline void dot_block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* block, int64_t K2,
                      float* out, const char* fetch, int64_t lines) {
  __m512 acc[MR][4];
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t j = 0; j < 4; ++j) {
      acc[m][j] = Resume ? _mm512_loadu_ps(out + m * kBlock + 16 * j) : _mm512_setzero_ps();
    }
  }
  const char* pairs = reinterpret_cast<const char*>(block);
  for (int64_t i = 0; i < K2; ++i) {
    const char* pair = pairs + i * kPairBytes;
    if constexpr (Prefetch) {
      for (int64_t line = 0; line < lines; ++line) {
        _mm_prefetch(fetch + (i * lines + line) * kLineBytes, _MM_HINT_T1);
      }
    }
    __m512bh w[4];
    for (int64_t j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(pair + 64 * j);
    for (int64_t m = 0; m < MR; ++m) {
      const __m512bh xv = broadcast_pair(x + m * ldx + 2 * i);
      for (int64_t j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], w[j], xv);
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t j = 0; j < 4; ++j) _mm512_storeu_ps(out + m * kBlock + 16 * j, acc[m][j]);
  }
}

inline void dot_rows(int64_t rows, const at::BFloat16* x, int64_t ldx, const at::BFloat16* block,
                     int64_t K2, float* out, bool resume, const char* fetch, int64_t lines) {
  with_row_count(rows, [&](auto mr) {
    if (fetch != nullptr) {
      if (resume) return dot_block<mr(), true, true>(x, ldx, block, K2, out, fetch, lines);
      return dot_block<mr(), true, false>(x, ldx, block, K2, out, fetch, lines);
    }
    if (resume) return dot_block<mr(), false, true>(x, ldx, block, K2, out, fetch, lines);
    return dot_block<mr(), false, false>(x, ldx, block, K2, out, fetch, lines);
  });
}

// The first `channels` of each of `rows` float32 rows (stride kBlock) into out (stride ldo),
// rounded to nearest even sixteen at a time.
inline void store_rows(const float* products, int64_t rows, int64_t channels, at::BFloat16* out,
                       int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < channels; c += 16) {
      const __mmask16 keep = first_lanes(channels - c);
      const __m512 values = _mm512_loadu_ps(products + r * kBlock + c);
      const __m256bh half = _mm512_cvtneps_pbh(values);
      _mm256_mask_storeu_epi16(out + r * ldo + c, keep, (__m256i)half);
    }
  }
}

// All M rows of x (row stride K) times one block of K / 2 pairs, into the block's
// `channels` columns of out (row stride ldo), rounded as store_rows does: kPanelRows rows at
// a time, kMaxRows of them in registers at once. With `stream`, the first panel reads the
// block from memory, prefetching ahead, chunk by chunk when it has more than one row group;
// later panels find the block in cache.
inline void rows_times_block(const at::BFloat16* x, int64_t M, int64_t K,
                             const at::BFloat16* block, int64_t channels, at::BFloat16* out,
                             int64_t ldo, bool stream) {
  float products[kPanelRows * kBlock];
  const int64_t K2 = K / 2;
  const char* bytes = reinterpret_cast<const char*>(block);
  for (int64_t first = 0; first < M; first += kPanelRows) {
    const int64_t panel = std::min(kPanelRows, M - first);
    const int64_t groups = (panel + kMaxRows - 1) / kMaxRows;
    const bool streaming = stream && first == 0;
    const bool chunked = streaming && groups > 1 && K2 > kChunkPairs;
    const int64_t chunk = chunked ? kChunkPairs : K2;
    // Chunked, each group prefetches its share of the next chunk, `lines` a pair, so the
    // requests spread over all of a chunk's dot products; else the first group alone.
    const int64_t lines = chunked ? (kPairLines + groups - 1) / groups : kPairLines;
    for (int64_t k0 = 0; k0 < K2; k0 += chunk) {
      const int64_t pairs = std::min(chunk, K2 - k0);
      const char* next = bytes + (k0 + (chunked ? chunk : kPrefetchPairs)) * kPairBytes;
      for (int64_t group = 0; group < groups; ++group) {
        const char* fetch = nullptr;
        if (streaming && (chunked || group == 0)) fetch = next + group * pairs * lines * kLineBytes;
        const int64_t row = first + group * kMaxRows;
        dot_rows(std::min(kMaxRows, M - row), x + row * K + 2 * k0, K, block + k0 * kBlock * 2,
                 pairs, products + group * kMaxRows * kBlock, /*resume=*/k0 > 0, fetch, lines);
      }
    }
    store_rows(products, panel, channels, out + first * ldo, ldo);
  }
}

}  // namespace tokenline
#endif
