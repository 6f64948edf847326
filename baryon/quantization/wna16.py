"""Weight-only integer linear layers (W4A16 / W8A16): compressed-tensors `pack-quantized`, GPTQ
and AWQ checkpoints, and online W4A16 (`quantization="w4a16"`).

Each format's tensors load as published; after loading they are turned into one canonical form

    codes uint8 [N, K] (0 .. 2**bits - 1), scales [N, G], zeros uint8 [N, G] (unsigned codes),
    weight[n, k] = (codes[n, k] - zeros[n, g(k)]) * scales[n, g(k)]

which the `w4a16_linear` kernel repacks into its own layout. The published layouts:

    compressed-tensors  weight_packed int32 [N, K*bits/32] (codes + 2**(bits-1), along K, low bits
                        first), weight_scale [N, G], weight_zero_point int32 [N*bits/32, G]
                        (asymmetric only, signed zero + 2**(bits-1), packed along N), weight_shape,
                        weight_g_idx int32 [K] (actorder "group" only: as GPTQ's g_idx)
    GPTQ                qweight int32 [K*bits/32, N] (along K), qzeros int32 [G, N*bits/32] (along
                        N; the "gptq" format stores zero - 1, "gptq_v2" the zero), scales [G, N],
                        g_idx int32 [K] (act-order: column k belongs to group g_idx[k])
    AWQ                 qweight int32 [K, N/8] and qzeros int32 [G, N/8], packed along N with word
                        j's nibble i holding column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]; scales [G, N]

With act-order (a g_idx that is not k // group_size) the columns are sorted by group at load and
the activations gathered in the same order at run time, so the kernel sees contiguous groups. A
layer that splits its input over tensor-parallel ranks (o_proj, down_proj) holds a share of each
group's columns on every rank, not whole groups: there each rank loads every group's scales and
zero points, and its columns are dequantized at load ((code - zero) * scale of the column's group,
in float32, rounded once to the model's dtype) to a dense weight of 16 bits a value: exact, at 4x
(2x for 8-bit codes) the bytes those layers would take packed. Where a rank's g_idx is whole
groups in column order (GPTQ's static_groups), it keeps its own groups' scales and the packed
kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.selector import select
from baryon.quantization.base import DENSE, LinearMethod

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LAYOUTS = ("compressed-tensors", "gptq", "gptq_v2", "awq", "online")


def unpack_int32(words: torch.Tensor, bits: int, count: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, W] holding 32/bits codes per word along the last dim, low bits first ->
    uint8 [R, count]. `order`: code i of a word holds element order[i] of its run (AWQ)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)  # [per_word]
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, W, per_word]
    if order is not None:
        codes = codes[..., torch.tensor(order, device=words.device).argsort()]
    return codes.reshape(words.shape[0], words.shape[1] * per_word)[:, :count].to(torch.uint8)


def quantize_int_groups(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Symmetric round-to-nearest: weight [N, K] float -> (codes uint8 [N, K], scales f32 [N, G],
    zeros uint8 [N, G] = 2**(bits-1)), scale = group amax / (2**(bits-1) - 1)."""
    n, k = weight.shape
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(weight.float(), (0, groups * group_size - k)).view(n, groups, group_size)
    half = 1 << (bits - 1)
    scales = padded.abs().amax(dim=-1).clamp(min=1e-12) / (half - 1)  # [N, G]
    codes = torch.round(padded / scales[..., None]).clamp(-half, half - 1) + half
    zeros = torch.full((n, groups), half, dtype=torch.uint8, device=weight.device)
    return codes.view(n, -1)[:, :k].to(torch.uint8), scales, zeros


class WNA16LinearMethod(LinearMethod):
    def __init__(self, layout: str, bits: int, group_size: int | None, symmetric: bool = True,
                 act_order: bool = False) -> None:
        """layout: the checkpoint format (see LAYOUTS); group_size None: one group per row
        (channel); act_order: GPTQ's desc_act or compressed-tensors' actorder "group" (g_idx /
        weight_g_idx carries a permutation)."""
        if layout not in LAYOUTS:
            raise ValueError(f"weight-only layout {layout!r} is not supported; supported: {list(LAYOUTS)}")
        if bits not in (4, 8) or (layout == "awq" and bits != 4):
            raise ValueError(f"{bits}-bit {layout} weights are not supported; supported: 4 and 8 bits (AWQ: 4)")
        self.layout, self.bits, self.group_size = layout, bits, group_size
        self.symmetric, self.act_order = symmetric, act_order

    def _groups(self, k: int) -> int:
        return 1 if self.group_size is None else -(-k // self.group_size)

    def create_weights(self, layer: nn.Module) -> None:
        n, k, bits = layer.output_size, layer.input_size, self.bits
        # Act order over a split input: every group's scales on every rank (see the module docstring).
        self.dense_columns = self.act_order and getattr(layer, "input_split_over_ranks", False)
        groups_dim = None if self.dense_columns else 0
        groups = self._groups(k * layer.tp_size if self.dense_columns else k)
        dtype = torch.get_default_dtype()
        per_word = 32 // bits
        if self.layout == "online":
            DENSE.create_weights(layer)
        elif self.layout == "compressed-tensors":
            groups_dim = None if self.dense_columns else 1
            layer.add_param("weight_packed", (n, -(-k // per_word)), torch.int32)
            layer.add_param("weight_scale", (n, groups), dtype, input_dim=groups_dim)
            if not self.symmetric:
                layer.add_param("weight_zero_point", (-(-n // per_word), groups), torch.int32, input_dim=groups_dim,
                                output_block=per_word)
            shape = layer.add_param("weight_shape", (2,), torch.int64, output_dim=None, input_dim=None)
            shape.expected_shards = frozenset()  # informative only: not required, not used
            shape.weight_loader = lambda param, loaded, shard_id=None: None
            if self.act_order:  # actorder "group": column k belongs to group weight_g_idx[k]
                g_idx = layer.add_param("weight_g_idx", (k,), torch.int32, output_dim=None, input_dim=0)
                g_idx.weight_loader = self._g_idx_loader(layer)
        elif self.layout in ("gptq", "gptq_v2"):
            layer.add_param("qweight", (-(-k // per_word), n), torch.int32, output_dim=1, input_dim=0)
            layer.add_param("qzeros", (groups, -(-n // per_word)), torch.int32, output_dim=1,
                            input_dim=groups_dim, output_block=per_word)
            layer.add_param("scales", (groups, n), dtype, output_dim=1, input_dim=groups_dim)
            g_idx = layer.add_param("g_idx", (k,), torch.int32, output_dim=None, input_dim=0)
            g_idx.weight_loader = self._g_idx_loader(layer)
            if not self.act_order:
                g_idx.expected_shards = frozenset()  # k // group_size: checkpoints may leave it out
        else:  # awq
            layer.add_param("qweight", (k, n // 8), torch.int32, output_dim=1, input_dim=0, output_block=8)
            layer.add_param("qzeros", (groups, n // 8), torch.int32, output_dim=1, input_dim=0, output_block=8)
            layer.add_param("scales", (groups, n), dtype, output_dim=1, input_dim=0)
        if not self.dense_columns:
            self.kernel = select("w4a16_linear", torch.get_default_device(), in_features=k, out_features=n,
                                 bits=bits, group_size=self.group_size or k, dtype=dtype)

    @staticmethod
    def _g_idx_loader(layer: nn.Module):
        """Fused parts read one input, so GPTQ gives them one column order: the first part's
        g_idx loads, the others must equal it."""
        loaded_parts: set = set()

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if loaded_parts:
                mine = layer._input_slice(param, loaded)
                if mine.shape != param.shape or not torch.equal(param.data, mine.to(param.dtype)):
                    raise ValueError(f"g_idx of part {shard_id!r} differs from that of part "
                                     f"{next(iter(loaded_parts))!r}; fused parts must share one act order")
            else:
                layer.weight_loader(param, loaded, shard_id)
            loaded_parts.add(shard_id)

        return load

    def canonical(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The loaded tensors as (codes [N, K], scales [N, G], zeros [N, G], g_idx [K] or None)."""
        n, k, bits = layer.output_size, layer.input_size, self.bits
        if self.layout == "online":
            codes, scales, zeros = quantize_int_groups(layer.weight.data, bits, self.group_size or k)
            return codes, scales.to(layer.weight.dtype), zeros, None
        if self.layout == "compressed-tensors":
            codes = unpack_int32(layer.weight_packed.data, bits, k)
            scales = layer.weight_scale.data
            if self.symmetric:
                zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.uint8)
            else:
                zeros = unpack_int32(layer.weight_zero_point.data.t().contiguous(), bits, n).t()
            return codes, scales, zeros.contiguous(), layer.weight_g_idx.data if self.act_order else None
        if self.layout == "awq":
            codes = unpack_int32(layer.qweight.data, bits, n, AWQ_ORDER).t()
            zeros = unpack_int32(layer.qzeros.data, bits, n, AWQ_ORDER).t()
            return codes.contiguous(), layer.scales.data.t().contiguous(), zeros.contiguous(), None
        codes = unpack_int32(layer.qweight.data.t().contiguous(), bits, k)
        zeros = unpack_int32(layer.qzeros.data, bits, n).t()
        if self.layout == "gptq":  # the v1 format stores zero - 1 (wrapping within the bit width)
            zeros = (zeros.to(torch.int32) + 1) & ((1 << bits) - 1)
        return codes, layer.scales.data.t().contiguous(), zeros.to(torch.uint8).contiguous(), layer.g_idx.data

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes, scales, zeros, g_idx = self.canonical(layer)
        k = layer.input_size
        group = self.group_size or k
        self.perm = None
        act_order = self.act_order
        if self.dense_columns:
            first = layer.tp_rank * k  # this rank's first column of the whole layer
            if k % group or not torch.equal(g_idx.long(), torch.arange(first, first + k, device=g_idx.device) // group):
                self._dequantize_columns(layer, codes, scales, zeros, g_idx)
                return
            # Whole groups in column order (GPTQ's static_groups): this rank's own groups, packed.
            own = slice(first // group, (first + k) // group)
            scales, zeros = scales[:, own].contiguous(), zeros[:, own].contiguous()
            self.dense_columns = act_order = False
            self.kernel = select("w4a16_linear", codes.device, in_features=k, out_features=layer.output_size,
                                 bits=self.bits, group_size=group, dtype=scales.dtype)
        if act_order:
            order = torch.argsort(g_idx.long(), stable=True)  # columns sorted by group
            expected = torch.arange(k, device=order.device) // group
            if not torch.equal(g_idx.long()[order], expected):
                raise ValueError(f"g_idx of {layer_name(layer)} does not give every group {group} columns")
            if not torch.equal(order, torch.arange(k, device=order.device)):
                self.perm = order
                codes = codes[:, order].contiguous()
        self.weights = self.kernel.prepare(codes, scales, zeros, self.bits, group)
        _drop_checkpoint_params(layer)

    def _dequantize_columns(self, layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            g_idx: torch.Tensor) -> None:
        """This rank's columns as a dense weight [N, k]: column j in group g_idx[j] of the whole
        layer's G groups (scales and zeros [N, G])."""
        groups = scales.shape[1]
        g = g_idx.long()
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
            raise ValueError(f"g_idx of {layer_name(layer)} names groups outside 0..{groups - 1}")
        weight = (codes.float() - zeros[:, g].float()) * scales[:, g].float()  # [N, k]
        dtype = scales.dtype
        _drop_checkpoint_params(layer)
        layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        DENSE.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.dense_columns:
            return DENSE.apply(layer, x, bias)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        x2 = x.reshape(-1, x.shape[-1])
        out = self.kernel.forward(x2, self.weights, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        if self.dense_columns:
            return DENSE.dequantize(layer)
        weight = self.kernel.dequantize(self.weights)
        if self.perm is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, self.perm] = weight
        return restored


def _drop_checkpoint_params(layer: nn.Module) -> None:
    """Delete the parameters the checkpoint loaded into, once their contents are repacked."""
    for name in ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                 "qweight", "qzeros", "scales", "g_idx"):
        if name in layer._parameters:
            delattr(layer, name)


def layer_name(layer: nn.Module) -> str:
    return getattr(layer, "checkpoint_prefix", type(layer).__name__)
