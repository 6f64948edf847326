"""Experts of weight-only integer checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized):
loaded in their published per-expert layout (the `WNA16LinearMethod` layouts with a leading expert
dimension) and dequantized once after loading into float experts in the model dtype, which the
unquantized `fused_moe` kernel runs.

A stopgap with an honest cost: the experts take float memory (4x a bf16 model's 4-bit experts),
so such checkpoints load and run correctly but without the memory or bandwidth saving; a fused
MoE kernel that dequantizes in registers is the next step.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from baryon.logger import get_logger
from baryon.quantization.moe_method import MoEMethod, UnquantizedMoEMethod
from baryon.quantization.wna16 import WNA16LinearMethod

logger = get_logger(__name__)


def dequantize_canonical(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                         g_idx: torch.Tensor | None) -> torch.Tensor:
    """(codes [N, K], scales / zeros [N, G], g_idx [K] or None) -> float32 [N, K]."""
    k = codes.shape[1]
    group = g_idx.long() if g_idx is not None else torch.arange(k, device=codes.device) // group_size
    return (codes.float() - zeros.float()[:, group]) * scales.float()[:, group]


class WNA16DequantizedMoEMethod(MoEMethod):
    def __init__(self, linear: WNA16LinearMethod) -> None:
        self.linear = linear  # says the layout of one expert's projection

    def _projection_params(self, n: int, k: int) -> dict[str, nn.Parameter]:
        """One projection's checkpoint parameters, as a linear layer of [n, k] would create them."""
        holder = SimpleNamespace(output_size=n, input_size=k, params={})

        def add_param(name, shape, dtype=None, output_dim=0, input_dim=1, output_block=1, per_shard=False):
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.output_dim, param.input_dim = output_dim, input_dim
            holder.params[name] = param
            return param

        holder.add_param = add_param
        holder.weight_loader = None
        self.linear.create_weights(holder)
        return holder.params

    def create_weights(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        self.float_method = UnquantizedMoEMethod(torch.get_default_device(), torch.get_default_dtype(),
                                                 layer.hidden_size, layer.intermediate_size_per_rank)
        experts, hidden, inter = layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_rank
        params = {}
        for prefix, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
            for name, single in self._projection_params(n, k).items():
                stacked = nn.Parameter(torch.empty(experts, *single.shape, dtype=single.dtype), requires_grad=False)
                stacked.output_dim, stacked.input_dim = single.output_dim, single.input_dim
                stacked.optional = getattr(single, "expected_shards", None) == frozenset()
                params[f"{prefix}_{name}"] = stacked
        return params

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        experts, hidden, inter = layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_rank
        dtype = torch.get_default_dtype()
        stacks = {}
        for prefix, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
            names = [p[len(prefix) + 1:] for p, _ in layer.named_parameters(recurse=False)
                     if p.startswith(prefix + "_")]
            dense = torch.empty(experts, n, k, dtype=dtype)
            for e in range(experts):
                one = SimpleNamespace(output_size=n, input_size=k,
                                      **{name: getattr(layer, f"{prefix}_{name}")[e] for name in names})
                codes, scales, zeros, g_idx = self.linear.canonical(one)
                if g_idx is not None and not self.linear.act_order:
                    g_idx = None
                dense[e] = dequantize_canonical(codes, scales, zeros, self.linear.group_size or k, g_idx).to(dtype)
            stacks[prefix] = dense
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]:
            delattr(layer, name)
        layer.w13_weight = nn.Parameter(stacks["w13"], requires_grad=False)
        layer.w2_weight = nn.Parameter(stacks["w2"], requires_grad=False)
        logger.warning("%s experts are held dequantized in %s (no weight-only MoE kernel yet)",
                       self.linear.layout, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return self.float_method.apply(layer, x, topk_weights, topk_ids)

    def dequantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.w13_weight.float(), layer.w2_weight.float()
