"""Qwen2: the Llama decoder with biases on q/k/v (none on o_proj or the MLP)."""

from __future__ import annotations

from typing import Any

from baryon.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}

    @staticmethod
    def mlp_bias(config: Any) -> bool:
        return False
