"""The expert computation in torch, one expert at a time: the reference every MoE kernel is
tested against, and the CPU path (exact in float32: the same products in the same order as
Hugging Face's expert loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baryon.kernels.moe.expert_activation import SILU, ExpertActivation
from baryon.kernels.quant.act_quant import FP8, fp8_to_float, quantize_per_group_reference
from baryon.kernels.selector import Kernel


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, expert_start: int = 0, w13_bias: torch.Tensor | None = None,
                            w2_bias: torch.Tensor | None = None, activation: ExpertActivation = SILU) -> torch.Tensor:
    """x: [num_tokens, hidden]; w13: [num_local_experts, 2 * inter, hidden] (gate rows, then up
    rows); w2: [num_local_experts, hidden, inter]; topk_weights: [num_tokens, top_k] float32;
    topk_ids: [num_tokens, top_k] global expert ids, this rank's experts being expert_start ..
    expert_start + num_local_experts - 1 (others contribute nothing); w13_bias [num_local_experts,
    2 * inter] / w2_bias [num_local_experts, hidden] or None (GPT-OSS has both).

    Returns [num_tokens, hidden] = sum over k of weight_k * (w2[e_k] @ act(gate_k, up_k) + b2[e_k])."""
    out = torch.zeros_like(x)
    local = topk_ids.long() - expert_start  # [num_tokens, top_k]
    num_local = w13.shape[0]
    inter = w2.shape[2]
    for expert in torch.unique(local[(local >= 0) & (local < num_local)]).tolist():
        token_idx, k_idx = torch.where(local == expert)
        gate_up = F.linear(x[token_idx], w13[expert], None if w13_bias is None else w13_bias[expert])
        gate, up = gate_up.split(inter, dim=-1)
        y = F.linear(activation(gate, up), w2[expert], None if w2_bias is None else w2_bias[expert])
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, k_idx, None]).to(out.dtype))
    return out


class TorchFusedExperts(Kernel):
    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_start: int = 0, num_experts: int | None = None,
                w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                activation: ExpertActivation = SILU) -> torch.Tensor:
        return fused_experts_reference(x, w13, w2, topk_weights, topk_ids, expert_start, w13_bias, w2_bias,
                                       activation)


# FP8 experts with block weight scales (DeepSeek-V3, Qwen3-*-FP8): w13 float8_e4m3fn [E, 2I, H]
# with w13_scale float32 [E, ceil(2I / bn), ceil(H / bk)], w2 float8_e4m3fn [E, H, I] with
# w2_scale [E, ceil(H / bn), ceil(I / bk)]; block = (bn, bk); weight = q * its block's scale.


def dequantize_block_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [..., N, K] float8 (or int8: the INT8 W8A8 experts) with scale [..., ceil(N / bn),
    ceil(K / bk)] -> float32 [..., N, K] (the last blocks of a row or column may be partial)."""
    bn, bk = block
    n, k = w.shape[-2:]
    full = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (fp8_to_float(w) if w.dtype == FP8 else w.float()) * full


def _dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """q [M, K] with per-row group scales [M, ceil(K / group)] -> float32 [M, K]."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[:, : q.shape[1]]


def fused_experts_fp8_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                                w2_scale: torch.Tensor, block: tuple[int, int], topk_weights: torch.Tensor,
                                topk_ids: torch.Tensor, expert_start: int = 0,
                                num_experts: int | None = None) -> torch.Tensor:
    """The FP8 experts as the GPU computes them (w8a8, the math of vLLM's / SGLang's block-FP8
    MoE), one expert at a time in float32: x is quantized to float8_e4m3fn per token in 1 x bk
    groups (the act_quant reference), each GEMM is the dequantized activations times the
    dequantized weights (= sum over K blocks of x_scale[row, kb] * w_scale[nb, kb] * the fp8
    partial dot), and the SiLU-and-mul intermediate is quantized the same way before the down
    GEMM. Rounded to x.dtype where the Triton kernel stores: the intermediate and each pair's
    weighted output (summed over k in float32). Pairs routed to experts outside expert_start ..
    expert_start + num_local - 1 contribute zero (num_experts, the global count, is not needed
    here). Returns [num_tokens, hidden] in x.dtype."""
    _, bk = block
    num_tokens, top_k = topk_ids.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    xq, xs = quantize_per_group_reference(x, bk, w13.dtype)  # float8 (or int8 codes: INT8 W8A8)
    xd = _dequantize_groups(xq, xs, bk)
    y = torch.zeros(num_tokens, top_k, x.shape[1], dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_start
    for expert in torch.unique(local[(local >= 0) & (local < num_local)]).tolist():
        token_idx, k_idx = torch.where(local == expert)
        gate, up = F.linear(xd[token_idx], dequantize_block_fp8(w13[expert], w13_scale[expert], block)).split(inter, -1)
        act = (F.silu(gate) * up).to(x.dtype)
        aq, as_ = quantize_per_group_reference(act, bk, w2.dtype)
        out = F.linear(_dequantize_groups(aq, as_, bk), dequantize_block_fp8(w2[expert], w2_scale[expert], block))
        y[token_idx, k_idx] = (out * topk_weights[token_idx, k_idx, None].float()).to(x.dtype).float()
    return y.sum(dim=1).to(x.dtype)


def fused_experts_fp8_dequant(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                              w2_scale: torch.Tensor, block: tuple[int, int], topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, expert_start: int = 0,
                              num_experts: int | None = None) -> torch.Tensor:
    """Weight-only dequantization: each used expert's weights dequantized by blocks to float32,
    the activations left unquantized, everything in float32 (the CPU path). Returns
    [num_tokens, hidden] in x.dtype."""
    num_local, inter = w13.shape[0], w2.shape[2]
    x32 = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_start
    for expert in torch.unique(local[(local >= 0) & (local < num_local)]).tolist():
        token_idx, k_idx = torch.where(local == expert)
        w13_e = dequantize_block_fp8(w13[expert], w13_scale[expert], block)
        gate, up = F.linear(x32[token_idx], w13_e).split(inter, -1)
        y = F.linear(F.silu(gate) * up, dequantize_block_fp8(w2[expert], w2_scale[expert], block))
        out.index_add_(0, token_idx, y * topk_weights[token_idx, k_idx, None].float())
    return out.to(x.dtype)


class TorchFp8FusedExperts(Kernel):
    """FP8 block-scaled experts on any device (the CPU path of FP8 MoE checkpoints): weight-only
    dequantization (`fused_experts_fp8_dequant`), so activations keep their precision; the GPU
    kernels also quantize activations (w8a8) and differ from this by that rounding
    (`fused_experts_fp8_reference` is their exact reference)."""

    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                w2_scale: torch.Tensor, block: tuple[int, int], topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_start: int = 0, num_experts: int | None = None) -> torch.Tensor:
        return fused_experts_fp8_dequant(x, w13, w2, w13_scale, w2_scale, tuple(block), topk_weights, topk_ids,
                                         expert_start, num_experts)


class TorchInt8FusedExperts(TorchFp8FusedExperts):
    """INT8 W8A8 experts (int8 codes, scales in (1 x 128) blocks) on any device: the FP8 path's
    weight-only dequantization."""


# MXFP4 experts (GPT-OSS): w13_blocks uint8 [E, 2I, H / 2] with w13_scales uint8 [E, 2I, H / 32],
# w2_blocks [E, H, I / 2] with w2_scales [E, H, I / 32] (kernels/quant/mxfp4.py has the format).


def fused_experts_mxfp4_reference(x: torch.Tensor, w13_blocks: torch.Tensor, w2_blocks: torch.Tensor,
                                  w13_scales: torch.Tensor, w2_scales: torch.Tensor, topk_weights: torch.Tensor,
                                  topk_ids: torch.Tensor, expert_start: int = 0, num_experts: int | None = None,
                                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                                  activation: ExpertActivation = SILU) -> torch.Tensor:
    """The experts dequantized to x.dtype (exact: a power-of-two scale times a 4-bit code), then
    the float reference: what the Triton MXFP4 kernels compute, up to summation order."""
    from baryon.kernels.quant.mxfp4 import dequantize_mxfp4

    w13 = dequantize_mxfp4(w13_blocks, w13_scales, x.dtype)
    w2 = dequantize_mxfp4(w2_blocks, w2_scales, x.dtype)
    return fused_experts_reference(x, w13, w2, topk_weights, topk_ids, expert_start, w13_bias, w2_bias, activation)


class TorchMxfp4FusedExperts(Kernel):
    """MXFP4 experts on any device: dequantized per call (a reference; the CPU path of MXFP4
    checkpoints dequantizes once at load instead, `quantization/mxfp4.py`)."""

    name = "torch"

    @staticmethod
    def forward(*args, **kwargs) -> torch.Tensor:
        return fused_experts_mxfp4_reference(*args, **kwargs)


def fused_experts_int4_reference(x: torch.Tensor, w13_blocks: torch.Tensor, w2_blocks: torch.Tensor,
                                 w13_pairs: torch.Tensor, w2_pairs: torch.Tensor, topk_weights: torch.Tensor,
                                 topk_ids: torch.Tensor, expert_start: int = 0, num_experts: int | None = None
                                 ) -> torch.Tensor:
    """The int4 experts (`quant/int4_experts.py`) dequantized in float32 and rounded once to
    x.dtype, then the float reference."""
    from baryon.kernels.quant.int4_experts import dequantize_int4_experts

    w13 = dequantize_int4_experts(w13_blocks, w13_pairs, x.dtype)
    w2 = dequantize_int4_experts(w2_blocks, w2_pairs, x.dtype)
    return fused_experts_reference(x, w13, w2, topk_weights, topk_ids, expert_start)


class TorchInt4FusedExperts(Kernel):
    """Packed int4 experts on any device: dequantized per call (a reference; the CPU path of
    int4 MoE checkpoints dequantizes once at load instead, `quantization/moe_dequantized.py`)."""

    name = "torch"

    @staticmethod
    def forward(*args, **kwargs) -> torch.Tensor:
        return fused_experts_int4_reference(*args, **kwargs)
