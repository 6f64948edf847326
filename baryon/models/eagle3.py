"""EAGLE-3 draft head (architectures `LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM`), loaded from
the published layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, SpecForge's heads for Llama and Qwen3).

The target exposes three of its hidden states per token (`aux_hidden_state_layer_ids`: the state
entering each layer, `LlamaModel.aux_hidden_state_layers`); `fc` folds them into one. One Llama
decoder layer then reads the token's embedding and that hidden state side by side:

    h0 = fc([aux_low ; aux_mid ; aux_high])          (first draft step; later steps: the previous
                                                       step's output)
    x  = [input_layernorm(embed(token)) ; hidden_norm(h0)]          [num_tokens, 2 * hidden]
    a  = o_proj(attention(q/k/v_proj(x)))            (RoPE, its own paged KV cache)
    y, residual = post_attention_layernorm(a, h0)    (residual: h0 itself, or hidden_norm(h0) when
                                                       config.norm_before_residual)
    prenorm = mlp(y) + residual                      (fed to the next draft step)
    logits  = lm_head(norm(prenorm))                 [num_tokens, draft_vocab], then placed at target
                                                       ids draft id + d2t[draft id]; -inf elsewhere

Checkpoint names (the module names here): fc.weight, midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight, midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,
down}_proj.weight, norm.weight, lm_head.weight [draft_vocab, hidden], d2t [draft_vocab] int64 (kept as
`target_ids`), t2d [vocab] bool (not needed to draft: checked and dropped) and optionally
embed_tokens.weight; without it the draft embeds with the target's
embedding, handed over by `share_embedding`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.layers.attention import Attention
from baryon.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from baryon.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from baryon.layers.mlp import GatedMLP
from baryon.layers.norm import RMSNorm
from baryon.layers.rotary import get_rope
from baryon.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of, sliding_window_of

NUM_AUX_HIDDEN_STATES = 3  # fc reads [low ; middle ; high] target hidden states


def default_aux_layer_ids(target_num_layers: int) -> tuple[int, ...]:
    """vLLM's and SGLang's default (the EAGLE-3 reference's training choice)."""
    return (2, target_num_layers // 2, target_num_layers - 3)


class Eagle3Attention(LlamaAttention):
    """Llama attention whose q/k/v projections read [embedding ; hidden] (2 * hidden inputs)."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(2 * config.hidden_size, head_dim, config.num_attention_heads,
                                          num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = get_rope(config, head_dim)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads,
                              scale=head_dim ** -0.5, sliding_window=sliding_window_of(config, 0))
        self.qk_norm = False


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False)),
                            hidden_act=getattr(config, "hidden_act", "silu"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # of the token embedding
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # of the incoming hidden state
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """embeds, hidden_states: [num_tokens, hidden] -> the pre-norm output [num_tokens, hidden]."""
        normed = self.hidden_norm(hidden_states)
        residual = normed if self.norm_before_residual else hidden_states
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [num_tokens, 2 * hidden]
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class Eagle3LlamaForCausalLM(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: Any) -> None:
        super().__init__()
        self._check_supported(config)
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size  # the target's
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.target_hidden_size = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.embed_tokens: VocabParallelEmbedding | None = self._optional_embedding(config)
        self.embedding_shared = False  # embed_tokens is the target's (share_embedding)
        self.fc = ReplicatedLinear(NUM_AUX_HIDDEN_STATES * self.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size)
        # The target id of each draft id: draft id + d2t[draft id] once d2t loads (identity without it:
        # random weights, or a checkpoint whose draft vocabulary is the target's).
        self.register_buffer("target_ids", torch.arange(self.draft_vocab_size), persistent=False)  # [draft_vocab]
        self.same_vocab = self.draft_vocab_size == self.vocab_size  # compute_logits need not scatter
        # Checkpoint tensors read by their loaders, not kept: d2t fills target_ids (required unless
        # the vocabularies are the same); t2d (target -> draft mask) is not needed to draft.
        self.d2t = self._placeholder(self._load_d2t, required=self.draft_vocab_size != self.vocab_size)
        self.t2d = self._placeholder(self._check_t2d, required=False)

    @staticmethod
    def _check_supported(config: Any) -> None:
        eagle_config = getattr(config, "eagle_config", None) or {}
        problems = []
        if getattr(config, "num_hidden_layers", 1) != 1:
            problems.append(f"num_hidden_layers={config.num_hidden_layers} (one 'midlayer' is supported)")
        if not eagle_config.get("use_aux_hidden_state", True):
            problems.append("eagle_config.use_aux_hidden_state=false (the draft reads the target's aux hidden states)")
        if getattr(config, "tie_word_embeddings", False):
            problems.append("tie_word_embeddings=true (the head has its own draft-vocabulary lm_head)")
        if problems:
            raise ValueError(f"EAGLE-3 draft config not supported: {'; '.join(problems)}")

    def _optional_embedding(self, config: Any) -> VocabParallelEmbedding:
        """The draft's own embedding, allocated only if the checkpoint has `embed_tokens.weight`
        (its parameter starts empty; after loading, an embedding that stayed empty is dropped)."""
        device = torch.get_default_device()
        with torch.device("meta"):
            embedding = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        shape = embedding.weight.shape
        embedding.weight = nn.Parameter(torch.empty(0, shape[1], device=device), requires_grad=False)
        load_rows = embedding.weight_loader

        def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if param.numel() == 0:
                param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
            load_rows(param, loaded, shard_id)

        embedding.weight.weight_loader = weight_loader
        embedding.weight.expected_shards = frozenset()  # optional: the target's is shared otherwise
        return embedding

    @staticmethod
    def _placeholder(weight_loader, required: bool) -> nn.Parameter:
        param = nn.Parameter(torch.empty(0, dtype=torch.int64), requires_grad=False)  # holds nothing
        param.weight_loader = weight_loader
        param.expected_shards = frozenset([None]) if required else frozenset()
        return param

    def _load_d2t(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dtype.is_floating_point or loaded.dtype == torch.bool:
            raise ValueError(f"expected integer draft -> target id offsets, got dtype {loaded.dtype}")
        if tuple(loaded.shape) != (self.draft_vocab_size,):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected ({self.draft_vocab_size},)")
        offsets = loaded.to(device=self.target_ids.device, dtype=torch.int64)
        target_ids = torch.arange(self.draft_vocab_size, device=offsets.device) + offsets
        low, high = int(target_ids.min()), int(target_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"it maps draft ids to target ids in [{low}, {high}], outside the target "
                             f"vocabulary [0, {self.vocab_size})")
        if torch.unique(target_ids).numel() != self.draft_vocab_size:
            raise ValueError("it maps two draft ids to the same target id")
        self.target_ids.copy_(target_ids)
        self.same_vocab = self.draft_vocab_size == self.vocab_size and not bool(offsets.any())

    def _check_t2d(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.vocab_size,):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected ({self.vocab_size},)")

    def after_weights_loaded(self) -> None:
        """Drop the embedding when the checkpoint had none (the target's is shared instead)."""
        if self.embed_tokens is not None and self.embed_tokens.weight.numel() == 0:
            self.embed_tokens = None

    @property
    def has_own_embedding(self) -> bool:
        """Whether the checkpoint had embed_tokens.weight (known once the weights have loaded)."""
        return self.embed_tokens is not None and not self.embedding_shared

    def share_embedding(self, embedding: VocabParallelEmbedding) -> bool:
        """Embed with the target's embedding module when the checkpoint had none (a draft with its
        own keeps it). Returns whether the target's is used."""
        if self.has_own_embedding:
            return False
        if embedding.vocab_size != self.vocab_size or embedding.weight.shape[-1] != self.hidden_size:
            raise ValueError(f"the target's embedding ({embedding.vocab_size} x {embedding.weight.shape[-1]}) "
                             f"does not fit the draft (vocab_size {self.vocab_size}, hidden_size "
                             f"{self.hidden_size})")
        self.embed_tokens, self.embedding_shared = embedding, True
        return True

    def aux_hidden_state_layer_ids(self, target_num_layers: int) -> tuple[int, ...]:
        """The target layers whose incoming hidden states feed `fc`, in layer order (id
        target_num_layers: the last layer's output). From config.json's
        `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`), else
        (2, L // 2, L - 3). Ids starting at 1 count layer outputs (SpecForge's convention:
        output of layer i = input of layer i + 1) and are shifted by one, as SGLang does."""
        eagle_config = getattr(self.config, "eagle_config", None) or {}
        ids = (getattr(self.config, "eagle_aux_hidden_state_layer_ids", None)
               or eagle_config.get("eagle_aux_hidden_state_layer_ids"))
        if not ids:
            ids = default_aux_layer_ids(target_num_layers)
        elif ids[0] == 1:
            ids = [i + 1 for i in ids]
        ids = tuple(int(i) for i in ids)
        if (len(ids) != NUM_AUX_HIDDEN_STATES or list(ids) != sorted(set(ids))
                or not 0 <= ids[0] <= ids[-1] <= target_num_layers):
            raise ValueError(f"EAGLE-3 aux hidden-state layers {ids} are not {NUM_AUX_HIDDEN_STATES} increasing "
                             f"layer ids in [0, {target_num_layers}] (the target's layers)")
        return ids

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 3 * target_hidden] (the target's aux_hidden_states) -> [num_tokens, hidden]."""
        return self.fc(aux_hidden_states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; hidden_states: [num_tokens, hidden] (combined aux states,
        or the previous draft step's output) -> the pre-norm output [num_tokens, hidden]."""
        if self.embed_tokens is None:
            raise RuntimeError("this EAGLE-3 checkpoint has no embed_tokens.weight: call "
                               "share_embedding(<the target's embed_tokens>) before running the draft")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states has {hidden_states.shape[-1]} features, the draft takes "
                             f"{self.hidden_size}: pass the target's aux states through combine_hidden_states")
        return self.midlayer(positions, self.embed_tokens(input_ids), hidden_states)

    def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden] (pre-norm) -> [num_sampled, draft_vocab] float32."""
        return self.lm_head.compute_logits(self.norm(hidden_states))

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary token ids (any shape) -> the target's ids."""
        return self.target_ids[draft_ids]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden] (pre-norm) -> [num_sampled, vocab] float32 in the target's
        vocabulary: -inf at every id outside the draft vocabulary."""
        draft_logits = self.compute_draft_logits(hidden_states)
        if self.same_vocab:
            return draft_logits
        logits = draft_logits.new_full((draft_logits.shape[0], self.vocab_size), float("-inf"))
        return logits.index_copy_(1, self.target_ids, draft_logits)
