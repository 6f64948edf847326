"""MoE routing: router logits -> each token's top-k experts and their weights.

One function covers every published router:

- softmax top-k (Qwen2/3-MoE, Mixtral), with or without renormalising the k weights
  (`norm_topk_prob`; Mixtral always renormalises);
- grouped top-k (DeepSeek, GLM-4.5): experts split into `num_groups` groups; each group scored
  (the sum of its two best scores when a correction bias is given, as DeepSeek-V3 and GLM do,
  else its best score, as DeepSeek-V2 does), the best `topk_group` groups kept, and the top-k
  chosen inside them;
- scores by softmax or sigmoid; an `e_score_correction_bias` added to the scores for the choice
  only (the weights are the unbiased scores); `routed_scaling_factor` multiplies the weights.

Ties go to the lower expert index (the torch reference sorts stably; the Triton kernel's argmax
breaks ties to the left), so both choose the same experts on any input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import TritonKernel, next_power_of_2, tl, triton


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    renormalize: bool = False
    scoring: str = "softmax"  # or "sigmoid"
    num_groups: int = 1  # grouped top-k when > 1 (or when topk_group is set with a bias)
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {self.scoring!r} is not supported; supported: 'softmax', 'sigmoid'")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_group={self.num_groups} does not divide the expert count {self.num_experts}")
        if self.num_groups > 1 and not 1 <= self.topk_group <= self.num_groups:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.num_groups}]")
        if self.num_groups > 1 and self.top_k > self.topk_group * (self.num_experts // self.num_groups):
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the experts in topk_group="
                             f"{self.topk_group} groups of {self.num_experts // self.num_groups}")


def _stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, ties to the lower index."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def route_reference(logits: torch.Tensor, config: RoutingConfig,
                    correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [num_tokens, num_experts] -> (weights [num_tokens, top_k] float32,
    expert ids [num_tokens, top_k] int32), in the order chosen (best first)."""
    logits = logits.float()
    scores = logits.softmax(dim=-1) if config.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.num_groups > 1:
        tokens, groups = choice.shape[0], config.num_groups
        grouped = choice.view(tokens, groups, -1)
        if correction_bias is not None:
            group_scores = _stable_topk(grouped, 2)[0].sum(dim=-1)  # [tokens, groups]
        else:
            group_scores = grouped.max(dim=-1).values
        kept = _stable_topk(group_scores, config.topk_group)[1]  # [tokens, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(config.num_experts // groups, dim=1),
                                    float("-inf"))
    ids = _stable_topk(choice, config.top_k)[1]
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, ids.to(torch.int32)


class TorchRouting(Kernel):
    name = "torch"

    @staticmethod
    def forward(logits: torch.Tensor, config: RoutingConfig,
                correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_reference(logits, config, correction_bias)


if triton is not None:

    @triton.jit
    def _route_kernel(logits, bias, weights_out, ids_out, stride_lt, scaling,
                      NUM_EXPERTS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
                      NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                      GROUP_TOP2: tl.constexpr, RENORMALIZE: tl.constexpr):
        """One program per token. Experts are laid out [GROUPS_PAD, GROUP_PAD] (group g, member s
        -> expert g * GROUP_SIZE + s; padding masked), so one layout serves grouped and plain top-k."""
        token = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, GROUPS_PAD)[:, None]
        s = tl.arange(0, GROUP_PAD)[None, :]
        expert = g * GROUP_SIZE + s  # [GROUPS_PAD, GROUP_PAD]
        valid = (g < NUM_GROUPS) & (s < GROUP_SIZE)
        x = tl.load(logits + token * stride_lt + expert, mask=valid, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
        else:
            e = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
            scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias + expert, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, float("-inf"))
        if NUM_GROUPS > 1:
            best = tl.max(choice, axis=1)  # [GROUPS_PAD]
            if GROUP_TOP2:  # the two best of each group (the first best removed once, lowest index)
                first = tl.argmax(choice, axis=1)
                second = tl.max(tl.where(s == first[:, None], float("-inf"), choice), axis=1)
                group_score = best + second
            else:
                group_score = best
            groups = tl.arange(0, GROUPS_PAD)
            group_score = tl.where(groups < NUM_GROUPS, group_score, float("-inf"))
            keep = tl.zeros([GROUPS_PAD], tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                pick = tl.argmax(group_score, axis=0)
                keep = keep | (groups == pick)
                group_score = tl.where(groups == pick, float("-inf"), group_score)
            choice = tl.where(keep[:, None], choice, float("-inf"))
        flat_choice = tl.reshape(choice, [GROUPS_PAD * GROUP_PAD])
        flat_scores = tl.reshape(scores, [GROUPS_PAD * GROUP_PAD])
        flat_expert = tl.reshape(expert, [GROUPS_PAD * GROUP_PAD])
        positions = tl.arange(0, GROUPS_PAD * GROUP_PAD)
        k_idx = tl.arange(0, TOP_K_PAD)
        chosen_w = tl.zeros([TOP_K_PAD], tl.float32)
        chosen_id = tl.zeros([TOP_K_PAD], tl.int32)
        for i in tl.static_range(TOP_K):
            pick = tl.argmax(flat_choice, axis=0)  # ties: the lowest position = the lowest expert
            w = tl.sum(tl.where(positions == pick, flat_scores, 0.0), axis=0)
            eid = tl.sum(tl.where(positions == pick, flat_expert, 0), axis=0)
            chosen_w = tl.where(k_idx == i, w, chosen_w)
            chosen_id = tl.where(k_idx == i, eid, chosen_id)
            flat_choice = tl.where(positions == pick, float("-inf"), flat_choice)
        if RENORMALIZE:
            chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
        chosen_w = chosen_w * scaling
        tl.store(weights_out + token * TOP_K + k_idx, chosen_w, mask=k_idx < TOP_K)
        tl.store(ids_out + token * TOP_K + k_idx, chosen_id, mask=k_idx < TOP_K)


class TritonRouting(TritonKernel):
    """One program per token: scores, group selection and the top-k in registers."""

    family = "moe_routing"

    @classmethod
    def cannot_implement_reason(cls, num_experts: int = 8, **config) -> str | None:
        if num_experts > 1024:
            return f"{num_experts} experts (at most 1024)"
        return None

    @staticmethod
    def forward(logits: torch.Tensor, config: RoutingConfig,
                correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [num_tokens, num_experts] -> (weights [num_tokens, top_k] float32, ids int32)."""
        tokens = logits.shape[0]
        weights = torch.empty(tokens, config.top_k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(tokens, config.top_k, dtype=torch.int32, device=logits.device)
        if tokens == 0:
            return weights, ids
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        group_size = config.num_experts // config.num_groups
        _route_kernel[(tokens,)](
            logits, correction_bias if correction_bias is not None else logits, weights, ids,
            logits.stride(0), config.routed_scaling_factor,
            NUM_EXPERTS=config.num_experts, GROUP_SIZE=group_size, GROUP_PAD=next_power_of_2(group_size),
            NUM_GROUPS=config.num_groups, GROUPS_PAD=next_power_of_2(config.num_groups),
            TOPK_GROUP=config.topk_group, TOP_K=config.top_k, TOP_K_PAD=next_power_of_2(config.top_k),
            SIGMOID=config.scoring == "sigmoid",
            HAS_BIAS=correction_bias is not None, GROUP_TOP2=correction_bias is not None,
            RENORMALIZE=config.renormalize,
            # One warp holds up to 256 scores: the k argmax rounds are warp shuffles, no barriers
            # (measured 4.5 us per token-step with 4 warps for 128 experts on an H100).
            num_warps=1 if next_power_of_2(config.num_groups) * next_power_of_2(group_size) <= 256 else 4)
        return weights, ids
