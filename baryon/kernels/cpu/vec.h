// Small helpers shared by baryon's C++ CPU kernels: 16-lane float vectors (GCC vector
// extensions: AVX-512 where the CPU has it, narrower SIMD elsewhere) and dot products.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace baryon_cpu {

typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

inline float sum16(f32x16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

// sum(a[i] * b[i]) for i < n, 16 lanes at a time.
inline float dot(const float* a, const float* b, int64_t n) {
  f32x16 acc = f32x16{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load16(a + i) * load16(b + i);
  float s = sum16(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[i] += a * x[i] for i < n.
inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(y + i, load16(y + i) + load16(x + i) * a);
  for (; i < n; ++i) y[i] += a * x[i];
}

}  // namespace baryon_cpu
