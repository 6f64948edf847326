"""Qwen3: the Llama decoder with a per-head RMSNorm on queries and keys before RoPE."""

from __future__ import annotations

from typing import Any

from baryon.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}

    @staticmethod
    def mlp_bias(config: Any) -> bool:
        return False
