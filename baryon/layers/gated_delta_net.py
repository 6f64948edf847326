"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5.

Per token: one projection gives queries and keys (Hk heads of Dk), values and the output gate z
(Hv heads of Dv), and the delta rule's gate inputs b and a (Hv each); queries | keys | values go
through a short causal depthwise convolution (SiLU), then the gated delta rule
(kernels/linear_attention.py) mixes them with the sequence's recurrent state; a gated RMSNorm
(each head normalised, times the weight, times silu(z): the same file) and the output projection
end the block.

Each sequence keeps two states per layer, in the slot the scheduler gave its request
(engine/state_slots.py; `AttentionMetadata.recurrent`): the convolution's last K - 1 inputs
[slots, K - 1, C] and the delta rule's [slots, Hv, Dk, Dv] float32 matrices. The runner allocates
them (`state_shapes`, `bind_states`) before it sizes the KV cache. With speculative decoding each
slot also has two pending blocks of P = k + 1 tokens (a verification's convolution inputs and
outputs and its b | a, until the next step commits the accepted ones: metadata.DraftRows).

Tensor parallelism splits the key heads (and with them their value heads) across ranks: every
projection's segment, the convolution's channels of each segment, A_log and dt_bias take this
rank's heads; the output projection is row-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from baryon.distributed.parallel_state import divide, tp_rank, tp_world_size
from baryon.kernels.attention.metadata import RecurrentMetadata
from baryon.kernels.selector import select
from baryon.layers.forward_context import current_attn_metadata
from baryon.layers.linear import MergedColumnParallelLinear, RowParallelLinear, copy_checked


class RecurrentStateLayer(nn.Module):
    """A layer that keeps a fixed-size state per sequence in state slots: the runner allocates
    `state_shapes()` for every slot (`bind_states`) and reads `cuda_graph_safe`."""

    states: list[torch.Tensor] | None = None

    def state_shapes(self, pending_tokens: int = 0) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One slot's states: (shape, dtype) of each; pending_tokens: a verification's most tokens
        (speculative decoding; 0: none)."""
        raise NotImplementedError

    def bind_states(self, num_slots: int | None, device: torch.device, pending_tokens: int = 0) -> None:
        """Allocate every slot's states (zeros); None: take them away."""
        self.states = None if num_slots is None else [
            torch.zeros((num_slots, *shape), dtype=dtype, device=device)
            for shape, dtype in self.state_shapes(pending_tokens)]

    @property
    def cuda_graph_safe(self) -> bool:
        raise NotImplementedError


class GatedDeltaNet(RecurrentStateLayer):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float) -> None:
        super().__init__()
        tp = tp_world_size()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        self.num_k_heads = divide(num_k_heads, tp, "linear_num_key_heads")  # this rank's
        self.num_v_heads = divide(num_v_heads, tp, "linear_num_value_heads")
        self.head_k_dim, self.head_v_dim, self.eps = head_k_dim, head_v_dim, eps
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.key_dim, self.value_dim = key_dim // tp, value_dim // tp  # this rank's widths
        self.conv_dim = 2 * self.key_dim + self.value_dim  # q | k | v channels of this rank
        self.conv_kernel = conv_kernel
        # Shard ids 0..3: q, k, v, z; 0, 1: b, a.
        self.in_proj_qkvz = MergedColumnParallelLinear(hidden_size, [key_dim, key_dim, value_dim, value_dim],
                                                       bias=False)
        self.in_proj_ba = MergedColumnParallelLinear(hidden_size, [num_v_heads, num_v_heads], bias=False)
        # [C, K]: the depthwise kernel of each channel (the checkpoint's Conv1d weight [C, 1, K]).
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel), requires_grad=False)
        self.conv_weight.weight_loader = self._load_conv_weight
        self.conv_weight.expected_shards = frozenset([None])
        self.A_log = self._head_parameter()  # [Hv] float32: the state's decay rate (log)
        self.dt_bias = self._head_parameter()  # [Hv] float32: added to a before the softplus
        self.norm_weight = nn.Parameter(torch.ones(head_v_dim), requires_grad=False)  # [Dv]
        self.norm_weight.weight_loader = lambda param, loaded, shard_id=None: copy_checked(param.data, loaded)
        self.norm_weight.expected_shards = frozenset([None])
        self.out_proj = RowParallelLinear(value_dim, hidden_size, bias=False)
        device = torch.get_default_device()
        self.conv = select("causal_conv1d", device)
        self.rule = select("gated_delta_rule", device, head_k_dim=head_k_dim)
        self.gated_norm = select("gated_rms_norm", device)

    def _head_parameter(self) -> nn.Parameter:
        """[Hv] float32 of this rank's value heads, loaded from the checkpoint's [Hv_total]."""
        param = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        param.weight_loader = lambda param, loaded, shard_id=None: copy_checked(
            param.data, loaded.float().chunk(tp_world_size())[tp_rank()])
        param.expected_shards = frozenset([None])
        return param

    def _load_conv_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """loaded: [2 key_dim + value_dim, 1, K] for every rank: this rank's channels of q, k, v."""
        tp, rank = tp_world_size(), tp_rank()
        kernel = loaded.reshape(loaded.shape[0], -1)  # [C_total, K]
        key_dim, value_dim = self.key_dim * tp, self.value_dim * tp
        if kernel.shape != (2 * key_dim + value_dim, self.conv_kernel):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected "
                             f"({2 * key_dim + value_dim}, 1, {self.conv_kernel})")
        q, k, v = kernel.split([key_dim, key_dim, value_dim])
        parts = [part.chunk(tp)[rank] for part in (q, k, v)]
        copy_checked(param.data, torch.cat(parts))

    def state_shapes(self, pending_tokens: int = 0) -> list[tuple[tuple[int, ...], torch.dtype]]:
        dtype = self.conv_weight.dtype
        shapes = [((self.conv_kernel - 1, self.conv_dim), dtype),
                  ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)]
        if pending_tokens:  # two blocks a slot: the convolution's inputs, its outputs, b | a
            shapes += [((2 * pending_tokens, self.conv_dim), dtype), ((2 * pending_tokens, self.conv_dim), dtype),
                       ((2 * pending_tokens, 2 * self.num_v_heads), dtype)]
        return shapes

    @property
    def cuda_graph_safe(self) -> bool:
        return self.conv.cuda_graph_safe and self.rule.cuda_graph_safe

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [T, hidden] -> [T, hidden] (before the all-reduce of tensor parallelism)."""
        metadata = current_attn_metadata()
        tokens = hidden_states.shape[0]
        qkvz = self.in_proj_qkvz(hidden_states)  # [T, 2 key_dim + 2 value_dim]
        ba = self.in_proj_ba(hidden_states)  # [T, 2 Hv]
        qkv, z = qkvz[:, :self.conv_dim], qkvz[:, self.conv_dim:]
        b, a = ba[:, :self.num_v_heads], ba[:, self.num_v_heads:]
        layout = metadata.recurrent
        if layout is None:  # a step that keeps no state (DP attention's padding pass)
            slots = torch.full((metadata.num_seqs,), -1, dtype=torch.int32, device=hidden_states.device)
            layout = RecurrentMetadata(metadata.query_start_loc, metadata.seq_lens, slots, metadata.max_query_len)
        conv_states, recurrent_states, *pending = self.states
        drafts = layout.drafts
        inputs, outputs, pending_ba = ((p.view(-1, p.shape[1] // 2, *p.shape[2:]) for p in pending)  # [2 slots, P, .]
                                       if drafts is not None else (None, None, None))
        steps = (layout.query_start, layout.seq_lens, layout.slots, layout.max_query_len, drafts)
        mixed = self.conv.forward(qkv, self.conv_weight, None, conv_states, *steps, inputs, outputs)  # [T, C]
        core = self.rule.forward(mixed, a, b, self.A_log, self.dt_bias, recurrent_states, *steps[:3],
                                 self.num_k_heads, self.head_k_dim, layout.max_query_len, drafts, outputs,
                                 pending_ba)  # [T, Hv, Dv]
        gate = z.reshape(tokens, self.num_v_heads, self.head_v_dim)
        out = self.gated_norm.forward(core, gate, self.norm_weight, self.eps)  # [T, Hv, Dv]
        return self.out_proj(out.reshape(tokens, self.value_dim))
