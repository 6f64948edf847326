"""FusedMoE: every expert of one MoE layer, stacked, multiplied by one fused kernel.

Checkpoints publish experts one matrix at a time (`experts.{e}.gate_proj.weight`, Mixtral's
`experts.{e}.w1.weight`, ...); the loader maps each onto the stacked parameters and calls
`weight_loader(param, tensor, shard_id, expert_id)` with shard_id "w1" (gate), "w3" (up) or "w2"
(down) and the global expert id. Checkpoints that publish every expert in one tensor (GPT-OSS's
`experts.gate_up_proj`) load with expert_id None and shard_id "w13" or "w2": the tensor's first
dimension is the global expert, each expert's gate rows before its up rows (the model converts
the published layout first, `CheckpointNames`). Each rank of an expert-parallel group owns a contiguous slice
of the experts (the global -> local map is `expert_id - expert_start`); tensors of experts a rank
does not own are skipped at load. Tensor parallelism splits each expert's intermediate size
(gate/up rows, down columns); the partial sums are reduced by the MoE block, once.
"""

from __future__ import annotations

import torch
from torch import nn

from baryon.distributed import parallel_state
from baryon.distributed.parallel_state import divide, moe_tp_rank, moe_tp_world_size
from baryon.kernels.moe.expert_activation import SILU, ExpertActivation
from baryon.quantization.moe_method import MoEMethod, UnquantizedMoEMethod

W13_SHARDS = ("w1", "w3")  # gate rows, then up rows of w13
EXPERT_SHARDS = ("w1", "w2", "w3")
STACKED_SHARDS = ("w13", "w2")  # a tensor of every expert (expert_id None)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 method: MoEMethod | None = None, ep_size: int | None = None, ep_rank: int | None = None,
                 bias: bool = False, activation: ExpertActivation = SILU) -> None:
        """ep_size / ep_rank: this rank's place among the ranks the experts are divided over
        (default: the expert-parallel group's). bias: every expert's projections have biases
        (w13_bias [local experts, 2 * inter], w2_bias [local experts, hidden]: GPT-OSS);
        activation: between gate/up and down (SiLU-and-mul, or GPT-OSS's clamped SwiGLU)."""
        super().__init__()
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate_size = intermediate_size
        self.has_bias, self.activation = bias, activation
        # Tensor parallelism splits each expert's intermediate size, unless expert parallelism
        # divides the experts among the ranks instead.
        self.tp_rank, self.tp_size = moe_tp_rank(), moe_tp_world_size()
        self.intermediate_size_per_rank = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        ep_size = parallel_state.ep_world_size() if ep_size is None else ep_size
        rank = parallel_state.ep_rank() if ep_rank is None else ep_rank
        self.num_local_experts = divide(num_experts, ep_size, "the expert count (expert parallelism)")
        self.expert_start = rank * self.num_local_experts  # global id of local expert 0
        self.method: MoEMethod | None = None
        self.use_method(method or UnquantizedMoEMethod(torch.get_default_device(), torch.get_default_dtype(),
                                                       hidden_size, self.intermediate_size_per_rank, bias,
                                                       activation.kind))

    def use_method(self, method: MoEMethod) -> None:
        """Hold the experts as `method` does (its parameters replace the current ones); called
        before the weights load."""
        if (self.has_bias or self.activation != SILU) and not method.biases_and_activations:
            raise ValueError(f"{type(method).__name__} runs SiLU experts without biases; this layer has "
                             f"{'biases and ' if self.has_bias else ''}the {self.activation.kind} activation")
        for name in [n for n, _ in self.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]:
            delattr(self, name)
        local = range(self.expert_start, self.expert_start + self.num_local_experts)
        params = method.create_weights(self)
        if self.has_bias:  # the same for every method: float, in the model dtype
            params["w13_bias"] = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate_size_per_rank),
                                              requires_grad=False)
            params["w2_bias"] = nn.Parameter(torch.empty(self.num_local_experts, self.hidden_size),
                                             requires_grad=False)
            params["w2_bias"].input_dim = None  # whole on every rank; added by rank 0 only (see weight_loader)
        for name, param in params.items():
            shards = W13_SHARDS if name.startswith("w13_") else ("w2",)
            param.weight_loader = self.weight_loader
            param.expected_shards = frozenset() if getattr(param, "optional", False) else \
                frozenset((shard, e) for shard in shards for e in local)
            self.register_parameter(name, param)
        self.method = method

    def owns(self, expert_id: int) -> bool:
        return self.expert_start <= expert_id < self.expert_start + self.num_local_experts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: int) -> None:
        """Copy one expert's gate ("w1"), up ("w3") or down ("w2") tensor into the stacked
        parameter (this rank's rows or columns of it); other ranks' experts are skipped.

        A method's parameter may say how an expert's tensor lies (as a linear layer's do):
        `output_dim` / `input_dim` (default 0 / 1: [out, in]), or `per_shard` for one value per
        projection (a per-tensor scale: [E, 2] for w13, [E, 1] for w2)."""
        if expert_id is None:
            self._load_stacked(param, loaded, shard_id)
            return
        if shard_id not in EXPERT_SHARDS:
            raise ValueError(f"shard id {shard_id!r} is not one of {list(EXPERT_SHARDS)}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} does not exist: the config has {self.num_experts} experts "
                             f"(ids 0..{self.num_experts - 1})")
        if not self.owns(expert_id):
            return
        target = param.data[expert_id - self.expert_start]
        if getattr(param, "per_shard", False):
            if loaded.numel() != 1:
                raise ValueError(f"shape {tuple(loaded.shape)} is not one value (a per-tensor scale) "
                                 f"(expert {expert_id}, {shard_id})")
            target[1 if shard_id == "w3" else 0] = loaded.reshape(())
            return
        out_dim, in_dim = getattr(param, "output_dim", 0), getattr(param, "input_dim", 1)
        if shard_id in W13_SHARDS and out_dim is not None:  # this rank's part of the gate or the up projection
            half = target.shape[out_dim] // 2
            target = target.narrow(out_dim, 0 if shard_id == "w1" else half, half)
            if self.tp_size > 1 and loaded.dim() > out_dim and loaded.shape[out_dim] == half * self.tp_size:
                loaded = loaded.narrow(out_dim, self.tp_rank * half, half)
        elif shard_id == "w2" and param is getattr(self, "w2_bias", None):
            if self.tp_rank != 0:  # the ranks' partial sums are added up: one of them adds the bias
                loaded = torch.zeros_like(loaded)
        elif shard_id == "w2" and in_dim is not None:  # down: this rank's columns
            inter = target.shape[in_dim]
            if self.tp_size > 1 and loaded.dim() > in_dim and loaded.shape[in_dim] == inter * self.tp_size:
                loaded = loaded.narrow(in_dim, self.tp_rank * inter, inter)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {tuple(target.shape)} "
                             f"(expert {expert_id}, {shard_id})")
        target.copy_(loaded)

    def _load_stacked(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """Every expert's tensor at once ([global experts, ...]): each local expert's slice goes
        through the per-expert loader (w13: its first half of rows is the gate, the second the up)."""
        if shard_id not in STACKED_SHARDS:
            raise ValueError(f"shard id {shard_id!r} of a tensor of every expert is not one of {list(STACKED_SHARDS)}")
        if loaded.shape[0] != self.num_experts:
            raise ValueError(f"shape {tuple(loaded.shape)}: the first dimension should be the {self.num_experts} "
                             f"experts of the config")
        for expert in range(self.expert_start, self.expert_start + self.num_local_experts):
            if shard_id == "w2":
                self.weight_loader(param, loaded[expert], "w2", expert)
                continue
            gate, up = loaded[expert].chunk(2, dim=getattr(param, "output_dim", 0))
            self.weight_loader(param, gate, "w1", expert)
            self.weight_loader(param, up, "w3", expert)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden]; topk_weights / topk_ids: [num_tokens, top_k] from the router.
        Returns this rank's partial sum [num_tokens, hidden] (the block reduces over ranks)."""
        return self.method.apply(self, x, topk_weights, topk_ids)
