"""Built-in model presets for benchmarks: the configs of published checkpoints, without weights.

`resolve_model("qwen3-8b")` writes the preset's config.json into a cache folder and returns it, so
`LLM(folder, load_format="dummy", skip_tokenizer_init=True)` builds the real architecture with
random weights and no download. Any other value is returned unchanged (a path or repo id).

The folder also gets a synthetic tokenizer covering the whole vocabulary (token i is the word
`t<i>`), so a server can run a preset with dummy weights offline and still tokenize, detokenize
and stream text: `baryon serve $(python -m baryon.bench.presets qwen3-0.6b) --load-format dummy`.
"""

from __future__ import annotations

import json
import os
import tempfile

_QWEN3_COMMON = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, head_dim=128,
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
    attention_bias=False, attention_dropout=0.0, torch_dtype="bfloat16", bos_token_id=151643,
    eos_token_id=151645, use_sliding_window=False, sliding_window=None, max_window_layers=28,
)

PRESETS: dict[str, dict] = {
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    # Qwen/Qwen3-8B
    "qwen3-8b": dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, max_window_layers=36),
    # Qwen/Qwen3-30B-A3B: 48 layers, each a mixture of 128 experts (top-8, renormalised)
    "qwen3-30b-a3b": dict(_QWEN3_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, tie_word_embeddings=False, max_window_layers=48,
                          decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768,
                          norm_topk_prob=True, num_experts=128, num_experts_per_tok=8,
                          output_router_logits=False, router_aux_loss_coef=0.001),
    # deepseek-ai/DeepSeek-V2-Lite (../shared/configs/deepseek-v2-lite.json): 27 layers of latent
    # attention (rank 512, no query compression), the first dense, then 64 experts (top-6) + 2 shared
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", attention_bias=False,
        attention_dropout=0.0, aux_loss_alpha=0.001, bos_token_id=100000, eos_token_id=100001,
        first_k_dense_replace=1, hidden_act="silu", hidden_size=2048, initializer_range=0.02,
        intermediate_size=10944, kv_lora_rank=512, max_position_embeddings=163840, moe_intermediate_size=1408,
        moe_layer_freq=1, n_group=1, n_routed_experts=64, n_shared_experts=2, norm_topk_prob=False,
        num_attention_heads=16, num_experts_per_tok=6, num_hidden_layers=27, num_key_value_heads=16,
        pretraining_tp=1, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-6,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 4096, "type": "yarn"},
        rope_theta=10000, routed_scaling_factor=1.0, scoring_func="softmax", seq_aux=True, tie_word_embeddings=False,
        topk_group=1, topk_method="greedy", torch_dtype="bfloat16", use_cache=True, v_head_dim=128,
        vocab_size=102400),
    # meta-llama/Llama-3.1-8B-Instruct: 32 layers, GQA 32/8, a 128k context through llama3 RoPE scaling
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, attention_dropout=0.0,
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009], head_dim=128, hidden_act="silu",
        hidden_size=4096, initializer_range=0.02, intermediate_size=14336, max_position_embeddings=131072,
        mlp_bias=False, num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, pretraining_tp=1,
        rms_norm_eps=1e-05,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, vocab_size=128256),
    # Qwen/Qwen3-8B with YaRN to 131,072 tokens, as its model card extends it (factor 4 over 32,768)
    "qwen3-8b-yarn": dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, max_window_layers=36,
                          max_position_embeddings=131072,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    # deepseek-ai/DeepSeek-V3 (its published config.json, issue 16): 61 layers of latent attention (128
    # heads, query rank 1536, KV rank 512), the first 3 dense, then 256 routed experts (top-8, grouped
    # noaux_tc routing) + 1 shared; FP8 128x128 block weights. Fewer layers for one or two GPUs:
    # --hf-overrides '{"num_hidden_layers": 4}'.
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", attention_bias=False,
        attention_dropout=0.0, aux_loss_alpha=0.001, bos_token_id=0, eos_token_id=1, ep_size=1,
        first_k_dense_replace=3, hidden_act="silu", hidden_size=7168, initializer_range=0.02,
        intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840, moe_intermediate_size=2048,
        moe_layer_freq=1, n_group=8, n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128,
        num_nextn_predict_layers=1, pretraining_tp=1, q_lora_rank=1536, qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                             "weight_block_size": [128, 128]},
        rms_norm_eps=1e-6,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"},
        rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", seq_aux=True,
        tie_word_embeddings=False, topk_group=4, topk_method="noaux_tc", torch_dtype="bfloat16", use_cache=True,
        v_head_dim=128, vocab_size=129280),
    # google/gemma-2-9b-it: 42 layers alternating a 4,096-token window and full attention (16 heads of
    # 256, 8 KV heads), soft-capped attention scores (50) and final logits (30), a 256k vocabulary
    "gemma-2-9b": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", attention_bias=False, attention_dropout=0.0,
        attn_logit_softcapping=50.0, bos_token_id=2, eos_token_id=[1, 107], final_logit_softcapping=30.0,
        head_dim=256, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", hidden_size=3584,
        initializer_range=0.02, intermediate_size=14336, max_position_embeddings=8192, num_attention_heads=16,
        num_hidden_layers=42, num_key_value_heads=8, pad_token_id=0, query_pre_attn_scalar=256, rms_norm_eps=1e-06,
        rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True,
        vocab_size=256000),
    # openai/gpt-oss-20b (../shared/configs/gpt-oss-20b.json): 24 layers alternating a 128-token
    # sliding window and full attention (64 heads of 64, 8 KV heads, sinks), 32 MXFP4 experts (top-4)
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True, attention_dropout=0.0,
        eos_token_id=200002, experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880,
        initial_context_length=4096, initializer_range=0.02, intermediate_size=2880,
        layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
        num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24, num_key_value_heads=8,
        num_local_experts=32, output_router_logits=False, pad_token_id=199999,
        quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                        "model.embed_tokens", "lm_head"],
                             "quant_method": "mxfp4"},
        rms_norm_eps=1e-05,
        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                      "rope_type": "yarn", "truncate": False},
        rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
        torch_dtype="bfloat16", use_cache=True, vocab_size=201088),
    # Qwen/Qwen3-Next-80B-A3B-Instruct: 48 layers, three Gated DeltaNet layers (16 key heads, 32
    # value heads of 128) to one gated full attention layer (16 heads of 256, 2 KV heads, RoPE on a
    # quarter), each with 512 experts (top-10, renormalised) + a gated shared expert. 160 GB in bf16:
    # one H200 runs it with --hf-overrides '{"num_hidden_layers": 24}'.
    "qwen3-next-80b-a3b": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", attention_bias=False, attention_dropout=0.0,
        bos_token_id=151643, decoder_sparse_step=1, eos_token_id=151645, full_attention_interval=4, head_dim=256,
        hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=5120,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_value_head_dim=128, max_position_embeddings=262144, mlp_only_layers=[], moe_intermediate_size=512,
        norm_topk_prob=True, num_attention_heads=16, num_experts=512, num_experts_per_tok=10, num_hidden_layers=48,
        num_key_value_heads=2, output_router_logits=False, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
        rope_scaling=None, rope_theta=10000000, router_aux_loss_coef=0.001, shared_expert_intermediate_size=512,
        tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, use_sliding_window=False,
        vocab_size=151936),
    # Qwen/Qwen3-VL-8B-Instruct: Qwen3-8B's decoder under interleaved multimodal RoPE, a 27-block
    # vision tower (1152 wide, 16 x 16 patches, 2 x 2 merged into one token) with DeepStack
    # features from blocks 8, 16 and 24 into the first three decoder layers
    "qwen3-vl-8b": dict(
        architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl", image_token_id=151655,
        video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=False,
        text_config=dict(
            model_type="qwen3_vl_text", attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
            eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=4096, initializer_range=0.02,
            intermediate_size=12288, max_position_embeddings=262144, num_attention_heads=32, num_hidden_layers=36,
            num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=5000000, dtype="bfloat16", vocab_size=151936,
            rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}),
        vision_config=dict(
            model_type="qwen3_vl", deepstack_visual_indexes=[8, 16, 24], depth=27, hidden_act="gelu_pytorch_tanh",
            hidden_size=1152, in_channels=3, initializer_range=0.02, intermediate_size=4304, num_heads=16,
            num_position_embeddings=2304, out_hidden_size=4096, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2),
        torch_dtype="bfloat16"),
    # Qwen/Qwen2.5-VL-7B-Instruct: Qwen2's 28-layer decoder (GQA 28 / 4) under multimodal RoPE in
    # sections, a 32-block vision tower (1280 wide, 14 x 14 patches, window attention over 112-pixel
    # windows but in blocks 7, 15, 23, 31)
    "qwen2.5-vl-7b": dict(
        architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", image_token_id=151655,
        video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=False,
        text_config=dict(
            model_type="qwen2_5_vl_text", attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645,
            hidden_act="silu", hidden_size=3584, initializer_range=0.02, intermediate_size=18944,
            max_position_embeddings=128000, max_window_layers=28, num_attention_heads=28, num_hidden_layers=28,
            num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=32768,
            use_sliding_window=False, dtype="bfloat16", vocab_size=152064,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision_config=dict(
            model_type="qwen2_5_vl", depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420,
            num_heads=16, in_channels=3, out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        torch_dtype="bfloat16"),
}

# The image processors of the image-and-text presets (their preprocessor_config.json).
PREPROCESSORS: dict[str, dict] = {
    "qwen2.5-vl-7b": dict(image_processor_type="Qwen2VLImageProcessor", patch_size=14, merge_size=2,
                          temporal_patch_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073],
                          image_std=[0.26862954, 0.26130258, 0.27577711], min_pixels=3136, max_pixels=12845056),
    "qwen3-vl-8b": dict(image_processor_type="Qwen2VLImageProcessor", patch_size=16, merge_size=2,
                        temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                        size={"longest_edge": 16777216, "shortest_edge": 65536}),
}


def resolve_model(model: str) -> str:
    if model not in PRESETS:
        return model
    folder = os.path.join(tempfile.gettempdir(), "baryon-presets", model)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(PRESETS[model], f, indent=1)
    if model in PREPROCESSORS:
        with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
            json.dump(PREPROCESSORS[model], f, indent=1)
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        _write_synthetic_tokenizer(folder, PRESETS[model].get("text_config", PRESETS[model]))
    return folder


def _write_synthetic_tokenizer(folder: str, config: dict) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0",
                                   bos_token=f"t{config.get('bos_token_id', config['eos_token_id'])}", eos_token=f"t{config['eos_token_id']}")
    fast.save_pretrained(folder)


if __name__ == "__main__":
    import sys

    print(resolve_model(sys.argv[1]))
