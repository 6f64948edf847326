"""Gemma 3 text models (`Gemma3ForCausalLM`: gemma-3-1b and the text-only checkpoints), and the
language model of the image-and-text checkpoints (`Gemma3ForConditionalGeneration`: 4b-27b).

Gemma 2's decoder (models/gemma2.py: scaled embeddings, (1 + weight) sandwich norms, GELU-tanh,
local / global layers) with per-head RMSNorm on queries and keys, and RoPE settings per kind of
layer (`rope_parameters` keyed by `sliding_attention` / `full_attention`: the local RoPE base on
the first, the global settings on the second). The published configs set no soft-capping; where
one does, it is applied as in Gemma 2.
"""

from __future__ import annotations

from typing import Any

from baryon.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model, GemmaRMSNorm
from baryon.models.llama import head_dim_of


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = GemmaRMSNorm(head_dim_of(config), config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim_of(config), config.rms_norm_eps)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_class = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 image-and-text checkpoint, served alone: its config is the
    checkpoint's `text_config` (baryon.config.LANGUAGE_MODEL_ONLY), its tensors those under
    `language_model.`; the vision tower and the projector are not loaded (images unsupported)."""

    weights_mapping = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                       "model.language_model.": "model."}  # (the hub's layout; transformers 5's in memory)
    skipped_checkpoint_prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                   "model.multi_modal_projector.")
