"""Image-and-text Qwen checkpoints whose language model baryon serves alone (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL; their vision towers are not loaded and requests carry text only): the config is the
checkpoint's `text_config` (baryon.config.LANGUAGE_MODEL_ONLY), the tensors those of the language
model, named `model.*` (Qwen2(.5)-VL's hub layout) or `model.language_model.*` (transformers 5's,
Qwen3-VL's). Their multimodal RoPE gives every text token the same position on its three axes,
which makes it the plain RoPE of the text config's base: the decoders are Qwen2's and Qwen3's.
"""

from __future__ import annotations

from baryon.models.qwen2 import Qwen2ForCausalLM
from baryon.models.qwen3 import Qwen3ForCausalLM

_WEIGHTS_MAPPING = {"model.language_model.": "model."}
_VISION_PREFIXES = ("visual.", "model.visual.")


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    weights_mapping = _WEIGHTS_MAPPING
    skipped_checkpoint_prefixes = _VISION_PREFIXES


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (the checkpoint's name)
    pass


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    weights_mapping = _WEIGHTS_MAPPING
    skipped_checkpoint_prefixes = _VISION_PREFIXES
