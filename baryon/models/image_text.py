"""What an image-and-text model adds to its language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5):
the vision tower (models/qwen3_vl_vision.py, models/qwen2_vl_vision.py), which turns a request's images into the embeddings of their
placeholder tokens and DeepStack features, and the multimodal RoPE (layers/mrope.py), which places
image tokens on their grid. `ReadsImages` goes before the language model's class: in a step with
image prompts (the runner's MultiModalStep) the embeddings replace the placeholders' and the
attention layers rotate by the step's rows; otherwise the model runs as its text model does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.layers.forward_context import current_multimodal_step
from baryon.layers.mrope import MRotaryEmbedding
from baryon.layers.rotary import inverse_frequencies, rope_parameters
from baryon.models.qwen3_vl_vision import Qwen3VLVisionModel


class ReadsImages:
    accepts_images = True  # the runner gives it image prompts (runner/image_inputs.py)
    default_mrope_section = (24, 20, 20)  # transformers' where rope_parameters give none (Qwen3-VL's)
    interleaved_mrope = True  # Qwen3-VL's layout of the sections (Qwen2-VL's: one after another)
    deepstack = True  # the tower's DeepStack features feed the first decoder layers (not Qwen3.5's)
    model: nn.Module  # the language model's decoder stack (a LlamaModel)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.visual = self.build_vision_tower(config.vision_config)
        self.mrope = shared_mrope(config, [layer.self_attn for layer in self.model.layers
                                           if hasattr(layer.self_attn, "rotary_emb")], self.default_mrope_section,
                                  self.interleaved_mrope)

    def build_vision_tower(self, vision_config: Any) -> nn.Module:
        """The tower: patches, grids -> (embeddings, DeepStack features); Qwen3-VL's here."""
        return Qwen3VLVisionModel(vision_config, self.deepstack)

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


def shared_mrope(config: Any, attentions: list[nn.Module], default_section: tuple[int, int, int],
                 interleaved: bool) -> MRotaryEmbedding:
    """One multimodal RoPE for every attention layer with a rotary embedding (each held the
    plain table, over its rotary part of the head); the t / h / w split of the frequencies from
    rope_parameters' mrope_section, else default_section."""
    params = rope_parameters(config)
    section = params.get("mrope_section") or default_section
    table = attentions[0].rotary_emb
    inv_freq, scaling = inverse_frequencies(table.cos_sin_cache.shape[-1], params, config.max_position_embeddings)
    mrope = MRotaryEmbedding(table, inv_freq, scaling, list(section), interleaved)
    for attention in attentions:
        attention.rotary_emb = mrope
    return mrope
