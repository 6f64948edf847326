// The CPU paths around attention, float32, for a paged KV cache
// kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]:
//
// qkv_prologue: per-head RMSNorm of queries and keys (optional), NeoX rotary embedding of the
//   first rotary_dim features of each head, and the write of keys and values into the cache.
//   qkv [T, (H + 2 * Hkv) * D] (its query part rewritten in place), positions [T] int64,
//   cos_sin_cache [max_position, rotary_dim] (cos half | sin half), slot_mapping [T] int64
//   (-1: not stored). Matches baryon.kernels.qkv_prologue.TorchQKVPrologue.
//
// paged_attention: every query token (decodes and prefill chunks alike) attends causally over
//   its sequence's cached tokens up to its own position (the last `window` of them when
//   window > 0), GQA by head groups, the scaled scores soft-capped when softcap > 0 (softcap *
//   tanh(s / softcap), Gemma 2). query [T, H, D] (rows may be strided), block_tables
//   [S, max_blocks] int32, seq_lens [S] int32 (tokens after this step), query_start_loc [S + 1]
//   int32 (sequence s owns query rows starting at query_start_loc[s]) -> out [T, H, D].
//   Matches TorchPagedAttention.
//
// Both take a float32, float16 or float8_e4m3fn cache (float16: rounded to nearest-even when stored,
// converted in registers when read). An fp8 cache needs k_scale / v_scale (float32,
// one element each): the prologue stores clamp(x / scale, +-448) rounded to e4m3 (c10's
// conversion, the one torch's .to(float8_e4m3fn) uses); attention converts each key / value
// row it reads through a 256-entry table and folds the scales into the softmax scale (keys) and
// the probabilities (values).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace baryon_cpu;

using fp8 = c10::Float8_e4m3fn;
constexpr float kFp8Max = 448.f;
constexpr int64_t kRowsAhead = 16;  // how far ahead of the scores the key rows are prefetched

// Validates an fp8 cache's scale and returns its value (a host read: these are CPU tensors).
float scale_value(const std::optional<at::Tensor>& scale, const char* op, const char* name) {
  TORCH_CHECK(scale.has_value() && scale->defined() && scale->numel() == 1 && scale->scalar_type() == at::kFloat &&
                  scale->device().is_cpu(),
              op, ": an fp8 kv_cache needs ", name, " as a one-element float32 CPU tensor");
  return scale->data_ptr<float>()[0];
}

// e4m3fn bits -> float, for all 256 bit patterns.
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(fp8(static_cast<uint8_t>(b), fp8::from_bits()));
    return t;
  }();
  return table;
}

// out = e4m3(clamp(x / scale, +-448)); NaN passes through, as torch.clamp lets it.
void quantize_row(const float* x, float scale, uint8_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = x[i] / scale;
    out[i] = fp8(y > kFp8Max ? kFp8Max : (y < -kFp8Max ? -kFp8Max : y)).x;
  }
}

// e4m3fn bits -> float32. With AVX2, eight at a time by bit arithmetic: a normal value's
// magnitude bits shifted up by 20 and its exponent rebiased (+120 << 23) are its float32 bits, a
// subnormal's (exponent field 0) value is its 3-bit mantissa times 2^-9, the sign goes to bit 31,
// and 0x7F / 0xFF are NaN; the same values as the table (test_fp8_kv_cache reads every code).
void dequantize_row(const uint8_t* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256i magnitude_mask = _mm256_set1_epi32(0x7F), sign_mask = _mm256_set1_epi32(0x80);
  const __m256i rebias = _mm256_set1_epi32(120 << 23), smallest_normal = _mm256_set1_epi32(8);
  const __m256 subnormal_unit = _mm256_set1_ps(1.f / 512.f), nan = _mm256_set1_ps(NAN);
  for (; i + 8 <= n; i += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + i)));
    const __m256i magnitude = _mm256_and_si256(b, magnitude_mask);
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), rebias));
    const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), subnormal_unit);
    __m256 v = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(smallest_normal, magnitude)));
    v = _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, magnitude_mask)));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, sign_mask), 24);
    _mm256_storeu_ps(out + i, _mm256_or_ps(v, _mm256_castsi256_ps(sign)));
  }
#endif
  const std::array<float, 256>& table = fp8_table();
  for (; i < n; ++i) out[i] = table[x[i]];
}

// out = x rounded to float16 (to nearest, ties to even: torch's .to(torch.float16)).
void store_half_row(const float* x, c10::Half* out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) out[i] = c10::Half(x[i]);
}

void norm_head(float* head, const float* weight, int64_t D, float eps) {
  const float inv = 1.f / std::sqrt(dot(head, head, D) / D + eps);
  for (int64_t i = 0; i < D; ++i) head[i] = weight[i] * (head[i] * inv);
}

void rotate_head(float* head, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * cos[i] - x2 * sin[i];
    head[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

#if defined(__AVX__)
// The four sums of a key step at once, each in exactly sumn's order, so the result is bit-identical
// to four sumn calls: on AVX2 ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)); on AVX-512 the two 256-bit
// halves added first, then the same (GCC's _mm512_reduce_add_ps). 16-20 shuffles and adds instead
// of ~28 (decode attention spends a third of its time here at head_dim 64).
inline __m256 halves_added(f32xn v) {
#if defined(__AVX512F__)
  const __m512 wide = reinterpret_cast<__m512>(v);
  return _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide), 1)),
                       _mm512_castps512_ps256(wide));
#else
  return reinterpret_cast<__m256>(v);
#endif
}

inline __m128 sum4(const f32xn* acc) {
  const __m256 a0 = halves_added(acc[0]), a1 = halves_added(acc[1]);
  const __m256 a2 = halves_added(acc[2]), a3 = halves_added(acc[3]);
  // lane i + lane i+4 of each row: [row 0 | row 1] and [row 2 | row 3], four lanes each
  const __m256 f01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 f23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  // f0+f2 and f1+f3: [r0: g0 g1, r2: g0 g1 | r1: g0 g1, r3: g0 g1]
  const __m256 g = _mm256_add_ps(_mm256_shuffle_ps(f01, f23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(f01, f23, _MM_SHUFFLE(3, 2, 3, 2)));
  // g0+g1: [r0 r2 r0 r2 | r1 r3 r1 r3]
  const __m256 h = _mm256_add_ps(_mm256_shuffle_ps(g, g, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(g, g, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // r0 r1 r2 r3
}
#endif

// out[r] = scale * (q . keys[r]) for the 4 rows keys[0..3] of length D.
template <typename T>
void dot4(const float* q, const T* const* keys, int64_t D, float scale, float* out) {
  f32xn acc[4] = {};
  int64_t i = 0;
  for (; i + kNativeLanes <= D; i += kNativeLanes) {
    const f32xn qv = loadn(q + i);
    for (int r = 0; r < 4; ++r) acc[r] += qv * load_row(keys[r] + i);
  }
#if defined(__AVX__)
  if (i == D) {
    _mm_storeu_ps(out, _mm_mul_ps(sum4(acc), _mm_set1_ps(scale)));
    return;
  }
#endif
  for (int r = 0; r < 4; ++r) {
    float s = sumn(acc[r]);
    for (int64_t k = i; k < D; ++k) s += q[k] * static_cast<float>(keys[r][k]);
    out[r] = s * scale;
  }
}

// Asks the cache for a row of D values (every line of it).
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(T)); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + byte, 0, 3);
}

// For the HG heads h: out[h * D + d] = scales[h] * sum_j p[h * ldp + j] * rows[j][d], each value row
// read once for all HG heads (a few vectors of it at a time, the sums kept in registers).
template <int HG, typename T>
void weighted_rows(const float* p, int64_t ldp, const T* const* rows, int64_t n, int64_t D, const float* scales,
                   float* out) {
  constexpr int64_t kChunk = 4 * kNativeLanes;
  int64_t d = 0;
  for (; d + kChunk <= D; d += kChunk) {
    f32xn acc[HG][4] = {};
    for (int64_t j = 0; j < n; ++j) {
      f32xn v[4];
      for (int c = 0; c < 4; ++c) v[c] = load_row(rows[j] + d + c * kNativeLanes);
      for (int h = 0; h < HG; ++h) {
        const f32xn w = f32xn{} + p[h * ldp + j];
        for (int c = 0; c < 4; ++c) acc[h][c] += w * v[c];
      }
    }
    for (int h = 0; h < HG; ++h)
      for (int c = 0; c < 4; ++c) storen(out + h * D + d + c * kNativeLanes, acc[h][c] * scales[h]);
  }
  for (; d < D; ++d)
    for (int h = 0; h < HG; ++h) {
      float acc = 0.f;
      for (int64_t j = 0; j < n; ++j) acc += p[h * ldp + j] * static_cast<float>(rows[j][d]);
      out[h * D + d] = acc * scales[h];
    }
}

// weighted_rows for a group of G heads, up to four at a time.
template <typename T>
void weighted_rows_of_group(const float* p, int64_t ldp, int64_t G, const T* const* rows, int64_t n, int64_t D,
                            const float* scales, float* out) {
  for (int64_t g = 0; g < G; g += 4) {
    const float* pg = p + g * ldp;
    float* og = out + g * D;
    switch (std::min<int64_t>(4, G - g)) {
      case 4: weighted_rows<4>(pg, ldp, rows, n, D, scales + g, og); break;
      case 3: weighted_rows<3>(pg, ldp, rows, n, D, scales + g, og); break;
      case 2: weighted_rows<2>(pg, ldp, rows, n, D, scales + g, og); break;
      default: weighted_rows<1>(pg, ldp, rows, n, D, scales + g, og); break;
    }
  }
}

void qkv_prologue(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                  const std::optional<at::Tensor>& q_norm_weight, const std::optional<at::Tensor>& k_norm_weight,
                  double eps, const at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t H, int64_t Hkv,
                  int64_t D, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (H + 2 * Hkv) * D,
              "qkv_prologue: qkv must be float32 [T, ", (H + 2 * Hkv) * D, "], got ", qkv.sizes());
  const bool is_fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn, is_half = kv_cache.scalar_type() == at::kHalf;
  TORCH_CHECK((kv_cache.scalar_type() == at::kFloat || is_fp8 || is_half) && kv_cache.is_contiguous() &&
                  kv_cache.dim() == 5 && kv_cache.size(3) == Hkv && kv_cache.size(4) == D,
              "qkv_prologue: kv_cache must be contiguous float32, float16 or float8_e4m3fn [2, blocks, block_size, ",
              Hkv, ", ", D, "]");
  const float ks = is_fp8 ? scale_value(k_scale, "qkv_prologue", "k_scale") : 1.f;
  const float vs = is_fp8 ? scale_value(v_scale, "qkv_prologue", "v_scale") : 1.f;
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "qkv_prologue: positions and slot_mapping must be int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "qkv_prologue: cos_sin_cache must be contiguous float32");
  const bool has_norm = q_norm_weight.has_value() && q_norm_weight->defined();
  const int64_t T = qkv.size(0), rotary = cos_sin_cache.size(1), half = rotary / 2;
  const int64_t cache_half = kv_cache.numel() / 2;  // keys, then values
  float* cache = is_fp8 || is_half ? nullptr : kv_cache.data_ptr<float>();
  uint8_t* cache8 = is_fp8 ? static_cast<uint8_t*>(kv_cache.data_ptr()) : nullptr;
  c10::Half* cache16 = is_half ? kv_cache.data_ptr<c10::Half>() : nullptr;
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = qkv.data_ptr<float>() + t * qkv.stride(0);
      const float* cs = cos_sin_cache.data_ptr<float>() + positions.data_ptr<int64_t>()[t] * rotary;
      for (int64_t h = 0; h < H + Hkv; ++h) {  // queries, then keys
        float* head = row + h * D;
        if (has_norm) norm_head(head, (h < H ? *q_norm_weight : *k_norm_weight).data_ptr<float>(), D, eps);
        rotate_head(head, cs, cs + half, half);
      }
      const int64_t slot = slot_mapping.data_ptr<int64_t>()[t];
      if (slot < 0) continue;
      if (is_fp8) {
        quantize_row(row + H * D, ks, cache8 + slot * Hkv * D, Hkv * D);
        quantize_row(row + (H + Hkv) * D, vs, cache8 + cache_half + slot * Hkv * D, Hkv * D);
        continue;
      }
      if (is_half) {
        store_half_row(row + H * D, cache16 + slot * Hkv * D, Hkv * D);
        store_half_row(row + (H + Hkv) * D, cache16 + cache_half + slot * Hkv * D, Hkv * D);
        continue;
      }
      std::memcpy(cache + slot * Hkv * D, row + H * D, Hkv * D * sizeof(float));
      std::memcpy(cache + cache_half + slot * Hkv * D, row + (H + Hkv) * D, Hkv * D * sizeof(float));
    }
  });
}

// What every job (one query token, one KV head) of a paged_attention call shares.
struct AttentionJobs {
  const at::Tensor &query, &block_tables, &seq_lens;
  const int32_t* starts;
  const std::vector<int64_t>& seq_of_token;
  int64_t H, Hkv, D, group, block_size, max_blocks, window;
  float qk_scale, v_mult, softcap;  // softcap > 0: scores s -> softcap * tanh(s / softcap) (Gemma 2)
  float* out;
};

// Every job of the call. T: the cache's element type as the dot products read it (float32, or
// float16 converted in registers); an fp8 cache (keys8 / values8) has its rows converted to
// float32 first.
template <typename T>
void attend(const AttentionJobs& a, const T* keys, const T* values, const uint8_t* keys8, const uint8_t* values8) {
  const int64_t Hkv = a.Hkv, D = a.D, group = a.group, block_size = a.block_size;
  at::parallel_for(0, a.query.size(0) * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs, scales, key_rows, value_rows;  // fp8: this job's rows as float32
    std::vector<const T*> key_ptrs, value_ptrs;  // row j of this job's keys / values
    for (int64_t job = begin; job < end; ++job) {
      const int64_t t = job / Hkv, kvh = job % Hkv, s = a.seq_of_token[t];
      const int64_t q_len = a.starts[s + 1] - a.starts[s];
      const int64_t pos = a.seq_lens.data_ptr<int32_t>()[s] - q_len + (t - a.starts[s]);  // this token's position
      const int64_t first = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0, n = pos - first + 1;
      const int32_t* table = a.block_tables.data_ptr<int32_t>() + s * a.max_blocks;
      auto slot_of = [&](int64_t p) { return static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size; };
      key_ptrs.resize(n);
      value_ptrs.resize(n);
      bool converted = false;
      if constexpr (std::is_same_v<T, float>) {
        if (keys8 != nullptr) {  // fp8: the rows converted once for the whole head group
          key_rows.resize(n * D);
          value_rows.resize(n * D);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t offset = (slot_of(first + j) * Hkv + kvh) * D;
            dequantize_row(keys8 + offset, key_rows.data() + j * D, D);
            dequantize_row(values8 + offset, value_rows.data() + j * D, D);
            key_ptrs[j] = key_rows.data() + j * D;
            value_ptrs[j] = value_rows.data() + j * D;
          }
          converted = true;
        }
      }
      // The rows in place, walked block by block (no division per row).
      for (int64_t j = 0; j < n && !converted;) {
        const int64_t p = first + j, in_block = std::min<int64_t>(block_size - p % block_size, n - j);
        const int64_t row0 = slot_of(p) * Hkv + kvh;
        for (int64_t r = 0; r < in_block; ++r, ++j) {
          key_ptrs[j] = keys + (row0 + r * Hkv) * D;
          value_ptrs[j] = values + (row0 + r * Hkv) * D;
        }
      }
      // Scores of every query head of the group, four keys at a time (each key row is read once
      // for all of the group's heads; the four dot products overlap). The rows are scattered over
      // the cache's blocks, which the hardware prefetchers do not follow: the keys kRowsAhead on
      // and the values of the keys at hand (read next, by the weighted sums) are asked for.
      const float* q0 = a.query.data_ptr<float>() + t * a.query.stride(0) + kvh * group * D;
      probs.resize(group * n);
      for (int64_t r = 0; r < std::min<int64_t>(kRowsAhead, n); ++r) prefetch_row(key_ptrs[r], D);
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        for (int64_t r = j + kRowsAhead; r < std::min<int64_t>(j + kRowsAhead + 4, n); ++r) prefetch_row(key_ptrs[r], D);
        for (int64_t r = j; r < j + 4; ++r) prefetch_row(value_ptrs[r], D);
        for (int64_t g = 0; g < group; ++g)
          dot4(q0 + g * D, key_ptrs.data() + j, D, a.qk_scale, probs.data() + g * n + j);
      }
      for (; j < n; ++j) {
        prefetch_row(value_ptrs[j], D);
        for (int64_t g = 0; g < group; ++g) probs[g * n + j] = dot(q0 + g * D, key_ptrs[j], D) * a.qk_scale;
      }
      if (a.softcap > 0.f)
        for (float& score : probs) score = std::tanh(score / a.softcap) * a.softcap;
      scales.resize(group);
      for (int64_t g = 0; g < group; ++g) {
        float* p = probs.data() + g * n;
        scales[g] = a.v_mult / exp_shifted(p, n, *std::max_element(p, p + n));
      }
      weighted_rows_of_group(probs.data(), n, group, value_ptrs.data(), n, D, scales.data(),
                             a.out + (t * a.H + kvh * group) * D);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                           int64_t window, double softcap, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 3 && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2),
              "paged_attention: query must be float32 [T, H, D] with contiguous heads");
  const bool is_fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn, is_half = kv_cache.scalar_type() == at::kHalf;
  TORCH_CHECK((kv_cache.scalar_type() == at::kFloat || is_fp8 || is_half) && kv_cache.is_contiguous() &&
                  kv_cache.dim() == 5,
              "paged_attention: kv_cache must be contiguous float32, float16 or float8_e4m3fn [2, blocks, "
              "block_size, Hkv, D]");
  // fp8: q . (k8 * k_scale) = (q . k8) * k_scale; sum p (v8 * v_scale) = sum (p * v_scale) v8.
  const float k_mult = is_fp8 ? scale_value(k_scale, "paged_attention", "k_scale") : 1.f;
  const float v_mult = is_fp8 ? scale_value(v_scale, "paged_attention", "v_scale") : 1.f;
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "paged_attention: block_tables, seq_lens and query_start_loc must be int32");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2), S = seq_lens.size(0);
  const int64_t cache_half = kv_cache.numel() / 2;
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  std::vector<int64_t> seq_of_token(T);  // the sequence each query token belongs to
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = starts[s]; t < starts[s + 1]; ++t) seq_of_token[t] = s;
  at::Tensor out = at::empty({T, H, D}, query.options());
  const AttentionJobs jobs{query, block_tables, seq_lens, starts, seq_of_token, H, kv_cache.size(3), D,
                           H / kv_cache.size(3), kv_cache.size(2), block_tables.size(1), window,
                           static_cast<float>(scale) * k_mult, v_mult, static_cast<float>(softcap),
                           out.data_ptr<float>()};
  if (is_half) {
    const c10::Half* keys = kv_cache.data_ptr<c10::Half>();
    attend<c10::Half>(jobs, keys, keys + cache_half, nullptr, nullptr);
  } else if (is_fp8) {
    const uint8_t* keys8 = static_cast<const uint8_t*>(kv_cache.data_ptr());
    attend<float>(jobs, nullptr, nullptr, keys8, keys8 + cache_half);
  } else {
    const float* keys = kv_cache.data_ptr<float>();
    attend<float>(jobs, keys, keys + cache_half, nullptr, nullptr);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baryon_cpu, m) {
  m.def("qkv_prologue(Tensor(a!) qkv, Tensor positions, Tensor cos_sin_cache, Tensor? q_norm_weight, "
        "Tensor? k_norm_weight, float eps, Tensor(b!) kv_cache, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads, int head_dim, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int window, float softcap, Tensor? k_scale=None, "
        "Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(baryon_cpu, CPU, m) {
  m.impl("qkv_prologue", &qkv_prologue);
  m.impl("paged_attention", &paged_attention);
}
