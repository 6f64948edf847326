// The pairs at the end of a packed block-quantized row (baryon/kernels/block_quant.py): one pair
// per 32-element block after the row's codes, float32 (8 bytes a pair) or float16 (4 bytes, for
// GGUF types whose scales and offsets are float16 values: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). Which
// one a tensor holds follows from its row length.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace baryon_cpu {

constexpr int64_t kPairBlock = 32;

// Bytes of one row's codes: K / 2 nibble pairs (bits 4) or K int8 codes (bits 6 and 8).
inline int64_t row_code_bytes(int64_t K, int64_t bits) { return bits == 4 ? K / 2 : K; }

// Whether packed rows [N, row_bytes] of K elements hold float16 pairs (else float32); anything
// else is an error naming both accepted widths.
inline bool has_half_pairs(const at::Tensor& packed, int64_t K, int64_t bits, const char* op) {
  const int64_t codes = row_code_bytes(K, bits), blocks = K / kPairBlock;
  const int64_t full = codes + blocks * 8, half = codes + blocks * 4;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  (packed.size(1) == full || packed.size(1) == half),
              op, ": packed must be contiguous uint8 [N, ", full, "] (float32 pairs) or [N, ", half,
              "] (float16 pairs), got ", packed.scalar_type(), " ", packed.sizes());
  return packed.size(1) == half;
}

// The pair of block b of a row whose pairs start at `pairs`.
inline void read_pair(const uint8_t* pairs, int64_t b, bool half, float& first, float& second) {
  if (half) {
    uint16_t bits[2];
    std::memcpy(bits, pairs + 4 * b, 4);
#if defined(__F16C__)
    first = _cvtsh_ss(bits[0]);  // one instruction each, where c10::Half converts bit by bit
    second = _cvtsh_ss(bits[1]);
#else
    first = static_cast<float>(c10::Half(bits[0], c10::Half::from_bits()));
    second = static_cast<float>(c10::Half(bits[1], c10::Half::from_bits()));
#endif
    return;
  }
  float values[2];
  std::memcpy(values, pairs + 8 * b, 8);
  first = values[0];
  second = values[1];
}

}  // namespace baryon_cpu
