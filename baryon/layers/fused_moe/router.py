"""The router ("gate"): router logits = x @ weight.T (+ bias), then each token's top-k experts and their
weights (the `moe_routing` kernel). Its module names follow the checkpoints: `gate.weight` and,
for DeepSeek-V3 / GLM-4.5, `gate.e_score_correction_bias`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baryon.kernels.moe.routing import RoutingConfig
from baryon.kernels.selector import select
from baryon.layers.linear import ReplicatedLinear, copy_checked


class Router(ReplicatedLinear):
    quantizable = False
    def __init__(self, hidden_size: int, routing: RoutingConfig, correction_bias: bool = False,
                 float32_logits: bool = False, bias: bool = False) -> None:
        """float32_logits: compute the logits in float32 (DeepSeek-V3 and GLM-4.5 routers do; the
        weight is then kept in float32), else in the model dtype (softmax is float32 either way).
        bias: the logits have a bias (GPT-OSS's `router.bias`)."""
        super().__init__(hidden_size, routing.num_experts, bias=bias)
        self.routing = routing
        self.float32_logits = float32_logits
        if float32_logits:
            self.weight.data = self.weight.data.float()
        if correction_bias:  # [num_experts] float32, added to the scores for the choice only
            self.e_score_correction_bias = nn.Parameter(torch.zeros(routing.num_experts, dtype=torch.float32),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = lambda param, loaded, shard_id=None: \
                copy_checked(param.data, loaded)
            self.e_score_correction_bias.expected_shards = frozenset([None])
        else:
            self.e_score_correction_bias = None
        self.kernel = select("moe_routing", torch.get_default_device(), num_experts=routing.num_experts,
                             top_k=routing.top_k)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] -> (weights [num_tokens, top_k] float32, expert ids int32)."""
        if not self.float32_logits:  # the layer's own method (its decode GEMV included)
            logits = self.method.apply(self, x, self.bias)  # [num_tokens, num_experts]
        elif (gemv := self.method.gemv_for(self, x)) is not None:  # a decode batch of one row
            logits = gemv.forward(x, self.weight, self.bias, out_dtype=torch.float32)
        else:
            logits = F.linear(x.float(), self.weight, None if self.bias is None else self.bias.float())
        return self.kernel.forward(logits, self.routing, self.e_score_correction_bias)
