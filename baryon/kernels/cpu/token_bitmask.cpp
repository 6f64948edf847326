// A grammar's allowed-token bitmask applied to logits in place (constrained decoding).
//   logits: [B, V] float32 (contiguous columns), bitmask: [R, W] int32 (xgrammar's layout: bit j of
//   word w allows token 32 * w + j), rows: [R] int64 (the logits row of each bitmask row)
//   -> logits[rows[r], t] = -inf where bitmask row r does not allow t (every t >= 32 * W).
// Matches baryon.kernels.token_bitmask.TorchTokenBitmask; a row named twice is masked by both.
// Reads one word per 32 tokens and writes only the disallowed logits (an all-ones word is skipped).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

namespace {

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be float32 [B, V] with contiguous rows, got ", logits.scalar_type(),
              " ", logits.sizes());
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be contiguous int32 [R, W], got ", bitmask.scalar_type(), " ",
              bitmask.sizes());
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.numel() == bitmask.size(0),
              "apply_token_bitmask: rows must be int64 [", bitmask.size(0), "]");
  const at::Tensor row_ids = rows.contiguous();
  const int64_t num_rows = bitmask.size(0), num_words = bitmask.size(1), vocab = logits.size(1);
  const int64_t covered = std::min<int64_t>(num_words, (vocab + 31) / 32);
  const float blocked = -std::numeric_limits<float>::infinity();
  const int64_t* targets = row_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(targets[r] >= 0 && targets[r] < logits.size(0), "apply_token_bitmask: row ", targets[r],
                " is outside the logits' ", logits.size(0), " rows");
  }
  // Rows in parallel: a logits row named twice may be written by two threads, but only ever with
  // the same value (-inf), so the result is the union of what both rows disallow.
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* out = logits.data_ptr<float>() + targets[r] * logits.stride(0);
      const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + r * num_words;
      for (int64_t w = 0; w < covered; ++w) {
        uint32_t disallowed = ~words[w];
        if (disallowed == 0) continue;
        const int64_t base = w * 32;
        while (disallowed) {
          const int64_t token = base + __builtin_ctz(disallowed);
          if (token >= vocab) break;
          out[token] = blocked;
          disallowed &= disallowed - 1;
        }
      }
      for (int64_t t = covered * 32; t < vocab; ++t) out[t] = blocked;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baryon_cpu, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(baryon_cpu, CPU, m) {
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
