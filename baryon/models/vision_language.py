"""Image-and-text Qwen checkpoints. Qwen3-VL reads images (models/image_text.py: its vision tower and
multimodal RoPE beside Qwen3's decoder); Qwen2-VL and Qwen2.5-VL serve their language model alone
(vision towers not loaded; requests carry text only). The config is the checkpoint's `text_config`
(baryon.config.LANGUAGE_MODEL_ONLY, with the vision settings beside it where the model reads
images), the language model's tensors named `model.*` (Qwen2(.5)-VL's hub layout) or
`model.language_model.*` (transformers 5's, Qwen3-VL's). On text the multimodal RoPE gives every
token the same position on its three axes, which makes it the plain RoPE of the text config.
"""

from __future__ import annotations

from baryon.models.image_text import ReadsImages
from baryon.models.qwen2 import Qwen2ForCausalLM
from baryon.models.qwen3 import Qwen3ForCausalLM

_WEIGHTS_MAPPING = {"model.language_model.": "model."}
_VISION_PREFIXES = ("visual.", "model.visual.")


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    weights_mapping = _WEIGHTS_MAPPING
    skipped_checkpoint_prefixes = _VISION_PREFIXES


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (the checkpoint's name)
    pass


class Qwen3VLForConditionalGeneration(ReadsImages, Qwen3ForCausalLM):
    weights_mapping = {**_WEIGHTS_MAPPING, "model.visual.": "visual."}
