"""Qwen3-Next and Qwen3.5 multi-token prediction (MTP): the `mtp.*` tensors of the checkpoint,
loaded as a model of their own (architecture `Qwen3NextMTP`, from the same checkpoint:
`baryon.config.mtp_draft_config`) for a speculative decoder to run as its draft. The main model
skips these tensors; this one loads nothing else and shares the main model's embedding and LM
head (`share_target`).

MTP layer i predicts the token after next: from the main model's final (normed) hidden state at
position t and the embedding of token t + 1,

    x = fc([pre_fc_norm_embedding(embed_tokens(token t + 1)) ; pre_fc_norm_hidden(hidden at t)])
    x, residual = layer i(x)        (gated full attention, and the main model's MLP or experts)
    hidden = norm(x + residual);    logits = lm_head(hidden)

Every norm multiplies by 1 + weight. Checkpoint names: mtp.{fc, pre_fc_norm_embedding,
pre_fc_norm_hidden, norm}, mtp.layers.{i}.{self_attn.*, mlp.*, input_layernorm,
post_attention_layernorm}.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.layers.linear import ReplicatedLinear
from baryon.models.gemma2 import GemmaRMSNorm
from baryon.models.llama import LlamaDecoderLayer
from baryon.models.mtp_draft import MTPDraftModel
from baryon.models.qwen3_next import GatedAttention, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

MAIN_MODELS = {"qwen3_next": Qwen3NextForCausalLM, "qwen3_5_text": Qwen3_5ForCausalLM,
               "qwen3_5_moe_text": Qwen3_5MoeForCausalLM}


def num_mtp_layers(config: Any) -> int:
    """The MTP layers a config counts (Qwen3-Next: num_nextn_predict_layers, Qwen3.5:
    mtp_num_hidden_layers; one where neither is given, as the published Qwen3-Next has)."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        count = getattr(config, key, None)
        if count is not None:
            return int(count)
    return 1


class MultiTokenPredictor(nn.Module):
    """The checkpoint's `mtp` module."""

    def __init__(self, config: Any, main: type[Qwen3NextForCausalLM]) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = GemmaRMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(hidden, config.rms_norm_eps)
        # RoPE as the main model's full-attention layers have it (a layer past num_hidden_layers
        # has no entry of its own in layer_types)
        full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"][-1]
        first = config.num_hidden_layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, GatedAttention(config, full), main.build_mlp(config, first + i), GemmaRMSNorm)
            for i in range(num_mtp_layers(config)))
        self.norm = GemmaRMSNorm(hidden, config.rms_norm_eps)


class Qwen3NextMTP(MTPDraftModel):
    main_models = MAIN_MODELS
    skipped_checkpoint_prefixes = ("model.", "lm_head.")  # the main model's (the embedding, LM head: shared)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.mtp = MultiTokenPredictor(config, self.main)
        self.num_mtp_layers = len(self.mtp.layers)
        self.embed_tokens: nn.Module | None = None  # the main model's (share_target)
        self.lm_head: nn.Module | None = None

    def share_target(self, target: nn.Module) -> None:
        """Read tokens and write logits with the main model's embedding and LM head."""
        self.embed_tokens, self.lm_head = target.model.embed_tokens, target.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden_states: torch.Tensor,
                step: int = 0) -> torch.Tensor:
        """input_ids, positions: [num_tokens] (token t + 1 at position t); previous_hidden_states:
        [num_tokens, hidden] (the main model's at t) -> MTP layer `step`'s normed output [num_tokens, hidden]."""
        mtp = self.mtp
        embeds = mtp.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = mtp.fc(torch.cat((embeds, mtp.pre_fc_norm_hidden(previous_hidden_states)), dim=-1))
        x, residual = mtp.layers[step](positions, x, None)
        return mtp.norm(x, residual)[0]

    def compute_logits(self, hidden_states: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[num_sampled, hidden] -> [num_sampled, vocab] float32."""
        return self.lm_head.compute_logits(hidden_states)
