// y = x @ W.T (+ bias) for baryon's block-quantized rows with integer dot products (llama.cpp's
// scheme): each 32-element block of x is quantized to int8 with its own scale d (d = max|x| / 127)
// and its float sum kept; a weight block is  scale * code + min  with unsigned codes, so
//
//   sum_i w_i x_i  ~=  scale * d * sum_i code_i q_i  +  min * sum_i x_i
//
// and sum_i code_i q_i is an integer dot product: AVX-512 VNNI's vpdpbusd (unsigned bytes times
// signed bytes, four products per int32 lane; 8-bit rows hold signed codes c, which enter as
// c + 128 = c ^ 0x80, and 128 * sum_i q_i is subtracted exactly in the integer accumulator), or on
// AVX2 vpmaddubsw + vpmaddwd (8-bit codes as |c| times q with c's sign, so no int16 sum saturates).
// Bits 6 (GGUF's Q6_K) rows hold int8 codes as bits 8 does, multiplied the same way, but each
// 32-block has a scale per 16-element half and no min:
//
//   sum_i w_i x_i  ~=  d * (scale_0 * sum_{i<16} code_i q_i  +  scale_1 * sum_{i>=16} code_i q_i)
//
// Both instruction sets sum 4 consecutive bytes per int32 lane, so lanes 0..3 of a block's 8 are
// half 0 and lanes 4..7 half 1: each lane takes its half's scale, nothing else changes.
// See baryon/kernels/block_quant.py for the packed row format and the torch reference of these
// numerics (block_quant_linear_int8_reference).
//
// x: [M, K] float32, packed: [N, row_bytes] uint8 (float32 or float16 pairs, block_pairs.h), bias:
// [N] float32 or none -> y: [M, N] float32.
// Activations are quantized once per call into per-row groups laid out for the code loads (below);
// the multiply is tiled MR rows of x times NR weight rows (each loaded weight group is used MR
// times), split over output rows with ATen's thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "block_pairs.h"

namespace {

using baryon_cpu::read_pair;
using baryon_cpu::row_code_bytes;

constexpr int64_t kBlock = 32;
// How far ahead of the tile being computed the weight rows are prefetched (about; whole rows).
// On the 2-core EPYC (AVX2), the LM head (49,152 x 576 8-bit rows) alone: 2.5-2.8 ms without,
// 1.44-1.59 ms at 2 or 4 KB, 1.65-1.78 ms at 8 KB (2 threads).
constexpr int64_t kPrefetchBytes = 4096;

// The width of one load of weight codes: 64 bytes with AVX-512 VNNI, else 32 (AVX2, or the
// portable loop).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define BARYON_INT8_DOT_AVX512 1
constexpr int64_t kVec = 64;
#elif defined(__AVX2__) && defined(__FMA__)
#define BARYON_INT8_DOT_AVX2 1
constexpr int64_t kVec = 32;
#else
constexpr int64_t kVec = 32;
#endif

// One group of quantized activations matches one load of weight codes: bits 4, kVec / 16 blocks
// (the low nibbles of the loaded bytes are elements 0..15 of each block, the high nibbles 16..31,
// so the int8 activations are stored as the first halves of the group's blocks, then the second
// halves); bits 6 and 8, kVec / 32 blocks in element order. Then kVec / 4 float lanes of d and,
// bits 4 and 8, of sum(x) / lanes_per_block (lane i belongs to the block whose bytes lane i's dot
// product covers), and, bits 6 and 8, kVec / 4 int32 lanes of -128 * (the sum of that lane's 4
// activation bytes).
constexpr int64_t kGroupBytes = 4 * kVec;
constexpr int64_t kLanes = kVec / 4;
constexpr int64_t kCorrOffset = kVec, kDOffset = 2 * kVec, kSumOffset = 3 * kVec;

template <int Bits>
struct Layout {
  static constexpr int64_t blocks_per_group = Bits == 4 ? kVec / 16 : kVec / 32;
  static constexpr int64_t lanes_per_block = kLanes / blocks_per_group;
};

// One block of 32 floats -> int8 q = round-half-even(x / d) with d = max|x| / 127 (as
// block_quant.quantize_activation_blocks: x * (1 / d), rounded), and the float sum of the block.
inline void quantize_block(const float* x, int8_t* q, float& d, float& sum) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    total = _mm256_add_ps(total, v[i]);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  sum = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  d = _mm_cvtss_f32(m) / 127.f;
  const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
  // cvtps rounds half to even (the default rounding mode); pack with signed saturation.
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id));
  const __m256i words = _mm256_packs_epi32(i0, i1), words2 = _mm256_packs_epi32(i2, i3);  // lanes interleaved by 128
  const __m256i bytes = _mm256_packs_epi16(words, words2);
  // packs works within 128-bit halves: bytes holds dwords in order 0,2,4,6,1,3,5,7 (4 elements each).
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  float amax = 0.f;
  sum = 0.f;
  for (int i = 0; i < kBlock; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    sum += x[i];
  }
  d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));
#endif
}

// Quantizes row x[0..K) into `groups` groups at `out` (zero-filled first: a partial last group
// contributes nothing).
template <int Bits>
void quantize_row(const float* x, int64_t K, uint8_t* out, int64_t groups) {
  using L = Layout<Bits>;
  std::memset(out, 0, groups * kGroupBytes);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float d, sum;
    int8_t q[kBlock];
    quantize_block(x + b * kBlock, q, d, sum);
    uint8_t* group = out + (b / L::blocks_per_group) * kGroupBytes;
    const int64_t j = b % L::blocks_per_group;  // this block's place in its group
    int8_t* qg = reinterpret_cast<int8_t*>(group);
    if constexpr (Bits == 4) {
      std::memcpy(qg + 16 * j, q, 16);
      std::memcpy(qg + kVec + 16 * j, q + 16, 16);
    } else {  // bits 6 and 8
      std::memcpy(qg + 32 * j, q, 32);
      int32_t* corr = reinterpret_cast<int32_t*>(group + kCorrOffset);
      for (int lane = 0; lane < 8; ++lane)
        corr[8 * j + lane] = -128 * (q[4 * lane] + q[4 * lane + 1] + q[4 * lane + 2] + q[4 * lane + 3]);
    }
    float* dl = reinterpret_cast<float*>(group + kDOffset);
    float* sl = reinterpret_cast<float*>(group + kSumOffset);
    for (int64_t lane = 0; lane < L::lanes_per_block; ++lane) {
      dl[j * L::lanes_per_block + lane] = d;
      if constexpr (Bits != 6) sl[j * L::lanes_per_block + lane] = sum / L::lanes_per_block;  // bits 6: no min
    }
  }
}

// Blocks in group g of a row of K elements (the last group may be partial).
template <int Bits>
inline int64_t blocks_in_group(int64_t K, int64_t g) {
  return std::min<int64_t>(Layout<Bits>::blocks_per_group, K / kBlock - g * Layout<Bits>::blocks_per_group);
}

// Where group g's pairs start in a row (after its K / 2 or K code bytes; 4 bytes a pair where
// they are float16, 8 where float32).
template <int Bits, bool Half>
inline const uint8_t* group_pairs(const uint8_t* row, int64_t K, int64_t g) {
  return row + row_code_bytes(K, Bits) + g * Layout<Bits>::blocks_per_group * (Half ? 4 : 8);
}

#if defined(BARYON_INT8_DOT_AVX512)

// Bits 6 (Q6_K) on AVX-512 VNNI: the tiles below (bits 4 and 8 take the arrangement after them).
// Weights of one group of one row, ready for the dot products: the code bytes + 128 and the scale
// of each lane's half-block.
struct WeightGroup {
  __m512i codes;
  __m512 scale;
};

template <bool Half>
inline WeightGroup load_weights(const uint8_t* row, int64_t K, int64_t g) {
  const int64_t blocks = blocks_in_group<6>(K, g), code_bytes = blocks * kBlock;
  const __mmask64 code_mask = code_bytes >= 64 ? ~0ULL : (1ULL << code_bytes) - 1;
  WeightGroup w;
  w.codes = _mm512_xor_si512(_mm512_maskz_loadu_epi8(code_mask, row + g * kVec), _mm512_set1_epi8(static_cast<char>(0x80)));
  const __mmask16 pair_mask = static_cast<__mmask16>((1u << (2 * blocks)) - 1);
  const uint8_t* pair_bytes = group_pairs<6, Half>(row, K, g);
  __m512 pairs;
  if constexpr (Half)
    pairs = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(pair_mask, pair_bytes));
  else
    pairs = _mm512_maskz_loadu_ps(pair_mask, pair_bytes);
  // pairs = (scale of half 0, of half 1) per block; lanes 4h..4h+3 are half h
  w.scale = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), pairs);
  return w;
}

// MR rows of quantized x times NR weight rows, all groups; y[m * ldy + n] = the dot products.
template <int Bits, bool Half, int MR, int NR>
inline void tile(const uint8_t* xq, int64_t x_stride, const uint8_t* rows, int64_t row_bytes, int64_t K,
                 int64_t groups, float* y, int64_t ldy) {
  static_assert(Bits == 6, "bits 4 and 8 take the sixteen-rows-across-lanes arrangement on AVX-512");
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    WeightGroup w[NR];
    for (int n = 0; n < NR; ++n) w[n] = load_weights<Half>(rows + n * row_bytes, K, g);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const uint8_t* group = xq + m * x_stride + g * kGroupBytes;
      const __m512 d = _mm512_loadu_ps(group + kDOffset);
      const __m512i q = _mm512_loadu_si512(group), start = _mm512_loadu_si512(group + kCorrOffset);
      for (int n = 0; n < NR; ++n) {
        const __m512i dot = _mm512_dpbusd_epi32(start, w[n].codes, q);
        acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w[n].scale, d), acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m][n]);
}

constexpr const char* kIsa = "avx512_vnni";
constexpr int kDecodeRows = 4;  // weight rows per tile when x has fewer than 4 rows

// ---- Bits 4 and 8: sixteen weight rows across the lanes ----
//
// The tiles above give each int32 lane four bytes of one row's block, so every block's scale is
// applied on four lanes per row and token (and the lanes are summed at the end). Here (AVX-512
// VNNI, bits 4 and 8, every number of rows of x) a lane is a weight row: it gets its row's whole
// integer dot product of a block, and the block is added in block order,
//
//   acc = fma(float(dot_b) * scale_b, d_b, acc);  acc = fma(min_b, sum_b, acc)
//
// once for every lane's row of one row of x. Two ways produce the same integer dots and add them
// with the same steps, so a row of x gives the same bits however many rows share the call (batch
// invariance: prefix caching, chunking and batching cannot change a token):
// - gathered (kGatherMinRows or more rows of x): sixteen weight rows across a vector's lanes; the
//   four bytes a vpdpbusd step takes from each row are gathered from the sixteen rows and the
//   activations' four bytes broadcast, so 8 steps give each lane its block's dot product and a
//   block's float work is paid once per sixteen rows. The gathered codes serve up to 16 rows of x.
// - reduced (fewer rows, where gathers would not pay): four weight rows at a time, each row's
//   64 code bytes loaded as they lie and multiplied as the tiles above do (four lanes a block),
//   then the four rows' lanes summed and transposed in registers (lane r: row r's block dot).
// Bits 6 (two scales per block) keeps the tiles above.
//
// Measured on the 2-core Zen 4 (a decode step's 121 linears of the default model, each matrix
// streamed from memory, best of 15): 1 / 2 / 3 / 4 / 5 / 6 / 8 / 16 rows of x, tiles above
// 3.4-3.9 / 4.5 / 6.8 / 6.3-7.7 / 8.4 / 10.8 / 11.5 / 23.2 ms, gathered 5.7 / 6.0 / 6.4 / 6.9 /
// 7.5 / 8.1 / 9.0 / 12.9 ms, reduced (1 and 4 rows, alternating with the tiles above)
// 3.7-3.9 / 7.5-7.9 ms.
//
// Activations: per row of x, its blocks' int8 codes in element order (32 bytes a block), then per
// block d, sum(x) and -128 * sum(q) (float, float, int32).
constexpr int64_t kGatherMinRows = 5;
constexpr int kWideRows = 16;  // weight rows per gathered tile: the lanes of a vector
constexpr int kWideTokens = 16;  // rows of x per gathered pass: 16 accumulators, 8 code vectors, 2 scale vectors
constexpr int kReducedTokens = kGatherMinRows - 1;  // rows of x per reduced pass
constexpr int64_t kWideAhead = 2;  // tiles between the one computed and the one prefetched

struct WideActivations {
  const uint8_t* base;
  int64_t stride, blocks;  // bytes per row of x; 32-blocks per row
  const uint8_t* row(int64_t m) const { return base + m * stride; }
  const int32_t* codes(int64_t m, int64_t b) const { return reinterpret_cast<const int32_t*>(row(m) + b * kBlock); }
  float d(int64_t m, int64_t b) const { return reinterpret_cast<const float*>(row(m) + blocks * kBlock)[b]; }
  float sum(int64_t m, int64_t b) const { return reinterpret_cast<const float*>(row(m) + blocks * (kBlock + 4))[b]; }
  int32_t corr(int64_t m, int64_t b) const {
    return reinterpret_cast<const int32_t*>(row(m) + blocks * (kBlock + 8))[b];
  }
};

inline int64_t wide_stride(int64_t blocks) { return (blocks * (kBlock + 12) + 63) / 64 * 64; }

inline void quantize_row_wide(const float* x, int64_t blocks, uint8_t* out) {
  float* d = reinterpret_cast<float*>(out + blocks * kBlock);
  float* sum = d + blocks;
  int32_t* corr = reinterpret_cast<int32_t*>(sum + blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    int8_t* q = reinterpret_cast<int8_t*>(out + b * kBlock);
    quantize_block(x + b * kBlock, q, d[b], sum[b]);
    int32_t total = 0;
    for (int i = 0; i < kBlock; ++i) total += q[i];
    corr[b] = -128 * total;
  }
}

inline __mmask64 first_bytes(int64_t n) { return n >= 64 ? ~0ULL : (1ULL << n) - 1; }

// Each of the tile's rows' scale and min of block b.
template <bool Half>
inline void gather_pairs(const uint8_t* pairs, __m512i index, __mmask16 live, int64_t b, __m512& scale, __m512& min) {
  if constexpr (Half) {
    const __m512i both = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, index, pairs + 4 * b, 1);
    scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(both));
    min = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(both, 16)));
  } else {
    scale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, index, pairs + 8 * b, 1);
    min = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, index, pairs + 8 * b + 4, 1);
  }
}

// acc += block b's part for one row of x: the step both ways share, in one place.
inline __m512 add_block(__m512 acc, __m512i dot, __m512 scale, __m512 min, float d, float sum) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), scale), _mm512_set1_ps(d), acc);
  return _mm512_fmadd_ps(min, _mm512_set1_ps(sum), acc);
}

// Asks in this block's share of the weight bytes `ahead` (see wide_rows).
inline void prefetch_share(const uint8_t* ahead, int64_t lines, int64_t share, int64_t b) {
  for (int64_t l = b * share; l < std::min(lines, (b + 1) * share); ++l) __builtin_prefetch(ahead + 64 * l, 0, 3);
}

// Code bytes as vpdpbusd's unsigned operand: bits 4, the low and the high nibbles apart; bits 8,
// code + 128 (lo only).
template <int Bits>
inline void unsigned_codes(__m512i codes, __m512i& lo, __m512i& hi) {
  if constexpr (Bits == 4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(codes, nibble);
    hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
  } else {
    lo = _mm512_xor_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
}

// Gathered: block b of the tile's rows as code vectors (bits 4: 4 low-nibble vectors, elements
// 4j..4j+3 of each row, then 4 high-nibble ones, elements 16 + 4j..; bits 8: 8 vectors of code + 128).
template <int Bits>
inline void gather_codes(const uint8_t* rows, __m512i index, __mmask16 live, int64_t b, __m512i w[8]) {
  const __m512i none = _mm512_setzero_si512();
  if constexpr (Bits == 4) {
    for (int j = 0; j < 4; ++j)
      unsigned_codes<4>(_mm512_mask_i32gather_epi32(none, live, index, rows + b * 16 + 4 * j, 1), w[j], w[4 + j]);
  } else {
    for (int j = 0; j < 8; ++j)
      unsigned_codes<8>(_mm512_mask_i32gather_epi32(none, live, index, rows + b * 32 + 4 * j, 1), w[j], w[j]);
  }
}

// Gathered: MR rows of x (from m0) times the tile's weight rows (lanes `live`): y[m, n0 + r].
template <int Bits, bool Half, int MR>
inline void gathered_tile(const WideActivations& xq, int64_t m0, const uint8_t* rows, const uint8_t* pairs,
                          __m512i index, __mmask16 live, float* y, int64_t ldy, const uint8_t* ahead,
                          int64_t ahead_lines) {
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t share = (ahead_lines + xq.blocks - 1) / xq.blocks;
  for (int64_t b = 0; b < xq.blocks; ++b) {
    prefetch_share(ahead, ahead_lines, share, b);
    __m512i w[8];
    __m512 scale, min;
    gather_codes<Bits>(rows, index, live, b, w);
    gather_pairs<Half>(pairs, index, live, b, scale, min);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const int32_t* q = xq.codes(m0 + m, b);
      __m512i dot = Bits == 8 ? _mm512_set1_epi32(xq.corr(m0 + m, b)) : _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(q[j]));
      acc[m] = add_block(acc[m], dot, scale, min, xq.d(m0 + m, b), xq.sum(m0 + m, b));
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * ldy, live, acc[m]);
}

// acc += block b's part for four weight rows of one row of x: add_block's steps on four lanes.
inline __m128 add_block4(__m128 acc, __m128i dot, __m128 scale, __m128 min, float d, float sum) {
  acc = _mm_fmadd_ps(_mm_mul_ps(_mm_cvtepi32_ps(dot), scale), _mm_set1_ps(d), acc);
  return _mm_fmadd_ps(min, _mm_set1_ps(sum), acc);
}

// Reduced: the MR (1..4) rows of x times `count` (1..4) weight rows, lanes 0..count-1: y[m, n0 + r].
// Each row's 64-byte groups of codes are read as they lie and multiplied as the tiles above do
// (four int32 lanes a block); the four rows' lanes are then summed and transposed in registers,
// so that lane r holds row r's whole block dot product, and each block is added in block order
// as the gathered path adds it (the same float steps on the same values: the same bits).
template <int Bits, bool Half, int MR>
inline void reduced_tile(const WideActivations& xq, const uint8_t* rows, int64_t row_bytes, int64_t count,
                         const uint8_t* pairs, float* y, int64_t ldy) {
  constexpr int64_t per_group = Layout<Bits>::blocks_per_group;  // blocks in a 64-byte group of codes
  const int64_t groups = (xq.blocks + per_group - 1) / per_group;
  const __m512i low_halves = _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i high_halves = _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2);
  // [row 0 | row 1 | row 2 | row 3] pairs (a dword a block) -> 128-bit lane j: block j's four rows.
  const __m512i by_block = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  const __m128i index = _mm_mullo_epi32(_mm_set_epi32(3, 2, 1, 0), _mm_set1_epi32(static_cast<int32_t>(row_bytes)));
  const __mmask8 live = static_cast<__mmask8>((1u << count) - 1);
  __m128 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t blocks = std::min<int64_t>(per_group, xq.blocks - g * per_group);
    // The group's activations as the code bytes lie (bits 4: each block's first 16 codes, then
    // the second 16s, for the low and the high nibbles), zero past the row's last block.
    __m512i x_lo[MR], x_hi[MR];
    for (int m = 0; m < MR; ++m) {
      const uint8_t* p = xq.row(m) + g * per_group * kBlock;
      const int64_t bytes = blocks * kBlock;
      const __m512i a = _mm512_maskz_loadu_epi8(first_bytes(bytes), p);
      if constexpr (Bits == 4) {
        const __m512i b = bytes > 64 ? _mm512_maskz_loadu_epi8(first_bytes(bytes - 64), p + 64) : _mm512_setzero_si512();
        x_lo[m] = _mm512_permutex2var_epi64(a, low_halves, b);
        x_hi[m] = _mm512_permutex2var_epi64(a, high_halves, b);
      } else {
        x_lo[m] = a;
      }
    }
    const __mmask64 code_mask = first_bytes(blocks * (Bits == 4 ? kBlock / 2 : kBlock));
    const __mmask8 pair_mask = static_cast<__mmask8>((1u << blocks) - 1);
    __m512i dots[MR][4];
    __m128i row_pairs[4];  // float16 pairs: each row's, a dword a block
    for (int r = 0; r < 4; ++r) {
      __m512i lo = _mm512_setzero_si512(), hi = lo;
      row_pairs[r] = _mm_setzero_si128();
      if (r < count) {
        if constexpr (Half) row_pairs[r] = _mm_maskz_loadu_epi32(pair_mask, pairs + r * row_bytes + g * per_group * 4);
        unsigned_codes<Bits>(_mm512_maskz_loadu_epi8(code_mask, rows + r * row_bytes + g * kVec), lo, hi);
      }
      for (int m = 0; m < MR; ++m) {
        dots[m][r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x_lo[m]);
        if constexpr (Bits == 4) dots[m][r] = _mm512_dpbusd_epi32(dots[m][r], hi, x_hi[m]);
      }
    }
    // Each block's four scales and mins (lane r: row r), as gather_pairs reads them.
    alignas(64) float scales[16], mins[16];  // block j: [4j, 4j + 4)
    if constexpr (Half) {
      __m512i both = _mm512_castsi128_si512(row_pairs[0]);
      both = _mm512_inserti32x4(both, row_pairs[1], 1);
      both = _mm512_inserti32x4(both, row_pairs[2], 2);
      both = _mm512_inserti32x4(both, row_pairs[3], 3);
      both = _mm512_permutexvar_epi32(by_block, both);
      _mm512_store_ps(scales, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(both)));
      _mm512_store_ps(mins, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(both, 16))));
    } else {
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t b = g * per_group + j;
        _mm_store_ps(scales + 4 * j, _mm_mmask_i32gather_ps(_mm_setzero_ps(), live, index, pairs + 8 * b, 1));
        _mm_store_ps(mins + 4 * j, _mm_mmask_i32gather_ps(_mm_setzero_ps(), live, index, pairs + 8 * b + 4, 1));
      }
    }
    for (int m = 0; m < MR; ++m) {
      // The four rows' lanes summed: 128-bit lane j of `sums` = block j (bits 8: lanes 2j, 2j + 1).
      const __m512i p01 = _mm512_add_epi32(_mm512_unpacklo_epi32(dots[m][0], dots[m][1]),
                                           _mm512_unpackhi_epi32(dots[m][0], dots[m][1]));
      const __m512i p23 = _mm512_add_epi32(_mm512_unpacklo_epi32(dots[m][2], dots[m][3]),
                                           _mm512_unpackhi_epi32(dots[m][2], dots[m][3]));
      __m512i sums = _mm512_add_epi32(_mm512_unpacklo_epi64(p01, p23), _mm512_unpackhi_epi64(p01, p23));
      if constexpr (Bits == 8)  // block j = lanes 2j + 2j+1, moved to lane j
        sums = _mm512_add_epi32(_mm512_permutexvar_epi64(_mm512_set_epi64(7, 6, 7, 6, 5, 4, 1, 0), sums),
                                _mm512_permutexvar_epi64(_mm512_set_epi64(7, 6, 7, 6, 7, 6, 3, 2), sums));
      alignas(64) int32_t block_dots[16];
      _mm512_store_si512(block_dots, sums);
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t b = g * per_group + j;
        __m128i dot = _mm_load_si128(reinterpret_cast<const __m128i*>(block_dots + 4 * j));
        if constexpr (Bits == 8) dot = _mm_add_epi32(dot, _mm_set1_epi32(xq.corr(m, b)));
        acc[m] = add_block4(acc[m], dot, _mm_load_ps(scales + 4 * j), _mm_load_ps(mins + 4 * j), xq.d(m, b),
                            xq.sum(m, b));
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm_mask_storeu_ps(y + m * ldy, live, acc[m]);
}

// The tile instance for `tokens` (1..MR) rows of x.
template <int MR, typename Run>
inline void with_tokens(int64_t tokens, const Run& run) {
  if (tokens == MR) {
    run(std::integral_constant<int, MR>{});
  } else if constexpr (MR > 1) {
    with_tokens<MR - 1>(tokens, run);
  }
}

// Weight rows [n_begin, n_end) against every row of x, sixteen rows at a time.
template <int Bits, bool Half>
void wide_rows(const WideActivations& xq, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t K, float* y,
               int64_t N, int64_t n_begin, int64_t n_end) {
  const __m512i index = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
  const int64_t codes = row_code_bytes(K, Bits);
  const uint8_t* end = w + n_end * row_bytes;
  for (int64_t n = n_begin; n < n_end; n += kWideRows) {
    const int64_t here = std::min<int64_t>(kWideRows, n_end - n);
    const __mmask16 live = static_cast<__mmask16>((1u << here) - 1);
    const uint8_t* rows = w + n * row_bytes;
    if (M < kGatherMinRows) {  // four weight rows at a time, the rows kPrefetchBytes on asked in
      for (int64_t r = 0; r < here; r += 4) {
        const uint8_t* four = rows + r * row_bytes;
        const int64_t count = std::min<int64_t>(4, here - r);
        for (const uint8_t* line = four + kPrefetchBytes; line < std::min(end, four + count * row_bytes + kPrefetchBytes);
             line += 64)
          __builtin_prefetch(line, 0, 3);
        with_tokens<kReducedTokens>(M, [&](auto tokens) {
          reduced_tile<Bits, Half, decltype(tokens)::value>(xq, four, row_bytes, count, four + codes, y + n + r, N);
        });
      }
      continue;
    }
    // While the first rows of x pass over this tile, the tile kWideAhead tiles on is asked in
    // (the hardware prefetchers do not follow sixteen rows read a block at a time).
    const uint8_t* ahead = rows + kWideAhead * kWideRows * row_bytes;
    int64_t ahead_lines = ahead < end ? (std::min(end, ahead + kWideRows * row_bytes) - ahead + 63) / 64 : 0;
    // Up to kWideTokens rows of x per pass over the tile, the last pass sized to what is left
    // (each pass gathers the tile's codes again).
    for (int64_t m = 0; m < M; m += kWideTokens) {
      with_tokens<kWideTokens>(std::min<int64_t>(kWideTokens, M - m), [&](auto tokens) {
        gathered_tile<Bits, Half, decltype(tokens)::value>(xq, m, rows, rows + codes, index, live, y + n, N, ahead,
                                                           ahead_lines);
      });
      ahead_lines = 0;
    }
  }
}

template <int Bits>
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& packed, int64_t K, bool half) {
  const int64_t M = x.size(0), N = packed.size(0), row_bytes = packed.size(1), blocks = K / kBlock;
  const int64_t stride = wide_stride(blocks);
  const std::unique_ptr<uint8_t[]> storage(new uint8_t[M * stride + 64]);
  uint8_t* base = storage.get() + (64 - reinterpret_cast<uintptr_t>(storage.get()) % 64) % 64;
  const float* x_ptr = x.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row_wide(x_ptr + m * K, blocks, base + m * stride);
  });
  const WideActivations xq{base, stride, blocks};
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  float* y_ptr = y.data_ptr<float>();
  // Tasks of whole 16-row tiles (at::parallel_for's grain is a minimum, its chunks may be any size).
  const int64_t tiles = (N + kWideRows - 1) / kWideRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    (half ? wide_rows<Bits, true> : wide_rows<Bits, false>)(xq, M, w_ptr, row_bytes, K, y_ptr, N, begin * kWideRows,
                                                            std::min(N, end * kWideRows));
  });
  return y;
}

#elif defined(BARYON_INT8_DOT_AVX2)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Bits 4: the unsigned nibbles apart; bits 6 and 8: the signed codes as they are (the products use
// |code| times q with code's sign, which _mm256_maddubs_epi16 cannot saturate: 2 * 128 * 127).
// Bits 6: the scale of each lane's half-block (lanes 0..3: elements 0..15), min 0.
struct WeightGroup {
  __m256i lo, hi;
  __m256 scale, min;
};

// The group's pairs as float32: (scale, min) of its first block, then of its second (bits 4),
// zeros past the row's last block. Float16 pairs convert in one F16C instruction; float32 ones are
// read in place, no further than the row's end.
template <int Bits, bool Half>
inline __m128 load_pairs(const uint8_t* row, int64_t K, int64_t g) {
  const uint8_t* bytes = group_pairs<Bits, Half>(row, K, g);
  const bool two_blocks = blocks_in_group<Bits>(K, g) == 2;
  if constexpr (Half) {
#if defined(__F16C__)
    int64_t eight = 0;
    std::memcpy(&eight, bytes, two_blocks ? 8 : 4);
    return _mm_cvtph_ps(_mm_cvtsi64_si128(eight));
#else
    float converted[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < (two_blocks ? 2 : 1); ++b) read_pair(bytes, b, true, converted[2 * b], converted[2 * b + 1]);
    return _mm_loadu_ps(converted);
#endif
  }
  return two_blocks ? _mm_loadu_ps(reinterpret_cast<const float*>(bytes))
                    : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(bytes)));
}

template <int Bits, bool Half>
inline WeightGroup load_weights(const uint8_t* row, int64_t K, int64_t g) {
  const __m256 pairs = _mm256_castps128_ps256(load_pairs<Bits, Half>(row, K, g));  // lanes 0..3 only
  WeightGroup w;
  if constexpr (Bits == 4) {
    const bool two_blocks = blocks_in_group<Bits>(K, g) == 2;
    const __m256i codes = two_blocks ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kVec))
                                     : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * kVec)));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    w.lo = _mm256_and_si256(codes, nibble);
    w.hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble);
    // Lanes 0..3: the first block's; 4..7: the second's (zeros for a lone block: its activations are zero).
    w.scale = _mm256_permutevar8x32_ps(pairs, _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0));
    w.min = _mm256_permutevar8x32_ps(pairs, _mm256_set_epi32(3, 3, 3, 3, 1, 1, 1, 1));
  } else if constexpr (Bits == 6) {  // lanes 0..3: half 0's scale, 4..7: half 1's
    w.lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kVec));
    w.scale = _mm256_permutevar8x32_ps(pairs, _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
    w.min = _mm256_setzero_ps();
  } else {
    w.lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kVec));
    w.scale = _mm256_permutevar8x32_ps(pairs, _mm256_setzero_si256());
    w.min = _mm256_permutevar8x32_ps(pairs, _mm256_set1_epi32(1));
  }
  return w;
}

template <int Bits, bool Half, int MR, int NR>
inline void tile(const uint8_t* xq, int64_t x_stride, const uint8_t* rows, int64_t row_bytes, int64_t K,
                 int64_t groups, float* y, int64_t ldy) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    WeightGroup w[NR];
    for (int n = 0; n < NR; ++n) w[n] = load_weights<Bits, Half>(rows + n * row_bytes, K, g);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const uint8_t* group = xq + m * x_stride + g * kGroupBytes;
      const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(group + kDOffset));
      const __m256 sum = _mm256_loadu_ps(reinterpret_cast<const float*>(group + kSumOffset));
      const __m256i q_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group));
      for (int n = 0; n < NR; ++n) {
        __m256i pairs;  // 16 int16 sums of two products
        if constexpr (Bits == 4) {
          const __m256i q_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kVec));
          pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w[n].lo, q_lo), _mm256_maddubs_epi16(w[n].hi, q_hi));
        } else {  // bits 6 and 8
          pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w[n].lo, w[n].lo), _mm256_sign_epi8(q_lo, w[n].lo));
        }
        const __m256i dot = _mm256_madd_epi16(pairs, ones);  // int32 lane i: bytes 4i..4i+3
        acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(w[n].scale, d), acc[m][n]);
        if constexpr (Bits != 6) acc[m][n] = _mm256_fmadd_ps(w[n].min, sum, acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) y[m * ldy + n] = hsum(acc[m][n]);
}

constexpr const char* kIsa = "avx2";
constexpr int kDecodeRows = 2;

#else  // neither: the same integer numerics, one lane at a time (correct, not fast)

template <int Bits, bool Half, int MR, int NR>
inline void tile(const uint8_t* xq, int64_t x_stride, const uint8_t* rows, int64_t row_bytes, int64_t K,
                 int64_t groups, float* y, int64_t ldy) {
  using L = Layout<Bits>;
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      const uint8_t* row = rows + n * row_bytes;
      float total = 0.f;
      for (int64_t b = 0; b < K / kBlock; ++b) {
        const uint8_t* group = xq + m * x_stride + (b / L::blocks_per_group) * kGroupBytes;
        const int64_t j = b % L::blocks_per_group;
        const int8_t* q = reinterpret_cast<const int8_t*>(group);
        int32_t dot[2] = {0, 0};  // elements 0..15, 16..31
        for (int i = 0; i < kBlock; ++i) {
          if constexpr (Bits == 4) {
            const uint8_t byte = row[b * 16 + i % 16];
            const int code = i < 16 ? byte & 15 : byte >> 4;
            dot[i / 16] += code * q[(i < 16 ? 0 : kVec) + 16 * j + i % 16];
          } else {
            dot[i / 16] += static_cast<int8_t>(row[b * 32 + i]) * q[32 * j + i];
          }
        }
        const float d = reinterpret_cast<const float*>(group + kDOffset)[j * L::lanes_per_block];
        float first, second;
        read_pair(row + row_code_bytes(K, Bits), b, Half, first, second);
        if constexpr (Bits == 6) {  // a scale per half, no min
          total += d * (first * static_cast<float>(dot[0]) + second * static_cast<float>(dot[1]));
        } else {
          const float sum = reinterpret_cast<const float*>(group + kSumOffset)[j * L::lanes_per_block] *
                            L::lanes_per_block;
          total += first * d * static_cast<float>(dot[0] + dot[1]) + second * sum;
        }
      }
      y[m * ldy + n] = total;
    }
}

constexpr const char* kIsa = "";
constexpr int kDecodeRows = 1;

#endif

// Weight rows [n_begin, n_end) against every row of x: NR weight rows at a time (they stay in L1
// while tiles of 4, 2, 1 rows of x pass over them).
template <int Bits, bool Half, int NR>
int64_t row_tiles(const uint8_t* xq, int64_t M, int64_t x_stride, const uint8_t* w, int64_t row_bytes, int64_t K,
                  int64_t groups, float* y, int64_t N, int64_t n, int64_t n_end) {
  // Rows about kPrefetchBytes ahead are asked into the cache while a tile computes: with the
  // hardware prefetchers alone one core read the LM head at about half its DRAM bandwidth.
  const int64_t ahead = std::max<int64_t>(NR, kPrefetchBytes / row_bytes) * row_bytes;
  const uint8_t* end = w + n_end * row_bytes;
  for (; n + NR <= n_end; n += NR) {
    for (const uint8_t* line = w + n * row_bytes + ahead; line < std::min(end, w + (n + NR) * row_bytes + ahead);
         line += 64)
      __builtin_prefetch(line, 0, 3);
    int64_t m = 0;
#if defined(BARYON_INT8_DOT_AVX512)
    for (; m + 8 <= M; m += 8)  // 16 accumulators, 8 weight vectors: 32 registers
      tile<Bits, Half, 8, NR>(xq + m * x_stride, x_stride, w + n * row_bytes, row_bytes, K, groups, y + m * N + n, N);
#endif
    for (; m + 4 <= M; m += 4)
      tile<Bits, Half, 4, NR>(xq + m * x_stride, x_stride, w + n * row_bytes, row_bytes, K, groups, y + m * N + n, N);
    for (; m + 2 <= M; m += 2)
      tile<Bits, Half, 2, NR>(xq + m * x_stride, x_stride, w + n * row_bytes, row_bytes, K, groups, y + m * N + n, N);
    for (; m < M; ++m)
      tile<Bits, Half, 1, NR>(xq + m * x_stride, x_stride, w + n * row_bytes, row_bytes, K, groups, y + m * N + n, N);
  }
  return n;
}

template <int Bits, bool Half>
void linear_rows(const uint8_t* xq, int64_t M, int64_t x_stride, const uint8_t* w, int64_t row_bytes, int64_t K,
                 int64_t groups, float* y, int64_t N, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (M < 4) n = row_tiles<Bits, Half, kDecodeRows>(xq, M, x_stride, w, row_bytes, K, groups, y, N, n, n_end);
  n = row_tiles<Bits, Half, 2>(xq, M, x_stride, w, row_bytes, K, groups, y, N, n, n_end);
  row_tiles<Bits, Half, 1>(xq, M, x_stride, w, row_bytes, K, groups, y, N, n, n_end);
}

// The tiles: MR rows of x times NR weight rows, each lane four bytes of one row's block.
template <int Bits>
at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& packed, int64_t K, bool half) {
  using L = Layout<Bits>;
  const int64_t M = x.size(0), N = packed.size(0), row_bytes = packed.size(1);
  const int64_t groups = (K / kBlock + L::blocks_per_group - 1) / L::blocks_per_group;
  const int64_t x_stride = groups * kGroupBytes;
  // Quantized activations, 64-byte aligned rows (x_stride is a multiple of kGroupBytes).
  // (quantize_row zero-fills each row itself: no value-initialised buffer)
  const std::unique_ptr<uint8_t[]> storage(new uint8_t[M * x_stride + 64]);
  uint8_t* xq = storage.get() + (64 - reinterpret_cast<uintptr_t>(storage.get()) % 64) % 64;
  const float* x_ptr = x.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row<Bits>(x_ptr + m * K, K, xq + m * x_stride, groups);
  });
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  float* y_ptr = y.data_ptr<float>();
  // Enough output rows per task that a task streams at least ~16 KB of weights.
  const int64_t grain = std::max<int64_t>(4, 16384 / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    (half ? linear_rows<Bits, true> : linear_rows<Bits, false>)(xq, M, x_stride, w_ptr, row_bytes, K, groups, y_ptr,
                                                                N, begin, end);
  });
  return y;
}

template <int Bits>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t K, bool half) {
#if defined(BARYON_INT8_DOT_AVX512)
  if constexpr (Bits != 6) {
    return wide_linear<Bits>(x, packed, K, half);
  } else {
    return tiled_linear<Bits>(x, packed, K, half);
  }
#else
  return tiled_linear<Bits>(x, packed, K, half);
#endif
}

at::Tensor block_quant_linear_int8(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t in_features,
                                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "block_quant_linear_int8: bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == in_features,
              "block_quant_linear_int8: x must be float32 [M, ", in_features, "], got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(in_features % kBlock == 0, "block_quant_linear_int8: in_features ", in_features,
              " is not a multiple of ", kBlock);
  const bool half = baryon_cpu::has_half_pairs(packed, in_features, bits, "block_quant_linear_int8");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = bits == 4   ? linear<4>(xc, packed, in_features, half)
                 : bits == 6 ? linear<6>(xc, packed, in_features, half)
                             : linear<8>(xc, packed, in_features, half);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// The instruction set the integer dot products were built for ("": the portable loop).
std::string block_quant_int8_dot_isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(baryon_cpu, m) {
  m.def("block_quant_linear_int8(Tensor x, Tensor packed, int bits, int in_features, Tensor? bias) -> Tensor");
  m.def("block_quant_int8_dot_isa() -> str", &block_quant_int8_dot_isa);
}

TORCH_LIBRARY_IMPL(baryon_cpu, CPU, m) { m.impl("block_quant_linear_int8", &block_quant_linear_int8); }
