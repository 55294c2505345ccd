// The vector layer the CPU kernels (small_gemm.cpp, attention.cpp, decoder.cpp) are written
// against: a 16-lane float32 vector `vf`, masks of its first lanes, loads and stores from float32
// or bf16 memory (masked tails), bf16 rounding, multiply-adds, e^x and reductions.
//
// Why one source compiled per width (workers/model/small_gemm.py builds it once per path): the
// kernels' arithmetic, blocking and summation order are the same on every x86 server class, so
// one copy of them keeps every path's results in step (and a fix reaches all of them); only this
// layer differs. Under AVX-512 `vf` is one __m512 and a mask an __mmask16; under AVX2 + FMA it is
// a pair of __m256 and a mask the count of leading lanes (every mask the kernels use is a
// prefix of the 16 lanes), loaded and stored with AVX2's masked moves. AVX-512 BF16's
// conversions and dot products and AMX stay in the sources that use them, behind
// __AVX512BF16__ / __AMX_BF16__, with the integer rounding and plain multiply-adds below as the
// fallback: the avx512f path (AVX-512F/BW/VL without BF16, e.g. Skylake / Cascade Lake) takes
// the AVX-512 layer with that fallback, the AVX2 path's arithmetic 16 lanes at a time.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>

#if !defined(__FMA__) || !(defined(__AVX512F__) || defined(__AVX2__))
#error "the CPU kernels need AVX2 + FMA or AVX-512F"
#endif
// The AVX-512 layer's bf16 loads and stores are 16-bit masked moves of 256-bit vectors (BW + VL):
// every AVX-512 server CPU has them (Skylake-SP on), and a build without them would otherwise
// fail on intrinsics far from the cause.
#if defined(__AVX512F__) && !(defined(__AVX512BW__) && defined(__AVX512VL__))
#error "the AVX-512 kernel paths need AVX-512BW and AVX-512VL beside AVX-512F"
#endif

namespace specgate_simd {

#if defined(__AVX512F__)
// ----------------------------------------------------------------------------- AVX-512
constexpr bool kWide = true;   // 32 vector registers: a 6 x 64 block of accumulators fits
using vf = __m512;
using vi = __m512i;
using vmask = __mmask16;

inline vmask tail_mask(int cols) {       // the first `cols` of 16 lanes (0 <= cols <= 16)
  return cols >= 16 ? (vmask)0xFFFF : (vmask)((1u << (cols < 0 ? 0 : cols)) - 1u);
}
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoreu(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c, one rounding
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }

// 16 lanes (the first m) of float32 or bf16 memory as float32 (absent lanes 0, or `fill`)
inline vf load16(const float* p, vmask m) { return _mm512_maskz_loadu_ps(m, p); }
inline vf load16_or(const float* p, vmask m, float fill) { return _mm512_mask_loadu_ps(vset1(fill), m, p); }
inline vf load16(const uint16_t* p, vmask m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));      // bf16 -> float32, exact
}
inline void store16(float* p, vf v, vmask m) { _mm512_mask_storeu_ps(p, m, v); }

// float32 -> bf16 bits (in each 32-bit lane's low half), rounded to nearest even
inline __m512i bf16_bits(vf v) {
#if defined(__AVX512BF16__)
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);   // NaN stays NaN, made quiet
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
#endif
}
inline void store16(uint16_t* p, vf v, vmask m) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
#else
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
#endif
}
inline vf bf16_round(vf v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }

// 2^n * p for integral n in [-127, 127]
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
inline vf round_nearest(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vclamp(vf x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset1(lo)), vset1(hi)); }

// e where x is not -inf, else 0
inline vf zero_where_neg_inf(vf x, vf e) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ), e);
}

// the 32 bf16 of 16 k-pairs [o][2] (o = 16 outputs) as float32: even[o] = k0's, odd[o] = k1's
inline void bf16_pairs(const uint16_t* p, vf& even, vf& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
}

// The 16 keys' dot products from their partial-sum vectors: lane m of the result = sum of v[m].
inline vf reduce16(const vf* v) {
  __m512 t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)    // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)    // per 128-bit lane: one partial sum of each of 4 keys
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0x44), _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0xEE));
  for (int j = 0; j < 2; ++j)    // then across the 128-bit lanes
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88), _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// argmax lanes: the lane indices 0..15, +16 a step, and keeping per lane the first greatest value
inline vi vi_zero() { return _mm512_setzero_si512(); }
inline vi vi_iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline vi vi_add16(vi a) { return _mm512_add_epi32(a, _mm512_set1_epi32(16)); }
inline void vi_storeu(int32_t* p, vi a) { _mm512_storeu_si512(p, a); }
inline void keep_greater(vf& best, vi& at, vf v, vi idx, vmask m) {
  const __mmask16 more = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);   // strictly: first wins
  best = _mm512_mask_mov_ps(best, more, v);
  at = _mm512_mask_mov_epi32(at, more, idx);
}

#else
// ----------------------------------------------------------------------------- AVX2 + FMA
constexpr bool kWide = false;  // 16 vector registers: blocks of accumulators a quarter the size
struct vf { __m256 lo, hi; };
struct vi { __m256i lo, hi; };
using vmask = int;             // the count of leading lanes, 0..16

inline vmask tail_mask(int cols) { return cols >= 16 ? 16 : (cols < 0 ? 0 : cols); }
// the first n of 8 lanes set, for AVX2's masked moves
inline __m256i prefix8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline vf vloadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstoreu(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vfmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
// the lanes summed in AVX-512's pairing (i + 8, + 4, + 2, + 1): the same sums on both paths
inline float reduce_add(vf v) {
  const __m256 s8 = _mm256_add_ps(v.hi, v.lo);
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}
inline float reduce_max(vf v) {
  const __m256 s8 = _mm256_max_ps(v.hi, v.lo);
  const __m128 s4 = _mm_max_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_max_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(s2), _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1)));
}

inline vf load16(const float* p, vmask m) {
  if (m == 16) return vloadu(p);
  return {_mm256_maskload_ps(p, prefix8(m)), _mm256_maskload_ps(p + 8, prefix8(m - 8))};
}
inline vf load16_or(const float* p, vmask m, float fill) {
  if (m == 16) return vloadu(p);
  const __m256 f = _mm256_set1_ps(fill);
  const __m256i ml = prefix8(m), mh = prefix8(m - 8);
  return {_mm256_blendv_ps(f, _mm256_maskload_ps(p, ml), _mm256_castsi256_ps(ml)),
          _mm256_blendv_ps(f, _mm256_maskload_ps(p + 8, mh), _mm256_castsi256_ps(mh))};
}
inline vf load16(const uint16_t* p, vmask m) {   // bf16 -> float32, exact: zero-extend, shift
  alignas(32) uint16_t tail[16];
  if (m < 16) {                                  // AVX2 has no 16-bit masked load: a copy
    std::memset(tail, 0, sizeof(tail));
    std::memcpy(tail, p, sizeof(uint16_t) * (m < 0 ? 0 : m));
    p = tail;
  }
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16))};
}
inline void store16(float* p, vf v, vmask m) {
  if (m == 16) return vstoreu(p, v);
  _mm256_maskstore_ps(p, prefix8(m), v.lo);
  _mm256_maskstore_ps(p + 8, prefix8(m - 8), v.hi);
}

// float32 -> bf16 bits (each 32-bit lane's low half), rounded to nearest even by integer
// arithmetic (add 0x7FFF + the kept lsb, drop 16 bits), as AVX-512 BF16's vcvtneps2bf16 does; NaN
// stays NaN, made quiet.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40)), nan);
}
inline void store16(uint16_t* p, vf v, vmask m) {
  // packus interleaves the 128-bit halves; the permute puts the 16 values back in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits8(v.lo), bf16_bits8(v.hi)), 0xD8);
  if (m == 16) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  alignas(32) uint16_t tail[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tail), packed);
  std::memcpy(p, tail, sizeof(uint16_t) * (m < 0 ? 0 : m));
}
inline vf bf16_round(vf v) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v.hi), 16))};
}

// 2^n * p for integral n in [-127, 127] (AVX-512's scalef): two exact powers of two, n/2 and the
// rest, so that neither leaves the normal range; one rounding, only where the result is subnormal.
inline __m256 pow2_8(__m256i n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }
inline __m256 scale_pow2_8(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n), a = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(a)), pow2_8(_mm256_sub_epi32(ni, a)));
}
inline vf scale_pow2(vf p, vf n) { return {scale_pow2_8(p.lo, n.lo), scale_pow2_8(p.hi, n.hi)}; }
inline vf round_nearest(vf x) {
  return {_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline vf vclamp(vf x, float lo, float hi) {
  const __m256 l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
  return {_mm256_min_ps(_mm256_max_ps(x.lo, l), h), _mm256_min_ps(_mm256_max_ps(x.hi, l), h)};
}

inline vf zero_where_neg_inf(vf x, vf e) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  return {_mm256_and_ps(_mm256_cmp_ps(x.lo, ninf, _CMP_NEQ_OQ), e.lo),
          _mm256_and_ps(_mm256_cmp_ps(x.hi, ninf, _CMP_NEQ_OQ), e.hi)};
}

inline void bf16_pairs(const uint16_t* p, vf& even, vf& odd) {
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(w0, top)), _mm256_castsi256_ps(_mm256_and_si256(w1, top))};
}

// 8 vectors' sums: lane m = sum of s[m]'s 8 lanes
inline __m256 reduce8(const __m256* s) {
  const __m256 t0 = _mm256_hadd_ps(s[0], s[1]), t1 = _mm256_hadd_ps(s[2], s[3]);
  const __m256 t2 = _mm256_hadd_ps(s[4], s[5]), t3 = _mm256_hadd_ps(s[6], s[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);   // [0..3 | 0..3] halves
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline vf reduce16(const vf* v) {
  __m256 s[16];
  for (int m = 0; m < 16; ++m) s[m] = _mm256_add_ps(v[m].lo, v[m].hi);
  return {reduce8(s), reduce8(s + 8)};
}

inline vi vi_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi vi_iota() {
  return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
}
inline vi vi_add16(vi a) {
  const __m256i s = _mm256_set1_epi32(16);
  return {_mm256_add_epi32(a.lo, s), _mm256_add_epi32(a.hi, s)};
}
inline void vi_storeu(int32_t* p, vi a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), a.hi);
}
inline void keep_greater8(__m256& best, __m256i& at, __m256 v, __m256i idx, int m) {
  const __m256 more = _mm256_and_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ), _mm256_castsi256_ps(prefix8(m)));
  best = _mm256_blendv_ps(best, v, more);
  at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), more));
}
inline void keep_greater(vf& best, vi& at, vf v, vi idx, vmask m) {   // strictly: first wins
  keep_greater8(best.lo, at.lo, v.lo, idx.lo, m);
  keep_greater8(best.hi, at.hi, v.hi, idx.hi, m - 8);
}
#endif

// ----------------------------------------------------------------------------- both widths
constexpr vmask kAll = (vmask)(kWide ? 0xFFFF : 16);   // all 16 lanes

// float32 lanes rounded as a tensor of T would store them: unchanged for float32, to the nearest
// bf16 for bf16 (what torch does after each op on a bf16 tensor).
inline vf round_as(vf v, const float*) { return v; }
inline vf round_as(vf v, const uint16_t*) { return bf16_round(v); }

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// e^x for float32 lanes: 2^n * e^r with r = x - n ln2 in [-ln2/2, ln2/2], e^r by a degree-6
// polynomial (relative error ~2e-7, within a few ulp of expf); inputs clamped to [-88, 88].
inline vf exp16(vf x) {
  x = vclamp(x, -88.0f, 88.0f);
  const vf n = round_nearest(vmul(x, vset1(1.44269504088896341f)));
  const vf neg_n = vsub(vzero(), n);
  vf r = vfmadd(neg_n, vset1(0.693145751953125f), x);          // ln2, split in two
  r = vfmadd(neg_n, vset1(1.428606765330187045e-06f), r);      // for exactness
  vf p = vset1(1.0f / 720);
  p = vfmadd(p, r, vset1(1.0f / 120));
  p = vfmadd(p, r, vset1(1.0f / 24));
  p = vfmadd(p, r, vset1(1.0f / 6));
  p = vfmadd(p, r, vset1(0.5f));
  p = vfmadd(p, r, vset1(1.0f));
  p = vfmadd(p, r, vset1(1.0f));
  return scale_pow2(p, n);
}

}  // namespace specgate_simd
