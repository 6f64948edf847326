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
from baryon.quantization.base import DENSE, LinearMethod, checkpoint_param


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy `loaded` into `target`, refusing a shape mismatch (the loader adds tensor and file)."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {tuple(target.shape)}")
    target.copy_(loaded)


class LinearBase(nn.Module):
    """y = x @ weight.T + bias with weight [output_size, input_size] (this rank's part), stored
    and multiplied as `self.method` says (dense floats unless a quantization scheme swaps it).

    Subclasses say where each fused part lives (`shard_span`) and which ranks split the input
    (`_input_slice`); one loader then serves every parameter a method creates."""

    shard_order: tuple = (None,)  # the fused parts, in output order
    quantizable = True  # routers say False: checkpoints keep them in float
    input_split_over_ranks = False  # row-parallel layers hold only their ranks' input columns

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.method: LinearMethod = DENSE
        DENSE.create_weights(self)
        self.bias = self.add_param("bias", (output_size,), input_dim=None) if bias else None

    @property
    def shard_ids(self) -> frozenset:
        return frozenset(self.shard_order)

    @property
    def shard_sizes(self) -> list[int]:
        """This rank's output features of each fused part, in `shard_order`."""
        return [self.shard_span(shard)[1] for shard in self.shard_order]

    def add_param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None,
                  **layout) -> nn.Parameter:
        """Register a checkpoint-loaded parameter (see `checkpoint_param` for `layout`)."""
        param = checkpoint_param(shape, dtype, **layout)
        param.weight_loader = self.weight_loader
        param.expected_shards = self.shard_ids
        setattr(self, name, param)
        return param

    def use_method(self, method: LinearMethod) -> None:
        """Store and multiply the weight as `method` does; called before the weights load."""
        del self.weight
        method.create_weights(self)
        self.method = method

    def shard_span(self, shard_id) -> tuple[int, int, int, int]:
        """Where fused part `shard_id` goes: (offset of its rows in this rank's output, its row
        count here, which slice of the checkpoint tensor this rank takes, into how many slices
        the checkpoint tensor's rows are cut)."""
        return 0, self.output_size, 0, 1

    def _input_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard id {shard_id!r} is not one of {list(self.shard_order)}")
        if param.per_shard:
            if loaded.numel() != 1:
                raise ValueError(f"shape {tuple(loaded.shape)} is not one value (a per-tensor scale)")
            param.data[self.shard_order.index(shard_id)] = loaded.reshape(())
            return
        loaded = self._input_slice(param, loaded)
        dim = param.output_dim
        if dim is None:  # the same for every part (act-order g_idx): each part's copy must fit
            copy_checked(param.data, loaded)
            return
        offset, size, rank, slices = self.shard_span(shard_id)
        block = param.output_block
        whole = len(self.shard_order) == 1 and slices == 1
        if not whole and (offset % block or size % block):
            raise ValueError(f"a fused part of {size} rows at row {offset} does not align with "
                             f"{block}-row blocks of this tensor")
        entries = -(-size // block)
        target = param.data.narrow(dim, offset // block, entries)
        if loaded.dim() > dim and loaded.shape[dim] == entries * slices:
            loaded = loaded.narrow(dim, rank * entries, entries)
        copy_checked(target, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class MergedReplicatedLinear(ReplicatedLinear):
    """Several outputs fused into one weight held whole by every rank (a vision tower's gate_proj |
    up_proj: the checkpoint's packed names apply to it as to the decoder's)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        self.output_sizes = output_sizes
        self.shard_order = tuple(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias)

    def shard_span(self, shard_id) -> tuple[int, int, int, int]:
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id], 0, 1


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays split (no gather)."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        super().__init__(input_size, divide(output_size, self.tp_size, "output_size"), bias)

    def shard_span(self, shard_id) -> tuple[int, int, int, int]:
        return 0, self.output_size, self.tp_rank, self.tp_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one weight (gate_proj | up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        self.output_sizes = output_sizes
        self.shard_order = tuple(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias)

    def shard_span(self, shard_id) -> tuple[int, int, int, int]:
        size = divide(self.output_sizes[shard_id], self.tp_size, "merged output size")
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size, "merged output offset")
        return offset, size, self.tp_rank, self.tp_size


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections fused; heads split across ranks.

    With more ranks than KV heads each KV head is replicated on tp_size / total_num_kv_heads ranks.
    """

    shard_order = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool) -> None:
        tp_size = tp_world_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.kv_replicas = 1, divide(tp_size, total_num_kv_heads, "tp size")
        else:
            self.num_kv_heads, self.kv_replicas = divide(total_num_kv_heads, tp_size, "num_key_value_heads"), 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size, bias)

    def shard_span(self, shard_id) -> tuple[int, int, int, int]:
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank, self.tp_size
        offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
        return offset, self.kv_size, self.tp_rank // self.kv_replicas, self.tp_size // self.kv_replicas


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed over the ranks (or left to
    the caller to sum with other partial results, when reduce_results is False)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, reduce_results: bool = True) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        self.input_split_over_ranks = self.tp_size > 1
        self.reduce_results = reduce_results
        # True (set by the model where the next norm's all-reduce takes this layer's output as it
        # is, unchanged in between): a one-row output may go to the peers from the GEMV's
        # epilogue (symm_mem_pushed).
        self.pushes_partial = False
        super().__init__(divide(input_size, self.tp_size, "input_size"), output_size, bias)

    def _input_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's columns (input features) of a checkpoint tensor; the bias is whole."""
        dim = param.input_dim
        if dim is not None and loaded.dim() > dim and loaded.shape[dim] == param.shape[dim] * self.tp_size:
            loaded = loaded.narrow(dim, self.tp_rank * param.shape[dim], param.shape[dim])
        return loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, on rank 0, before the sum.
        bias = self.bias if self.tp_rank == 0 else None
        partial = self.method.apply(self, x, bias)
        return tp_all_reduce(partial) if self.reduce_results else partial


