"""Quantized engines against bf16 on a real checkpoint: SmolLM2-135M-Instruct (the built-in
default's weights, dequantized from its GGUF file and saved as a bf16 Hugging Face checkpoint;
576 wide, so one token's activation scale follows 576 values), teacher-forced over 4 chat
prompts x 64 greedy tokens (`tests/agreement.py`), on CPU and, where there is one, a GPU.

Figures (positions that agree of 256; of those where bf16 leads by more than 0.5 nats):

    variant                              CPU (2026-12-02, VM)    H200 (2026-12-02)
    fp8 (e4m3 weights per channel)       242/256, 200/200        225/256, 193/196
    w8a8                                 250/256, 200/200        234/256, 191/196
    fp8 KV cache                         241/256, 198/200        passed its bars
    w4a16 (round-to-nearest, g128)       176/256, 159/200        not run on a GPU yet

On CPU FP8 and INT8 layers multiply float activations by the quantized weights; on a GPU the
activations are rounded per token too (e4m3 / int8), and that rounding moves twice as many
near-ties. Issue 11's 95% bar for online FP8 is not reached at this width on either path; a wrong
scale or a lost layer agrees on almost nothing, which the bars below catch. 4-bit round-to-
nearest (12-14% relative error per matrix) changes the text; calibrated GPTQ / AWQ checkpoints
are what W4A16 serves in practice.
"""

from __future__ import annotations

import pytest
import torch

from agreement import bf16_reference, default_model_checkpoint, greedy_agreement

PROMPTS = ["Explain why the sky is blue.", "Write a short poem about the sea.",
           "What is the capital of France, and what is it known for?", "List three uses of a paperclip."]
# variant -> flags, and per device (overall bar, bar where bf16 is confident)
VARIANTS = {
    "fp8": (dict(quantization="fp8"), {"cpu": (0.9, 0.98), "cuda": (0.85, 0.97)}),
    "w8a8": (dict(quantization="w8a8"), {"cpu": (0.93, 0.99), "cuda": (0.88, 0.95)}),
    "fp8-kv": (dict(kv_cache_dtype="fp8"), {"cpu": (0.9, 0.98), "cuda": (0.9, 0.98)}),
    "w4a16": (dict(quantization="w4a16"), {"cpu": (0.6, 0.7), "cuda": (0.6, 0.7)}),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(checkpoint path, the chat prompts' token ids, {device: its bf16 Reference})."""
    from transformers import AutoTokenizer

    try:
        path = default_model_checkpoint(tmp_path_factory.mktemp("smollm2"))
    except ValueError as e:
        pytest.skip(str(e))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"] for p in PROMPTS]
    return path, prompts, {}


def _engine(device: str) -> dict:
    return dict(device=device, dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_gib=0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_quantized_engine_follows_bf16_on_a_real_model(smollm2, name, device):
    path, prompts, references = smollm2
    if device not in references:
        references[device] = bf16_reference(path, prompts, _engine(device))
    variant, bars = VARIANTS[name]
    overall, confident = bars[device]
    result = greedy_agreement(path, references[device], _engine(device), variant)
    print(f"SmolLM2-135M on {device}, {name}: {result}")
    assert result.total == 4 * 64 and result.confident_total >= 100, result
    assert result.matched / result.total >= overall, f"{name}: {result}"
    assert result.confident_matched / result.confident_total >= confident, f"{name}: {result}"
