// --quantization w8a8 on CPU: out[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * q[n, k], where q
// is a weight's int8 [N, K] (one float32 scale sw per output channel, as int8_weight.py
// quantizes it) and xq the rows of x quantised here, per row: sx[m] = max |x[m, :]| / 127,
// xq = round(x / sx). Used by model_executor/models/int8/w8a8_weight.py. With parts = 2 each
// row goes in as two int8 rows, itself and its residual, which keep ~15 bits of it: that is
// --quantization int8 (weight-only) on this kernel, where no AMX runs.
//
// Why: a prompt chunk or a large batch is bound by multiplies, not by the weight's bytes,
// and AVX512-VNNI's vpdpbusd does 64 int8 multiply-adds an instruction against vdpbf16ps's
// 32 bf16 ones, at the same rate on the Zen 4 EPYC (a register-only loop: 0.90 against 0.47
// TOPS on its two cores). Every CPU with AVX512-BF16 has AVX512-VNNI.
//
// vpdpbusd multiplies unsigned bytes by signed ones. The weight is the unsigned side,
// packed once at load (w8a8_pack) into blocks of 64 output channels, [K / 4][64][4] bytes
// (four K values of a channel per 32-bit lane: a 16 x 16 transpose of 32-bit lanes), with
// 128 added (q + 128, in 1..255), so a call streams each block once, contiguously. The
// signed rows are broadcast four bytes at a time; the sum then carries 128 * sum_k xq[m, k],
// which each row's own sum takes back out. int32 sums are exact (255 * 127 * K stays below
// 2^31 up to K = 66,000), so a row's result depends on that row alone: not on its batch,
// not on the thread split.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "bf16_pairs.h"
#include "float_vec.h"
#include "row_count.h"
#include "transpose16.h"

// The avx512_bf16 kernel level, which has VNNI too: its mask helpers are bf16_pairs.h's.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TOKENLINE_W8A8 1
#endif

namespace {

#if defined(TOKENLINE_W8A8)
constexpr int64_t kBlock = 64;       // output channels a block holds: four vectors of 16
constexpr int64_t kMaxRows = 6;      // rows kept in registers together: 24 accumulators
constexpr int64_t kQuadBytes = 256;  // one K quad of a block: 64 channels x 4 bytes
constexpr float kInt8Max = 127.0f;
constexpr float kResidualSteps = 254.0f;  // a residual's steps per step of its row's scale
// Prefetch the packed block this many quads (8 KiB) ahead of the first row group's loads,
// into L2, as the bf16 decode copy's loop does; later row groups find it in cache.
constexpr int64_t kPrefetchQuads = 32;

// Row m of x quantised: xq[m, :] int8 and sx[m], with rowsum[m] = sum_k xq[m, k]. Sixteen
// values at a time, a scalar loop for the tail; cvtps rounds to nearest even, as
// std::nearbyint does in the default rounding mode.
//
// Parts == 2 (int8 weight-only: rows keep ~15 bits) writes each row as two int8 rows,
// 2m and 2m + 1: the first as above, the second its rounding residual x - sx * xq
// (|residual| <= sx / 2) quantised with the scale sx / 254, so it fits -127..127. Their sums
// add back to x within max |x| / 64,516 per value, 250x finer than bf16's own rounding of
// that largest value; the matmul then costs twice the multiplies but streams the weight once.
template <int Parts>
void quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int8_t* xq, float* sx,
                   int32_t* rowsum) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const at::BFloat16* row = x + m * K;
      __m512 amax = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) amax = _mm512_max_ps(amax, _mm512_and_ps(__m512(tokenline::load_floats(row + k)), sign));
      float largest = _mm512_reduce_max_ps(amax);
      for (; k < K; ++k) largest = std::max(largest, std::fabs(static_cast<float>(row[k])));
      const float scale = largest > 0.0f ? largest / kInt8Max : 1.0f;
      const float fine = scale / kResidualSteps;  // Parts == 2: the residual's scale
      int8_t* high_row = xq + m * Parts * K;
      int8_t* low_row = high_row + K;  // Parts == 2 only
      const __m512 inverse = _mm512_set1_ps(1.0f / scale), fine_inverse = _mm512_set1_ps(1.0f / fine);
      const __m512 step = _mm512_set1_ps(scale);
      const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
      __m512i sum = _mm512_setzero_si512(), residual_sum = _mm512_setzero_si512();
      for (k = 0; k + 16 <= K; k += 16) {
        const __m512 v = __m512(tokenline::load_floats(row + k));
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));
        q = _mm512_min_epi32(_mm512_max_epi32(q, low), high);
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(high_row + k), _mm512_cvtepi32_epi8(q));
        if constexpr (Parts == 2) {
          const __m512 residual = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), step, v);
          __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(residual, fine_inverse));
          r = _mm512_min_epi32(_mm512_max_epi32(r, low), high);
          residual_sum = _mm512_add_epi32(residual_sum, r);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(low_row + k), _mm512_cvtepi32_epi8(r));
        }
      }
      int32_t total = _mm512_reduce_add_epi32(sum), residual_total = _mm512_reduce_add_epi32(residual_sum);
      for (; k < K; ++k) {
        const float value = static_cast<float>(row[k]);
        const float v = std::nearbyint(value * (1.0f / scale));
        const int8_t q = static_cast<int8_t>(std::clamp(v, -kInt8Max, kInt8Max));
        high_row[k] = q;
        total += q;
        if constexpr (Parts == 2) {
          const float r = std::nearbyint((value - static_cast<float>(q) * scale) * (1.0f / fine));
          const int8_t qr = static_cast<int8_t>(std::clamp(r, -kInt8Max, kInt8Max));
          low_row[k] = qr;
          residual_total += qr;
        }
      }
      sx[m * Parts] = scale;
      rowsum[m * Parts] = total;
      if constexpr (Parts == 2) {
        sx[m * Parts + 1] = fine;
        rowsum[m * Parts + 1] = residual_total;
      }
    }
  });
}

// Channels [0, channels) of q (row stride K, K a multiple of 4) as one packed block,
// block[i][c][j] = q[c][4i + j] + 128 (as unsigned bytes); channels past them are 128, i.e.
// zero weights, whose products the row sums take back out like any other.
void relayout_block(const int8_t* q, int64_t K, int64_t channels, uint8_t* block) {
  const int64_t quads = K / 4, chunked = quads - quads % 16;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int32_t* lanes = reinterpret_cast<int32_t*>(block);  // [quads][kBlock] lanes
  for (int64_t group = 0; group < kBlock; group += 16) {
    for (int64_t i = 0; i < chunked; i += 16) {  // 64 bytes of each of the group's 16 rows
      __m512i v[16];
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t channel = group + c;
        v[c] = channel < channels ? _mm512_loadu_si512(q + channel * K + 4 * i) : _mm512_setzero_si512();
        v[c] = _mm512_xor_si512(v[c], flip);
      }
      tokenline::transpose_16x16(v);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(lanes + (i + p) * kBlock + group, v[p]);
    }
  }
  for (int64_t i = chunked; i < quads; ++i) {  // the quads past the last whole chunk
    for (int64_t c = 0; c < kBlock; ++c) {
      for (int64_t j = 0; j < 4; ++j) {
        const int8_t value = c < channels ? q[c * K + 4 * i + j] : 0;
        block[(i * kBlock + c) * 4 + j] = static_cast<uint8_t>(value) ^ 0x80u;
      }
    }
  }
}

// The int32 sums of MR rows of xq (row stride K) against one block of `quads` quads.
template <int64_t MR, bool Prefetch>
inline void dot_block(const int8_t* xq, int64_t K, const uint8_t* block, int64_t quads,
                      int32_t* out) {
  __m512i acc[MR][4];
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_si512();
  }
  for (int64_t i = 0; i < quads; ++i) {
    const uint8_t* quad = block + i * kQuadBytes;
    if constexpr (Prefetch) {
      for (int64_t line = 0; line < kQuadBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(quad + kPrefetchQuads * kQuadBytes + line), _MM_HINT_T1);
      }
    }
    __m512i w[4];
    for (int64_t j = 0; j < 4; ++j) w[j] = _mm512_loadu_si512(quad + 64 * j);
    for (int64_t m = 0; m < MR; ++m) {
      int32_t bytes;
      std::memcpy(&bytes, xq + m * K + 4 * i, sizeof(bytes));
      const __m512i xv = _mm512_set1_epi32(bytes);
      for (int64_t j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], w[j], xv);
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t j = 0; j < 4; ++j) _mm512_storeu_si512(out + m * kBlock + 16 * j, acc[m][j]);
  }
}

template <bool Prefetch>
inline void dot_rows(int64_t rows, const int8_t* xq, int64_t K, const uint8_t* block,
                     int64_t quads, int32_t* out) {
  tokenline::with_row_count(
      rows, [&](auto mr) { dot_block<mr(), Prefetch>(xq, K, block, quads, out); });
}

// Sixteen channels of quantised row r's product: (sums[r, c] - 128 * rowsum[r]) * sx[r].
inline __m512 row_part(const int32_t* sums, int64_t r, int64_t c, const int32_t* rowsum,
                       const float* sx) {
  const __m512i offset = _mm512_set1_epi32(128 * rowsum[r]);
  const __m512i exact = _mm512_sub_epi32(_mm512_loadu_si512(sums + r * kBlock + c), offset);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(sx[r]));
}

// out[r / Parts, c] = the sum of its Parts quantised rows' products times sw[c], for the
// block's first `channels` channels, rounded to bf16 sixteen at a time.
template <int Parts>
inline void store_rows(const int32_t* sums, int64_t rows, int64_t channels, const int32_t* rowsum,
                       const float* sx, const float* sw, at::BFloat16* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; r += Parts) {
    for (int64_t c = 0; c < channels; c += 16) {
      const __mmask16 keep = tokenline::first_lanes(channels - c);
      __m512 values = row_part(sums, r, c, rowsum, sx);
      if constexpr (Parts == 2) values = _mm512_add_ps(values, row_part(sums, r + 1, c, rowsum, sx));
      values = _mm512_mul_ps(values, _mm512_maskz_loadu_ps(keep, sw + c));
      const __m256i half = (__m256i)_mm512_cvtneps_pbh(values);
      _mm256_mask_storeu_epi16(out + r / Parts * ldo + c, keep, half);
    }
  }
}

at::Tensor pack(const at::Tensor& qweight) {
  const int64_t K = qweight.size(-1), N = qweight.size(-2);
  const int64_t stacks = qweight.numel() / (N * K), num_blocks = (N + kBlock - 1) / kBlock;
  std::vector<int64_t> shape(qweight.sizes().begin(), qweight.sizes().end() - 2);
  for (const int64_t d : {num_blocks, K / 4, kBlock, int64_t{4}}) shape.push_back(d);
  at::Tensor out = at::empty(shape, qweight.options().dtype(at::kByte));
  const int8_t* qp = qweight.data_ptr<int8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, stacks * num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t stack = i / num_blocks, n = i % num_blocks * kBlock;
      relayout_block(qp + (stack * N + n) * K, K, std::min(kBlock, N - n), op + i * kBlock * K);
    }
  });
  return out;
}

// x's rows quantised as Parts int8 rows each (quantize_rows), times the packed weight. The
// row groups hold kMaxRows quantised rows, an even count, so a row's parts share a group.
template <int Parts>
at::Tensor packed_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  static_assert(kMaxRows % Parts == 0, "a row's parts must share a row group");
  const int64_t rows_in = x.size(0), K = x.size(1), N = scales.numel(), M = rows_in * Parts;
  const at::Tensor rows = x.contiguous();
  const at::Tensor channel_scales = scales.contiguous();
  const std::unique_ptr<int8_t[]> xq(new int8_t[M * K]);
  const std::unique_ptr<float[]> sx(new float[M]);
  const std::unique_ptr<int32_t[]> rowsum(new int32_t[M]);
  quantize_rows<Parts>(rows.data_ptr<at::BFloat16>(), rows_in, K, xq.get(), sx.get(), rowsum.get());
  at::Tensor out = at::empty({rows_in, N}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const uint8_t* blocks = packed.data_ptr<uint8_t>();
  const float* sw = channel_scales.data_ptr<float>();
  const int64_t num_blocks = (N + kBlock - 1) / kBlock, quads = K / 4;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    int32_t sums[kMaxRows * kBlock];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kBlock, channels = std::min(kBlock, N - n);
      const uint8_t* block = blocks + b * kBlock * K;
      for (int64_t first = 0; first < M; first += kMaxRows) {
        const int64_t count = std::min(kMaxRows, M - first);
        // Called directly, not through a pointer to either instance: through one, the
        // accumulators left registers and 64-row calls took 1.9x the time (Zen 4 EPYC).
        if (first == 0) {
          dot_rows<true>(count, xq.get(), K, block, quads, sums);
        } else {
          dot_rows<false>(count, xq.get() + first * K, K, block, quads, sums);
        }
        store_rows<Parts>(sums, count, channels, rowsum.get() + first, sx.get() + first, sw + n,
                          op + first / Parts * N + n, N);
      }
    }
  });
  return out;
}
#endif

// Whether the w8a8 kernels run here: built with AVX512-VNNI (the avx512_bf16 level).
bool w8a8_built() {
#if defined(TOKENLINE_W8A8)
  return true;
#else
  return false;
#endif
}

at::Tensor w8a8_pack(const at::Tensor& qweight) {
  TORCH_CHECK(w8a8_built(), "w8a8_pack: this build has no AVX512-VNNI");
  TORCH_CHECK(qweight.dim() >= 2 && qweight.scalar_type() == at::kChar,
              "w8a8_pack: qweight must be int8 [..., N, K]");
  TORCH_CHECK(qweight.size(-1) % 4 == 0, "w8a8_pack: K must be a multiple of 4");
#if defined(TOKENLINE_W8A8)
  return pack(qweight.contiguous());
#else
  return at::Tensor();
#endif
}

// `parts` 1: each row of x quantised to int8 (--quantization w8a8); 2: as two int8 rows,
// ~15 bits (int8 weight-only on this kernel).
at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   int64_t parts) {
  TORCH_CHECK(w8a8_built(), "w8a8_mm: this build has no AVX512-VNNI");
  TORCH_CHECK(parts == 1 || parts == 2, "w8a8_mm: parts must be 1 or 2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "w8a8_mm: x must be bf16 [M, K]");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat,
              "w8a8_mm: scales must be float32 [N]");
  const int64_t K = x.size(1), num_blocks = (scales.numel() + 63) / 64;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == num_blocks && packed.size(1) * 4 == K &&
                  packed.size(2) == 64 && packed.size(3) == 4,
              "w8a8_mm: packed must be w8a8_pack's [ceil(N / 64), K / 4, 64, 4] for x's K");
#if defined(TOKENLINE_W8A8)
  return parts == 1 ? packed_mm<1>(x, packed, scales) : packed_mm<2>(x, packed, scales);
#else
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("w8a8_pack(Tensor qweight) -> Tensor");
  m.def("w8a8_mm(Tensor x, Tensor packed, Tensor scales, int parts=1) -> Tensor");
  m.def("w8a8_built() -> bool", &w8a8_built);
}

TORCH_LIBRARY_IMPL(tokenline, CPU, m) {
  m.impl("w8a8_pack", &w8a8_pack);
  m.impl("w8a8_mm", &w8a8_mm);
}
