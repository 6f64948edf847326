"""The CPU decoder layer in one C++ call (layers/fused_decoder_layer.py, kernels/cpu/decoder_layer.cpp)
against the same layers run module by module: the op calls the very kernels the modules call, so
greedy tokens and their logprobs must be bit-identical, over batches that mix prefill chunks and
decodes. Layers the op does not cover keep the module path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from baryon import LLM, SamplingParams
from baryon.kernels.cpu import load_error
from conftest import make_checkpoint, random_prompts
from test_gguf import QUANT_CONFIG, random_llama_tensors, write_gguf

pytestmark = pytest.mark.skipif(load_error() is not None, reason=f"C++ CPU kernels unavailable: {load_error()}")
NUM_NEW = 12


def load(path: str, monkeypatch, force: str | None = None, **engine) -> LLM:
    """The engine with the decoder_layer kernel forced to `force`."""
    with monkeypatch.context() as patch:
        if force:
            patch.setenv("BARYON_KERNEL_DECODER_LAYER", force)
        return LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.05,
                   max_num_batched_tokens=64, **engine)


def generate(path: str, prompts: list[list[int]], monkeypatch, force: str | None = None, **engine):
    """(fused layer count, [(tokens, logprobs)] per prompt) with the decoder_layer kernel forced to `force`."""
    return run(load(path, monkeypatch, force, **engine), prompts)


def run(llm: LLM, prompts: list[list[int]]):
    """(fused layer count, [(tokens, logprobs)] per prompt)."""
    layers = llm.engine.core.runner.model.model.layers
    fused = sum(getattr(layer, "fused", None) is not None for layer in layers)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for out in outputs:
        sample = out.outputs[0]
        results.append((sample.token_ids, [e[t].logprob for e, t in zip(sample.logprobs, sample.token_ids)]))
    return fused, results


CASES = [
    ("llama-gqa", "llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    ("qwen2-qkv-bias", "qwen2", {}),
    ("qwen3-qk-norm", "qwen3", dict(head_dim=32)),
    ("mistral-window", "mistral", dict(sliding_window=8)),
]


@pytest.mark.parametrize("name,arch,overrides", CASES, ids=[c[0] for c in CASES])
def test_fused_layer_is_bit_identical_to_the_modules(tmp_path, monkeypatch, seed, name, arch, overrides):
    ckpt = make_checkpoint(tmp_path / name, arch, seed=seed, **overrides)
    prompts = random_prompts(5, 128, 3, 90, seed)  # 64-token budget: long prompts prefill in chunks beside decodes
    fused, got = generate(str(ckpt), prompts, monkeypatch)
    modules, expected = generate(str(ckpt), prompts, monkeypatch, force="modules")
    assert fused == 2 and modules == 0
    assert got == expected


@pytest.mark.parametrize("block_quant", ["cpu_int8", "cpu_float32"])
def test_fused_layer_on_the_default_model(smol_path, monkeypatch, seed, block_quant):
    """Packed GGUF weights on either block-quant kernel: the fused layer equals the modules."""
    from baryon.kernels.block_quant import CpuInt8BlockQuantLinear

    if block_quant == "cpu_int8" and CpuInt8BlockQuantLinear.unsupported_reason(torch.device("cpu")):
        pytest.skip("no integer-dot kernel on this CPU")
    monkeypatch.setenv("BARYON_KERNEL_BLOCK_QUANT_LINEAR", block_quant)
    prompts = random_prompts(3, 49152, 5, 70, seed)
    fused, got = generate(smol_path, prompts, monkeypatch, max_model_len=128)
    modules, expected = generate(smol_path, prompts, monkeypatch, force="modules", max_model_len=128)
    assert fused == 30 and modules == 0
    assert got == expected


@pytest.mark.parametrize("quantization", ["w8a8", "w4a16"])
@pytest.mark.parametrize("block_quant", ["cpu_int8", "cpu_float32"])
def test_fused_layer_on_repacked_int8_and_w4a16(tmp_path, monkeypatch, seed, quantization, block_quant):
    """W8A8 / W4A16 layers repacked into the GGUF blocks on CPU: the fused layer equals the modules."""
    from baryon.kernels.block_quant import CpuInt8BlockQuantLinear

    if block_quant == "cpu_int8" and CpuInt8BlockQuantLinear.unsupported_reason(torch.device("cpu")):
        pytest.skip("no integer-dot kernel on this CPU")
    monkeypatch.setenv("BARYON_KERNEL_BLOCK_QUANT_LINEAR", block_quant)
    monkeypatch.setenv("BARYON_KERNEL_INT8_LINEAR", "cpu")  # not zentorch, where it is installed
    ckpt = make_checkpoint(tmp_path / "llama", "llama", seed=seed, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts(4, 128, 3, 90, seed)
    fused, got = generate(str(ckpt), prompts, monkeypatch, quantization=quantization)
    modules, expected = generate(str(ckpt), prompts, monkeypatch, force="modules", quantization=quantization)
    assert fused == 2 and modules == 0
    assert got == expected


@pytest.mark.parametrize("block_quant", ["cpu_int8", "cpu_float32"])
def test_fused_layer_on_q6_k_gguf(tmp_path, monkeypatch, seed, block_quant):
    """Q6_K matrices stay packed (bits 6, a scale per 16 weights) and the fused layer runs them:
    it equals the modules."""
    from baryon.kernels.block_quant import CpuInt8BlockQuantLinear

    if block_quant == "cpu_int8" and CpuInt8BlockQuantLinear.unsupported_reason(torch.device("cpu")):
        pytest.skip("no integer-dot kernel on this CPU")
    monkeypatch.setenv("BARYON_KERNEL_BLOCK_QUANT_LINEAR", block_quant)
    rng = np.random.default_rng(seed)
    tensors = {name: array * 0.1 for name, array in random_llama_tensors(rng).items()}
    config = {**QUANT_CONFIG, "max_position_embeddings": 256}  # long prompts prefill in chunks beside decodes
    write_gguf(tmp_path / "q6_k.gguf", "llama", config, tensors, GGMLQuantizationType.Q6_K, rng)
    prompts = random_prompts(4, config["vocab_size"], 3, 90, seed)
    llm = load(str(tmp_path / "q6_k.gguf"), monkeypatch)
    layer = llm.engine.core.runner.model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.weight.dtype == torch.uint8 and linear.method.bits == 6
        assert linear.method.kernel.name == block_quant
    fused, got = run(llm, prompts)
    modules, expected = generate(str(tmp_path / "q6_k.gguf"), prompts, monkeypatch, force="modules")
    assert fused == 1 and modules == 0
    assert got == expected


def test_uncovered_layers_keep_the_modules(tmp_path, monkeypatch, seed):
    """MoE blocks are not fused; an fp8 KV cache falls back to the modules at run time, with the
    modules' results."""
    moe = make_checkpoint(tmp_path / "moe", "qwen3_moe", seed=seed)
    prompts = random_prompts(2, 128, 3, 20, seed)
    fused, _ = generate(str(moe), prompts, monkeypatch)
    assert fused == 0
    dense = make_checkpoint(tmp_path / "dense", "llama", seed=seed)
    fused, got = generate(str(dense), prompts, monkeypatch, kv_cache_dtype="fp8")
    _, expected = generate(str(dense), prompts, monkeypatch, force="modules", kv_cache_dtype="fp8")
    assert fused == 2 and got == expected
