// AVX2 helpers of the reference device's decode kernels (matmul.cpp, decode_attention.cpp).
// They are compiled for AVX2 + FMA whatever the build flags; callers check `has_avx2_fma()` at
// run time and keep the CPU kernels' path on other CPUs.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace neuron::simd {

#if defined(__x86_64__)

inline bool has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// 8 consecutive values as floats: float32 as they are, bfloat16 widened (its bits are a float's top half).
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

__attribute__((target("avx2,fma"))) inline float lane_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// exp of 8 floats, as Cephes' expf: exp(x) = 2^n exp(r) with r = x - n ln(2) in [-ln(2)/2, ln(2)/2] and a
// degree-6 polynomial for exp(r), within about 2 ulp of std::exp above -87.3 (below, where std::exp's
// results are denormal, and at -inf, it is 0: softmax weights that small change nothing). NaN stays NaN
// (min/max return their second operand when either is NaN). The callers' inputs are at most 0.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-88.3762626647949f);
  const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(low, _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  // r = x - n ln(2), with ln(2) in two parts so that n * the first is exact.
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
  return _mm256_blendv_ps(y, _mm256_setzero_ps(), underflow);
}

#else

inline bool has_avx2_fma() {
  return false;
}

#endif

} // namespace neuron::simd
