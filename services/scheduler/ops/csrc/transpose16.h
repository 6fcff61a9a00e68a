// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers: what the kernels that lay an
// int8 weight out per call share (int8_rows.cpp into bf16 pairs per call, w8a8.cpp into byte
// quads). Only where the build has AVX-512.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tokenline {

// Transpose 16 x 16 32-bit lanes in place: afterwards v[p] lane c is what v[c] lane p was.
inline void transpose_16x16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows, interleaved by lane
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // v[i + j]: rows i..i+3 of column 4L + j in 128-bit lane L
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // gather lane L of the four row groups: column 4L + j
    const __m512i a = _mm512_shuffle_i32x4(v[j], v[4 + j], 0x44);
    const __m512i b = _mm512_shuffle_i32x4(v[j], v[4 + j], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], 0x44);
    const __m512i d = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

}  // namespace tokenline
#endif
