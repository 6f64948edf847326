"""Lazy model registry: Hugging Face `architectures[0]` -> "module:Class", imported on first use."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "baryon.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "baryon.models.llama:MistralForCausalLM",
    "Phi3ForCausalLM": "baryon.models.phi3:Phi3ForCausalLM",
    "GemmaForCausalLM": "baryon.models.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "baryon.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "baryon.models.gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "baryon.models.gemma3:Gemma3ForConditionalGeneration",
    "CohereForCausalLM": "baryon.models.cohere:CohereForCausalLM",
    "Olmo2ForCausalLM": "baryon.models.olmo2:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": "baryon.models.olmo2:Olmo3ForCausalLM",
    "GraniteForCausalLM": "baryon.models.granite:GraniteForCausalLM",
    "SmolLM3ForCausalLM": "baryon.models.smollm3:SmolLM3ForCausalLM",
    "Qwen2ForCausalLM": "baryon.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "baryon.models.qwen3:Qwen3ForCausalLM",
    "Qwen2VLForConditionalGeneration": "baryon.models.vision_language:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "baryon.models.vision_language:Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "baryon.models.vision_language:Qwen3VLForConditionalGeneration",
    "Qwen2MoeForCausalLM": "baryon.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "baryon.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM": "baryon.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "baryon.models.qwen3_next:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "baryon.models.qwen3_next:Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration": "baryon.models.qwen3_next:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration": "baryon.models.qwen3_next:Qwen3_5MoeForConditionalGeneration",
    "MixtralForCausalLM": "baryon.models.mixtral:MixtralForCausalLM",
    "Glm4MoeForCausalLM": "baryon.models.glm4_moe:Glm4MoeForCausalLM",
    "DeepseekV2ForCausalLM": "baryon.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "baryon.models.deepseek_v2:DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": "baryon.models.deepseek_v32:DeepseekV32ForCausalLM",
    "GptOssForCausalLM": "baryon.models.gpt_oss:GptOssForCausalLM",
    # EAGLE-3 draft heads (speculative decoding), under both published architecture names
    "LlamaForCausalLMEagle3": "baryon.models.eagle3:Eagle3LlamaForCausalLM",
    "Eagle3LlamaForCausalLM": "baryon.models.eagle3:Eagle3LlamaForCausalLM",
    # not a published architecture: a checkpoint's MTP layers as a draft (config.mtp_draft_config)
    "DeepseekMTP": "baryon.models.deepseek_mtp:DeepseekMTP",
    "Qwen3NextMTP": "baryon.models.qwen3_next_mtp:Qwen3NextMTP",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} (config.json 'architectures') is not supported; "
                         f"supported: {supported_architectures()}")
    module, name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), name)
