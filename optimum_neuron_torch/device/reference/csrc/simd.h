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

#else

inline bool has_avx2_fma() {
  return false;
}

#endif

} // namespace neuron::simd
