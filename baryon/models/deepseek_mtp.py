"""DeepSeek-V3 multi-token prediction (MTP): the `num_nextn_predict_layers` layers a checkpoint
stores past `num_hidden_layers`, loaded as a model of their own (architecture `DeepseekMTP`, from
the same checkpoint: `baryon.config.mtp_draft_config`) for a speculative decoder to run as its draft. The main
model skips these tensors; this one loads nothing else.

MTP layer k (= num_hidden_layers + i) predicts the token after next: from the main model's last
hidden state at position t and the embedding of token t + 1,

    e = enorm(embed_tokens(token t + 1))        (zero at position 0)
    x = eh_proj([e ; hnorm(previous hidden state at t)])
    x, residual = decoder layer k(x)            (latent attention, experts: the main model's layers)
    hidden = x + residual;   logits = shared_head.head(shared_head.norm(hidden))

Checkpoint names: model.layers.{k}.{embed_tokens, enorm, hnorm, eh_proj, shared_head.norm,
shared_head.head} and the decoder layer's own (self_attn.*, mlp.*, input_layernorm,
post_attention_layernorm).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from baryon.layers.linear import ReplicatedLinear
from baryon.layers.norm import RMSNorm
from baryon.models.deepseek_v2 import DeepseekV3ForCausalLM
from baryon.models.deepseek_v32 import DeepseekV32ForCausalLM
from baryon.models.llama import LlamaDecoderLayer
from baryon.models.mtp_draft import MTPDraftModel

MAIN_MODELS = {"deepseek_v3": DeepseekV3ForCausalLM, "deepseek_v32": DeepseekV32ForCausalLM}


class SharedHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size)


class DeepseekMTPLayer(LlamaDecoderLayer):
    """A decoder layer of the main model's kind plus the MTP input and output projections."""

    def __init__(self, config: Any, layer_idx: int, main: type[DeepseekV3ForCausalLM]) -> None:
        super().__init__(config, main.build_attention(config, layer_idx), main.build_mlp(config, layer_idx))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def predict(self, input_ids: torch.Tensor, positions: torch.Tensor,
                previous_hidden_states: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] (token t + 1 at position t + 1); previous_hidden_states:
        [num_tokens, hidden] (the main model's at t) -> [num_tokens, hidden]."""
        embeds = torch.where(positions[:, None] == 0, 0.0, self.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous_hidden_states)), dim=-1))
        x, residual = self(positions, x, None)
        return x + residual


class DeepseekMTP(MTPDraftModel):
    main_models = MAIN_MODELS

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        main = self.main
        first, count = config.num_hidden_layers, int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        self.only_layers = range(first, first + count)  # the checkpoint's other tensors are the main model's
        self.num_mtp_layers = count
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(k): DeepseekMTPLayer(config, k, main) for k in self.only_layers})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden_states: torch.Tensor,
                step: int = 0) -> torch.Tensor:
        """MTP layer `step` (0: the first past the main model's): [num_tokens, hidden]."""
        return self.model.layers[str(self.only_layers[step])].predict(input_ids, positions, previous_hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[num_sampled, hidden] -> [num_sampled, vocab] float32."""
        head = self.model.layers[str(self.only_layers[step])].shared_head
        return head.head.compute_logits(head.norm(hidden_states))
