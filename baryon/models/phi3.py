"""Phi-3 / Phi-3.5 / Phi-4 (`Phi3ForCausalLM`): Llama layers without biases whose checkpoint
stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (the loader cuts each into its
parts, so tensor parallelism splits them as it splits Llama's), partial rotary (Phi-4-mini),
LongRoPE (`rope_type: longrope`, layers/rotary.py) and a sliding window on every layer where the
config gives one (Phi-3-mini)."""

from __future__ import annotations

from typing import Any

from baryon.models.llama import MistralForCausalLM, head_dim_of


class Phi3ForCausalLM(MistralForCausalLM):
    packed_modules_mapping: dict = {}  # the checkpoint's modules are already the fused ones

    @staticmethod
    def fused_checkpoint_parts(config: Any) -> dict[str, list[tuple[Any, int]]]:
        head_dim = head_dim_of(config)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return {"qkv_proj": [("q", config.num_attention_heads * head_dim), ("k", kv_heads * head_dim),
                             ("v", kv_heads * head_dim)],
                "gate_up_proj": [(0, config.intermediate_size), (1, config.intermediate_size)]}
