// What the kernels that multiply bf16 pairs (vdpbf16ps) share: a pair of bf16 broadcast to
// every lane, and the mask of a vector's first lanes. Only where the build has AVX512-BF16.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

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

}  // namespace tokenline
#endif
