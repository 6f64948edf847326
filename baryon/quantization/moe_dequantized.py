"""Experts in a layout no fused MoE kernel here reads (INT8 W8A8, 8-bit or act-order weight-only
experts, and every weight-only layout on CPU; 4-bit GPTQ / AWQ / pack-quantized experts on a GPU
stay packed instead, `moe_int4.py`): loaded in their published per-expert layout (the linear
method's parameters with a leading expert dimension), then each expert's projection is repacked
and dequantized by that linear method once, into float experts in the model dtype, which the
unquantized `fused_moe` kernel runs: correct, at float memory (4x a bf16 model's 4-bit experts).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from torch import nn

from baryon.logger import get_logger
from baryon.quantization.base import LinearMethod
from baryon.quantization.moe_method import MoEMethod, UnquantizedMoEMethod

logger = get_logger(__name__)


class DequantizedMoEMethod(MoEMethod):
    holds_dequantized = True  # float experts, not the checkpoint's bytes

    def __init__(self, linear: LinearMethod, name: str) -> None:
        self.linear = linear  # says the layout of one expert's projection, and dequantizes it
        self.name = name  # the scheme, for the log
        # "w13" / "w2" -> a copy of `linear` of its own: a linear method keeps what it chose for
        # one layer's shape (its kernel), and the two projections have different shapes.
        self.projection_methods: dict[str, LinearMethod] = {}

    def _projection_params(self, prefix: str, n: int, k: int) -> dict[str, nn.Parameter]:
        """One projection's checkpoint parameters, as a linear layer of [n, k] would create them."""
        holder = SimpleNamespace(output_size=n, input_size=k, params={})

        def add_param(name, shape, dtype=None, output_dim=0, input_dim=1, output_block=1, per_shard=False):
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.output_dim, param.input_dim = output_dim, input_dim
            holder.params[name] = param
            return param

        holder.add_param = add_param
        holder.weight_loader = None
        self.projection_methods[prefix] = copy.copy(self.linear)
        self.projection_methods[prefix].create_weights(holder)
        return holder.params

    def create_weights(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        if getattr(self.linear, "act_order", False) and layer.tp_size > 1:
            # Each rank would hold a share of every group's columns of the down projection.
            raise ValueError(f"{self.name} experts with act order (GPTQ desc_act=True, compressed-tensors actorder "
                             f"'group') cannot split their "
                             f"intermediate size over {layer.tp_size} tensor-parallel ranks; use "
                             f"enable_expert_parallel=True (whole experts on each rank) or tensor_parallel_size=1")
        self.float_method = UnquantizedMoEMethod(torch.get_default_device(), torch.get_default_dtype(),
                                                 layer.hidden_size, layer.intermediate_size_per_rank)
        experts, hidden, inter = layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_rank
        params = {}
        for prefix, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
            for name, single in self._projection_params(prefix, n, k).items():
                stacked = nn.Parameter(torch.empty(experts, *single.shape, dtype=single.dtype), requires_grad=False)
                stacked.output_dim, stacked.input_dim = single.output_dim, single.input_dim
                stacked.optional = getattr(single, "expected_shards", None) == frozenset()
                params[f"{prefix}_{name}"] = stacked
        return params

    @staticmethod
    def expert_projections(layer: nn.Module):
        """("w13" / "w2", [one holder per expert]): each expert's projection as a linear layer
        holding its loaded checkpoint tensors (output_size, input_size and the tensors by name)."""
        hidden, inter = layer.hidden_size, layer.intermediate_size_per_rank
        for prefix, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
            names = [p[len(prefix) + 1:] for p, _ in layer.named_parameters(recurse=False)
                     if p.startswith(prefix + "_")]
            yield prefix, [SimpleNamespace(output_size=n, input_size=k, _parameters={},
                                           **{name: getattr(layer, f"{prefix}_{name}")[e] for name in names})
                           for e in range(layer.num_local_experts)]

    @staticmethod
    def drop_checkpoint_tensors(layer: nn.Module) -> None:
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]:
            delattr(layer, name)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = torch.get_default_dtype()
        stacks = {}
        for prefix, experts in self.expert_projections(layer):
            dense = torch.empty(len(experts), experts[0].output_size, experts[0].input_size, dtype=dtype)  # [E, n, k]
            method = self.projection_methods[prefix]
            for e, one in enumerate(experts):  # filled in place: no second copy of the float experts
                method.process_weights_after_loading(one)
                dense[e] = method.dequantize(one).to(dtype)
            stacks[prefix] = dense
        self.drop_checkpoint_tensors(layer)
        layer.w13_weight = nn.Parameter(stacks["w13"], requires_grad=False)
        layer.w2_weight = nn.Parameter(stacks["w2"], requires_grad=False)
        logger.warning("%s experts are held dequantized in %s (no fused MoE kernel reads that layout yet)",
                       self.name, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return self.float_method.apply(layer, x, topk_weights, topk_ids)

    def dequantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.w13_weight.float(), layer.w2_weight.float()
