// One Llama-family decoder layer on CPU in one call, so a step costs one Python-to-C++ crossing
// per layer instead of ~10 module calls and their dispatch:
//
//   h, residual = rms_norm(hidden (+ residual))            input_layernorm
//   qkv = h @ Wqkv.T (+ b)                                  qkv_proj
//   qkv_prologue: QK norm, rotary, keys/values into the paged cache
//   attn = paged_attention(queries)                         self_attn
//   o = attn @ Wo.T (+ b)                                   o_proj
//   h, residual = rms_norm(o + residual)                    post_attention_layernorm
//   out = (silu(h @ Wgate.T) * (h @ Wup.T)) @ Wdown.T       mlp
//
// The steps are the very kernels the op-by-op path runs (called through the dispatcher, a
// fraction of a microsecond each), so the result is bit-identical to it. Each linear's weight is
// baryon's packed block-quantized rows (bits 4, 6 or 8, multiplied by the integer-dot kernel when
// `integer_dots`, else by the exact float32 one) or a dense float32 matrix (bits 0, at::linear).
// hidden / residual: [T, hidden] float32; returns (the MLP's output, the residual stream), as
// LlamaDecoderLayer.forward does.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

using OptTensor = std::optional<at::Tensor>;

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, int64_t bits, const OptTensor& bias,
                  bool integer_dots) {
  if (bits == 0) return at::linear(x, weight, bias);
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const OptTensor&);
  static const auto int8 = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("baryon_cpu::block_quant_linear_int8", "")
                               .typed<Signature>();
  static const auto exact =
      c10::Dispatcher::singleton().findSchemaOrThrow("baryon_cpu::block_quant_linear", "").typed<Signature>();
  return (integer_dots ? int8 : exact).call(x, weight, bits, x.size(1), bias);
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const OptTensor& residual) {
  using Signature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double, const OptTensor&);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("baryon_cpu::rms_norm", "").typed<Signature>();
  return op.call(x, weight, eps, residual);
}

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& hidden, const OptTensor& residual, const at::Tensor& input_norm_weight,
    const at::Tensor& post_norm_weight, double eps, const at::Tensor& qkv_weight, int64_t qkv_bits,
    const OptTensor& qkv_bias, const at::Tensor& o_weight, int64_t o_bits, const OptTensor& o_bias,
    const at::Tensor& gate_up_weight, int64_t gate_up_bits, const at::Tensor& down_weight, int64_t down_bits,
    bool integer_dots, const at::Tensor& positions, const at::Tensor& cos_sin_cache, const OptTensor& q_norm_weight,
    const OptTensor& k_norm_weight, double qk_norm_eps, const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale, int64_t window) {
  using Prologue = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                        double, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, const OptTensor&,
                        const OptTensor&);
  using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double, int64_t, double, const OptTensor&, const OptTensor&);
  static const auto prologue =
      c10::Dispatcher::singleton().findSchemaOrThrow("baryon_cpu::qkv_prologue", "").typed<Prologue>();
  static const auto attention =
      c10::Dispatcher::singleton().findSchemaOrThrow("baryon_cpu::paged_attention", "").typed<Attention>();
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2,
              "decoder_layer: hidden must be float32 [T, hidden], got ", hidden.scalar_type(), " ", hidden.sizes());
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf,
              "decoder_layer: the KV cache must be float32 or float16 (an fp8 cache takes the module path)");
  const int64_t T = hidden.size(0);

  at::Tensor h, res;
  if (residual.has_value() && residual->defined()) {
    std::tie(h, res) = rms_norm(hidden, input_norm_weight, eps, residual);
  } else {
    h = std::get<0>(rms_norm(hidden, input_norm_weight, eps, std::nullopt));
    res = hidden;
  }
  const at::Tensor qkv = linear(h, qkv_weight, qkv_bits, qkv_bias, integer_dots);  // [T, (H + 2 Hkv) D]
  prologue.call(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, qk_norm_eps, kv_cache, slot_mapping,
                num_heads, num_kv_heads, head_dim, std::nullopt, std::nullopt);
  const at::Tensor query = qkv.slice(1, 0, num_heads * head_dim).view({T, num_heads, head_dim});
  const at::Tensor attn = attention.call(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, window,
                                         /*softcap=*/0.0, std::nullopt, std::nullopt)
                              .reshape({T, num_heads * head_dim});
  const at::Tensor o = linear(attn, o_weight, o_bits, o_bias, integer_dots);
  std::tie(h, res) = rms_norm(o, post_norm_weight, eps, res);
  const at::Tensor gate_up = linear(h, gate_up_weight, gate_up_bits, std::nullopt, integer_dots);  // [T, 2 I]
  const int64_t inter = gate_up.size(1) / 2;
  const at::Tensor act = at::mul(at::silu(gate_up.slice(1, 0, inter)), gate_up.slice(1, inter));
  return {linear(act, down_weight, down_bits, std::nullopt, integer_dots), res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baryon_cpu, m) {
  m.def(
      "decoder_layer(Tensor hidden, Tensor? residual, Tensor input_norm_weight, Tensor post_norm_weight, float eps, "
      "Tensor qkv_weight, int qkv_bits, Tensor? qkv_bias, Tensor o_weight, int o_bits, Tensor? o_bias, "
      "Tensor gate_up_weight, int gate_up_bits, Tensor down_weight, int down_bits, bool integer_dots, "
      "Tensor positions, Tensor cos_sin_cache, Tensor? q_norm_weight, Tensor? k_norm_weight, float qk_norm_eps, "
      "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "int num_heads, int num_kv_heads, int head_dim, float scale, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(baryon_cpu, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
