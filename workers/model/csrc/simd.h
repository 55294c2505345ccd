// AVX-512 helpers shared by the CPU kernels (small_gemm.cpp, attention.cpp): masked loads and
// stores of 16 float32 lanes from float32 or bf16 memory, bf16 rounding, and a vector e^x.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace specgate_simd {

inline __mmask16 tail_mask(int cols) {       // the first `cols` of 16 lanes (0 <= cols <= 16)
  return cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols < 0 ? 0 : cols)) - 1u);
}

// 16 lanes (the first m) of float32 or bf16 memory as float32, and back, bf16 rounded to nearest even
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));      // bf16 -> float32, exact
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));   // round to nearest even
}

// float32 lanes rounded as a tensor of T would store them: unchanged for float32, to the nearest
// bf16 for bf16 (what torch does after each op on a bf16 tensor).
inline __m512 round_as(__m512 v, const float*) { return v; }
inline __m512 round_as(__m512 v, const uint16_t*) {
  const __m512i wide = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// e^x for float32 lanes: 2^n * e^r with r = x - n ln2 in [-ln2/2, ln2/2], e^r by a degree-6
// polynomial (relative error ~2e-7, within a few ulp of expf); inputs clamped to [-88, 88].
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);       // ln2, split in two
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);       // for exactness
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace specgate_simd
