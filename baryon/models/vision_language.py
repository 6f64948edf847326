"""Image-and-text Qwen checkpoints. Qwen3-VL runs whole: its vision tower (models/qwen3_vl_vision.py)
turns a request's images into the embeddings of their placeholder tokens and DeepStack features,
and its multimodal RoPE (layers/mrope.py) places image tokens on their grid. Qwen2-VL and Qwen2.5-VL
serve their language model alone (vision towers not loaded; requests carry text only). The config
is the checkpoint's `text_config` (baryon.config.LANGUAGE_MODEL_ONLY, with the vision settings
beside it), the language model's tensors named `model.*` (Qwen2(.5)-VL's hub layout) or
`model.language_model.*` (transformers 5's, Qwen3-VL's). On text the multimodal RoPE gives every
token the same position on its three axes, which makes it the plain RoPE of the text config.
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.layers.forward_context import current_multimodal_step
from baryon.layers.mrope import MRotaryEmbedding
from baryon.layers.rotary import inverse_frequencies, rope_parameters
from baryon.models.qwen2 import Qwen2ForCausalLM
from baryon.models.qwen3 import Qwen3ForCausalLM
from baryon.models.qwen3_vl_vision import Qwen3VLVisionModel

_WEIGHTS_MAPPING = {"model.language_model.": "model."}
_VISION_PREFIXES = ("visual.", "model.visual.")


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    weights_mapping = _WEIGHTS_MAPPING
    skipped_checkpoint_prefixes = _VISION_PREFIXES


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (the checkpoint's name)
    pass


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    weights_mapping = {**_WEIGHTS_MAPPING, "model.visual.": "visual."}
    accepts_images = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.visual = Qwen3VLVisionModel(config.vision_config)
        self.mrope = shared_mrope(config, [layer.self_attn for layer in self.model.layers])

    def encode_images(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """patches [num_patches, C * T * P * P] -> (embeddings [num_tokens, hidden], DeepStack
        features [k, num_tokens, hidden]) of the images' placeholder tokens, in order."""
        return self.visual(patches, grids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        step = current_multimodal_step()
        if step is None:
            return self.model(input_ids, positions)
        embeddings = self.model.embed(input_ids)  # [num_tokens, hidden]
        embeddings = embeddings.index_copy(0, step.rows, step.embeddings.to(embeddings.dtype))
        with self.mrope.rows_for_step(step.positions) as row_positions:
            return self.model(input_ids, row_positions, embeddings, (step.rows, step.deepstack))


def shared_mrope(config: Any, attentions: list[torch.nn.Module]) -> MRotaryEmbedding:
    """One multimodal RoPE for every attention layer (each held the plain table)."""
    params = rope_parameters(config)
    section = params.get("mrope_section")
    if not section:
        raise ValueError("the text config's rope_parameters have no mrope_section (Qwen3-VL's t / h / w split "
                         "of the rotary frequencies)")
    table = attentions[0].rotary_emb
    rotary_dim = table.cos_sin_cache.shape[-1]
    inv_freq, scaling = inverse_frequencies(rotary_dim, params, config.max_position_embeddings)
    mrope = MRotaryEmbedding(table, inv_freq, scaling, list(section))
    for attention in attentions:
        attention.rotary_emb = mrope
    return mrope
