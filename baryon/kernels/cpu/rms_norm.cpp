// RMSNorm with an optional fused residual add, float32, one pass per token.
//   x: [T, hidden] (rows may be strided), weight: [hidden], residual: [T, hidden] or none
//   -> out = rms_norm(x + residual) * weight, and the new residual x + residual (none without one).
// Matches baryon.kernels.norm.TorchRMSNorm up to float32 summation order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "vec.h"

namespace {

using namespace baryon_cpu;

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "rms_norm: x must be float32 [T, hidden] with contiguous rows, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t T = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == hidden && weight.is_contiguous(),
              "rms_norm: weight must be contiguous float32 [", hidden, "]");
  const bool has_residual = residual.has_value() && residual->defined();
  at::Tensor res;
  if (has_residual) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.sizes() == x.sizes(),
                "rms_norm: residual must be float32 ", x.sizes(), ", got ", res.scalar_type(), " ", res.sizes());
  }
  at::Tensor out = at::empty({T, hidden}, x.options());
  at::Tensor res_out = has_residual ? at::empty({T, hidden}, x.options()) : at::Tensor();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = x.data_ptr<float>() + t * x.stride(0);
      float* o = out.data_ptr<float>() + t * hidden;
      if (has_residual) {  // the sum lands in res_out and is normalised from there
        float* r = res_out.data_ptr<float>() + t * hidden;
        const float* old = res.data_ptr<float>() + t * hidden;
        for (int64_t i = 0; i < hidden; ++i) r[i] = row[i] + old[i];
        row = r;
      }
      const float inv = 1.f / std::sqrt(dot(row, row, hidden) / hidden + static_cast<float>(eps));
      for (int64_t i = 0; i < hidden; ++i) o[i] = w[i] * (row[i] * inv);
    }
  });
  return {out, res_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baryon_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(baryon_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
