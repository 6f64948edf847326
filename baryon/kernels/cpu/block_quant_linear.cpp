// y = x @ W.T (+ bias) with W kept in baryon's block-quantized row format, dequantized in
// registers block by block for decode-sized batches. See baryon/kernels/block_quant.py for the format:
//
//   one row of W (in_features K, K % 32 == 0) is
//     codes      K/2 bytes (bits 4: byte j of a block holds element j in its low nibble and
//                element j + 16 in its high nibble) or K bytes (bits 6 and 8: int8, in order)
//     pairs      K/32 pairs of float32, or of float16 (block_pairs.h): bits 4 and 8, (scale,
//                min); bits 6 (GGUF's Q6_K), the scales of elements 0..15 and of 16..31
//   and element k of a block is  scale * code + min  (bits 6: its half's scale * code).
//
// x: [M, K] float32 contiguous, packed: [N, row_bytes] uint8, bias: [N] float32 or none
// -> y: [M, N] float32. Work is split over output rows (N) with ATen's thread pool; within a task, K is walked in chunks of 768 (8 rows of x stay in L1) and a register
// tile of 8 rows of x times 2 weight rows is accumulated (each dequantized block is used 8 times).
// From 48 rows of x on (prefill), the weight is dequantized to float32 once and BLAS multiplies.
// GCC vector extensions keep the code portable (AVX-512 here, NEON or AVX2 elsewhere).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "block_pairs.h"
#include "vec.h"

namespace {

using namespace baryon_cpu;

constexpr int64_t kBlock = 32;
constexpr int64_t kBlasRows = 48;  // from this many rows of x on, dequantize the weight and call BLAS
constexpr int64_t kChunkBlocks = 24;  // K is walked in chunks of 768 elements: 8 rows of x stay in L1
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

// Bytes of codes per block (nibble pairs or int8).
template <int Bits>
constexpr int64_t kBlockCodeBytes = Bits == 4 ? kBlock / 2 : kBlock;

// 16 bytes -> 16 int32 lanes, zero-extended (unsigned) or sign-extended. Compilers do not turn a
// vector-extension conversion of these widths into one instruction, hence the intrinsics.
inline i32x16 widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<i32x16>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i halves[2] = {_mm256_cvtepu8_epi32(bytes), _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))};
  i32x16 out;
  std::memcpy(&out, halves, sizeof(out));
  return out;
#else
  u8x16 bytes;
  std::memcpy(&bytes, p, 16);
  return __builtin_convertvector(bytes, i32x16);
#endif
}

inline i32x16 widen_i8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<i32x16>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i halves[2] = {_mm256_cvtepi8_epi32(bytes), _mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))};
  i32x16 out;
  std::memcpy(&out, halves, sizeof(out));
  return out;
#else
  i8x16 bytes;
  std::memcpy(&bytes, p, 16);
  return __builtin_convertvector(bytes, i32x16);
#endif
}

inline f32x16 to_float(i32x16 v) { return __builtin_convertvector(v, f32x16); }

// Block b of a packed row -> lo (elements 0..15) and hi (elements 16..31), as float32.
// Half: the row's pairs are float16.
template <int Bits, bool Half>
inline void dequantize_block(const uint8_t* row, int64_t K, int64_t b, f32x16& lo, f32x16& hi) {
  float first, second;
  read_pair(row + row_code_bytes(K, Bits), b, Half, first, second);
  const uint8_t* codes = row + b * kBlockCodeBytes<Bits>;
  if constexpr (Bits == 6) {  // a scale per half, no offset
    lo = to_float(widen_i8(codes)) * first;
    hi = to_float(widen_i8(codes + 16)) * second;
    return;
  }
  const f32x16 scale = broadcast16(first), min = broadcast16(second);
  if constexpr (Bits == 4) {
    const i32x16 wide = widen_u8(codes);
    lo = to_float(wide & 15) * scale + min;
    hi = to_float(wide >> 4) * scale + min;
  } else {
    lo = to_float(widen_i8(codes)) * scale + min;
    hi = to_float(widen_i8(codes + 16)) * scale + min;
  }
}

// The register tile: MR rows of x times NR packed weight rows over blocks [b0, b1); partial sums
// are written to (first chunk) or added into y[m * ldy + n].
template <int Bits, bool Half, int MR, int NR>
inline void tile(const float* x, int64_t K, const uint8_t* rows, int64_t row_bytes, int64_t b0, int64_t b1,
                 float* y, int64_t ldy) {
  f32x16 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = f32x16{};
  for (int64_t b = b0; b < b1; ++b) {
    f32x16 lo[NR], hi[NR];
    for (int n = 0; n < NR; ++n) dequantize_block<Bits, Half>(rows + n * row_bytes, K, b, lo[n], hi[n]);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const f32x16 x_lo = load16(x + m * K + b * kBlock), x_hi = load16(x + m * K + b * kBlock + 16);
      for (int n = 0; n < NR; ++n) {
        acc[m][n] += x_lo * lo[n];
        acc[m][n] += x_hi * hi[n];
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) y[m * ldy + n] = (b0 == 0 ? 0.f : y[m * ldy + n]) + sum16(acc[m][n]);
}

// Every row of x against weight rows [n_begin, n_end): K in chunks, then pairs of weight rows,
// then tiles of 8, 4, 2, 1 rows of x (a chunk of weights is dequantized once per tile of x).
template <int Bits, bool Half, int NR>
void column_tiles(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y,
                  int64_t N, int64_t n, int64_t b0, int64_t b1) {
  int64_t m = 0;
  auto rows_of_x = [&](auto mr_tag) {
    constexpr int MR = decltype(mr_tag)::value;
    for (; m + MR <= M; m += MR)
      tile<Bits, Half, MR, NR>(x + m * K, K, w + n * row_bytes, row_bytes, b0, b1, y + m * N + n, N);
  };
#if defined(__AVX512F__)
  rows_of_x(std::integral_constant<int, 8>{});  // 16 accumulators of one register each
#endif
  rows_of_x(std::integral_constant<int, 4>{});
  rows_of_x(std::integral_constant<int, 2>{});
  rows_of_x(std::integral_constant<int, 1>{});
}

template <int Bits, bool Half>
void linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y,
                 int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock;
  for (int64_t b0 = 0; b0 < blocks; b0 += kChunkBlocks) {
    const int64_t b1 = std::min(blocks, b0 + kChunkBlocks);
    int64_t n = n_begin;
    for (; n + 2 <= n_end; n += 2) column_tiles<Bits, Half, 2>(x, M, K, w, row_bytes, y, N, n, b0, b1);
    for (; n < n_end; ++n) column_tiles<Bits, Half, 1>(x, M, K, w, row_bytes, y, N, n, b0, b1);
  }
}

// The whole weight as float32 [N, K] (prefill-sized batches multiply it with a BLAS GEMM).
template <int Bits, bool Half>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t K, float* out, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int64_t b = 0; b < K / kBlock; ++b) {
      f32x16 lo, hi;
      dequantize_block<Bits, Half>(w + n * row_bytes, K, b, lo, hi);
      std::memcpy(out + n * K + b * kBlock, &lo, sizeof(lo));
      std::memcpy(out + n * K + b * kBlock + 16, &hi, sizeof(hi));
    }
}

at::Tensor block_quant_dequantize(const at::Tensor& packed, int64_t bits, int64_t in_features) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "block_quant_dequantize: bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(in_features % kBlock == 0, "block_quant_dequantize: in_features ", in_features,
              " is not a multiple of ", kBlock);
  const bool half = has_half_pairs(packed, in_features, bits, "block_quant_dequantize");
  const int64_t N = packed.size(0), row_bytes = packed.size(1);
  at::Tensor out = at::empty({N, in_features}, packed.options().dtype(at::kFloat));
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    const auto rows = bits == 4 ? (half ? dequantize_rows<4, true> : dequantize_rows<4, false>)
                      : bits == 6 ? (half ? dequantize_rows<6, true> : dequantize_rows<6, false>)
                                  : (half ? dequantize_rows<8, true> : dequantize_rows<8, false>);
    rows(w_ptr, row_bytes, in_features, out_ptr, begin, end);
  });
  return out;
}

at::Tensor block_quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t bits,
                              int64_t in_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "block_quant_linear: bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == in_features,
              "block_quant_linear: x must be float32 [M, ", in_features, "], got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(in_features % kBlock == 0, "block_quant_linear: in_features ", in_features,
              " is not a multiple of ", kBlock);
  const bool half = has_half_pairs(packed, in_features, bits, "block_quant_linear");
  const int64_t row_bytes = packed.size(1);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), N = packed.size(0), K = in_features;
  if (M >= kBlasRows) {  // enough rows that a BLAS GEMM beats dequantizing in registers per tile
    const at::Tensor weight = block_quant_dequantize(packed, bits, in_features);
    return bias.has_value() && bias->defined() ? at::addmm(*bias, xc, weight.t()) : at::mm(xc, weight.t());
  }
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* x_ptr = xc.data_ptr<float>();
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  float* y_ptr = y.data_ptr<float>();
  // Enough output rows per task that a task streams at least ~16 KB of weights.
  const int64_t grain = std::max<int64_t>(1, 16384 / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    const auto rows = bits == 4 ? (half ? linear_rows<4, true> : linear_rows<4, false>)
                      : bits == 6 ? (half ? linear_rows<6, true> : linear_rows<6, false>)
                                  : (half ? linear_rows<8, true> : linear_rows<8, false>);
    rows(x_ptr, M, K, w_ptr, row_bytes, y_ptr, N, begin, end);
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baryon_cpu, m) {
  m.def("block_quant_linear(Tensor x, Tensor packed, int bits, int in_features, Tensor? bias) -> Tensor");
  m.def("block_quant_dequantize(Tensor packed, int bits, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(baryon_cpu, CPU, m) {
  m.impl("block_quant_linear", &block_quant_linear);
  m.impl("block_quant_dequantize", &block_quant_dequantize);
}
