"""Image-and-text Qwen checkpoints: Qwen2-VL and Qwen2.5-VL (Qwen2's decoder, their towers in
models/qwen2_vl_vision.py, multimodal RoPE in sections) and Qwen3-VL (Qwen3's decoder, its tower in
models/qwen3_vl_vision.py, interleaved multimodal RoPE), each reading images through
models/image_text.py. The config is the checkpoint's `text_config` (baryon.config.LANGUAGE_MODEL_ONLY,
with the vision settings beside it), the language model's tensors named `model.*` (Qwen2(.5)-VL's
hub layout, the tower's `visual.*`) or `model.language_model.*` (transformers 5's, Qwen3-VL's; the
tower's `model.visual.*`). On text the multimodal RoPE gives every token the same position on its
three axes, which makes it the plain RoPE of the text config.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from baryon.models.image_text import ReadsImages
from baryon.models.qwen2 import Qwen2ForCausalLM
from baryon.models.qwen2_vl_vision import Qwen2VLVisionModel
from baryon.models.qwen3 import Qwen3ForCausalLM

_WEIGHTS_MAPPING = {"model.language_model.": "model.", "model.visual.": "visual."}


class Qwen2VLForConditionalGeneration(ReadsImages, Qwen2ForCausalLM):
    weights_mapping = _WEIGHTS_MAPPING
    default_mrope_section = (16, 24, 24)
    interleaved_mrope = False
    windowed_tower = False

    def build_vision_tower(self, vision_config: Any) -> nn.Module:
        return Qwen2VLVisionModel(vision_config, self.windowed_tower)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (the checkpoint's name)
    windowed_tower = True


class Qwen3VLForConditionalGeneration(ReadsImages, Qwen3ForCausalLM):
    weights_mapping = _WEIGHTS_MAPPING
