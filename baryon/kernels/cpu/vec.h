// Small helpers shared by baryon's C++ CPU kernels (GCC vector extensions): vectors of the
// machine's own width and 16-lane float vectors, dot products and a vector exp.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cmath>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace baryon_cpu {

typedef float f32x16 __attribute__((vector_size(64)));

// Vectors of the machine's own width (a 16-lane vector on a CPU without AVX-512 is split by the
// compiler, often through the stack): what dot and the attention use.
#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#elif defined(__AVX__)
constexpr int kNativeLanes = 8;
#else
constexpr int kNativeLanes = 4;
#endif
typedef float f32xn __attribute__((vector_size(kNativeLanes * sizeof(float))));

inline f32xn loadn(const float* p) {
  f32xn v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storen(float* p, f32xn v) { std::memcpy(p, &v, sizeof(v)); }

inline float sumn(f32xn v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  const __m256 eight = reinterpret_cast<__m256>(v);
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
#else
  float s = 0.f;
  for (int i = 0; i < kNativeLanes; ++i) s += v[i];
  return s;
#endif
}

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// v in all 16 lanes, built from native broadcasts (GCC otherwise widens a scalar operand of a
// 16-lane vector through 16 stack stores where the native vector is narrower than 16 lanes).
inline f32x16 broadcast16(float v) {
  f32xn parts[16 / kNativeLanes];
  for (int i = 0; i < 16 / kNativeLanes; ++i) parts[i] = f32xn{} + v;
  f32x16 out;
  std::memcpy(&out, parts, sizeof(out));
  return out;
}

inline float sum16(f32x16 v) {
  f32xn parts[16 / kNativeLanes];  // one (AVX-512), two (AVX) or four native vectors
  std::memcpy(parts, &v, sizeof(v));
  for (int i = 1; i < 16 / kNativeLanes; ++i) parts[0] += parts[i];
  return sumn(parts[0]);
}

// A native vector of floats from float32 values, or from float16 ones converted (F16C).
inline f32xn load_row(const float* p) { return loadn(p); }

inline f32xn load_row(const c10::Half* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<f32xn>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__AVX__) && defined(__F16C__)
  return reinterpret_cast<f32xn>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  f32xn v;
  for (int i = 0; i < kNativeLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// sum(a[i] * b[i]) for i < n (two accumulators, so consecutive multiply-adds do not wait on each
// other); b float32 or float16.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  f32xn acc0 = f32xn{}, acc1 = f32xn{};
  int64_t i = 0;
  for (; i + 2 * kNativeLanes <= n; i += 2 * kNativeLanes) {
    acc0 += loadn(a + i) * load_row(b + i);
    acc1 += loadn(a + i + kNativeLanes) * load_row(b + i + kNativeLanes);
  }
  for (; i + kNativeLanes <= n; i += kNativeLanes) acc0 += loadn(a + i) * load_row(b + i);
  float s = sumn(acc0 + acc1);
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

// e^x lane by lane: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r (Cephes'
// expf coefficients), times 2^n built in the exponent bits. Relative error ~2e-7; x is clamped to
// [-87.3, 88.3] (below: a tiny positive number instead of 0, which a softmax sum cannot tell apart).
inline f32xn expn(f32xn x) {
  typedef int32_t i32xn __attribute__((vector_size(kNativeLanes * sizeof(int32_t))));
  const f32xn lo = f32xn{} - 87.3f, hi = f32xn{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f32xn round_magic = f32xn{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const f32xn n = (x * 1.44269504088896341f + round_magic) - round_magic;
  const f32xn r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts
  f32xn p = f32xn{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i32xn bits = (__builtin_convertvector(n, i32xn) + 127) << 23;
  f32xn scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// p[i] = e^(p[i] - shift) for i < n; returns their sum.
inline float exp_shifted(float* p, int64_t n, float shift) {
  f32xn total = f32xn{};
  int64_t i = 0;
  for (; i + kNativeLanes <= n; i += kNativeLanes) {
    const f32xn e = expn(loadn(p + i) - shift);
    storen(p + i, e);
    total += e;
  }
  float sum = sumn(total);
  for (; i < n; ++i) sum += (p[i] = std::exp(p[i] - shift));
  return sum;
}

}  // namespace baryon_cpu
