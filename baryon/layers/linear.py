"""Linear layers written for tensor parallelism.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies this
rank's shard of a checkpoint tensor into it, and `expected_shards`, the shard ids the loader must
see before the parameter is complete (q/k/v for a fused QKV, 0/1 for gate/up, None otherwise).
Column-parallel layers split the output features across ranks; row-parallel layers split the
input features and sum the partial results over the ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from baryon.distributed.parallel_state import divide, tp_all_reduce, tp_rank, tp_world_size
from baryon.quantization.base import DENSE, LinearMethod


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy `loaded` into `target`, refusing a shape mismatch (the loader adds tensor and file)."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {tuple(target.shape)}")
    target.copy_(loaded)


def _make_param(shape: tuple[int, ...], loader, expected_shards: frozenset) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader
    param.expected_shards = expected_shards
    return param


class LinearBase(nn.Module):
    """y = x @ weight.T + bias with weight [output_size, input_size] (this rank's part), stored
    and multiplied as `self.method` says (dense floats unless a quantization scheme swaps it)."""

    shard_ids: frozenset = frozenset([None])

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _make_param((output_size, input_size), self.weight_loader, self.shard_ids)
        self.bias = _make_param((output_size,), self.weight_loader, self.shard_ids) if bias else None
        self.method: LinearMethod = DENSE

    def use_method(self, method: LinearMethod) -> None:
        """Store and multiply the weight as `method` does; called before the weights load."""
        self.weight = method.create_weights(self, self.weight)
        self.method = method

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self.weight, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays split (no gather)."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        super().__init__(input_size, divide(output_size, self.tp_size, "output_size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        copy_checked(param.data, _narrow_rows(loaded, self.tp_rank * size, size, size * self.tp_size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one weight (gate_proj | up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        self.output_sizes = output_sizes
        self.shard_ids = frozenset(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard id {shard_id!r} is not one of {sorted(self.shard_ids)}")
        size = divide(self.output_sizes[shard_id], self.tp_size, "merged output size")
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size, "merged output offset")
        copy_checked(param.data.narrow(0, offset, size),
                     _narrow_rows(loaded, self.tp_rank * size, size, size * self.tp_size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections fused; heads split across ranks.

    With more ranks than KV heads each KV head is replicated on tp_size / total_num_kv_heads ranks.
    """

    shard_ids = frozenset(["q", "k", "v"])

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool) -> None:
        tp_size = tp_world_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.kv_replicas = 1, divide(tp_size, total_num_kv_heads, "tp size")
        else:
            self.num_kv_heads, self.kv_replicas = divide(total_num_kv_heads, tp_size, "num_key_value_heads"), 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"shard id {shard_id!r} is not one of 'q', 'k', 'v'")
        total = size * (self.tp_size if shard_id == "q" else self.tp_size // self.kv_replicas)
        copy_checked(param.data.narrow(0, offset, size), _narrow_rows(loaded, rank * size, size, total))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed over the ranks (or left to
    the caller to sum with other partial results, when reduce_results is False)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, reduce_results: bool = True) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        self.reduce_results = reduce_results
        super().__init__(divide(input_size, self.tp_size, "input_size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 2:
            size = param.shape[1]
            if loaded.dim() == 2 and loaded.shape[1] == size * self.tp_size:
                loaded = loaded.narrow(1, self.tp_rank * size, size)
        copy_checked(param.data, loaded)  # the bias is whole on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, on rank 0, before the sum.
        bias = self.bias if self.tp_rank == 0 else None
        partial = self.method.apply(self.weight, x, bias)
        return tp_all_reduce(partial) if self.reduce_results else partial


def _narrow_rows(loaded: torch.Tensor, start: int, size: int, full: int) -> torch.Tensor:
    """Rows start:start+size of a checkpoint tensor that should hold `full` rows; a tensor of
    another row count is returned whole, for the shape check to report."""
    if loaded.shape[0] != full:
        return loaded
    return loaded.narrow(0, start, size)
