"""GPT-OSS checkpoints with MXFP4 experts, in the published layout (`experts.gate_up_proj_blocks`
[E, 2I, H / 32, 16] uint8 with gate and up rows interleaved, `..._scales` [E, 2I, H / 32], the
same for down_proj, float biases; `quantization_config: {"quant_method": "mxfp4"}`), written
from a tiny random transformers checkpoint by our MXFP4 quantizer.

- the loaded experts equal the reference dequantization exactly (dequantized at load on CPU; kept
  packed, byte for byte, when the Triton kernels run);
- greedy tokens equal those of the same checkpoint dequantized to float (and transformers on it),
  through the CPU path and through the Triton MXFP4 kernels (in the interpreter on CPU).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baryon import LLM, SamplingParams
from baryon.kernels.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from conftest import cpu_engine_with_triton, hf_greedy, make_checkpoint, random_prompts

ENGINE = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16,
              kv_cache_memory_gib=0.01)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _write(src: Path, dst: Path, tensors: dict, quantization_config: dict | None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    return dst


def mxfp4_checkpoints(src: Path, root: Path) -> tuple[Path, Path, dict]:
    """(the MXFP4 checkpoint, the float checkpoint of its dequantized experts, the published
    [E, N, K / 2] blocks and [E, N, K / 32] scales of each expert tensor)."""
    tensors = load_file(src / "model.safetensors")
    packed, dequantized, published = {}, {}, {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = dequantized[name] = t
            continue
        rows = t.transpose(1, 2)  # [E, N, K]: the published MXFP4 tensors are rows of output features
        blocks, scales = quantize_mxfp4(rows)
        published[name] = (blocks, scales)
        packed[f"{name}_blocks"] = blocks.unflatten(-1, (-1, 16))
        packed[f"{name}_scales"] = scales
        dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2)
    config = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    return (_write(src, root / "mxfp4", packed, config), _write(src, root / "dequantized", dequantized, None),
            published)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    src = make_checkpoint(root / "float", "gpt_oss", seed=7, num_local_experts=4, num_experts_per_tok=2)
    return mxfp4_checkpoints(src, root)


def _gate_then_up(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat((rows[:, 0::2], rows[:, 1::2]), dim=1)


def _layers(llm: LLM):
    return llm.engine.core.runner.model.model.layers


def test_loaded_experts_are_the_reference_dequantization(checkpoints):
    mxfp4, _, published = checkpoints
    llm = LLM(str(mxfp4), **ENGINE)
    for i, layer in enumerate(_layers(llm)):
        experts = layer.mlp.experts
        w13 = dequantize_mxfp4(*published[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        w2 = dequantize_mxfp4(*published[f"model.layers.{i}.mlp.experts.down_proj"])
        assert torch.equal(experts.w13_weight, _gate_then_up(w13))  # CPU: dequantized at load
        assert torch.equal(experts.w2_weight, w2)


def test_greedy_tokens_equal_the_dequantized_checkpoint(checkpoints):
    mxfp4, dequantized, _ = checkpoints
    prompts = random_prompts(3, 128, 5, 20, 11)
    expected = [o.outputs[0].token_ids for o in LLM(str(dequantized), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in LLM(str(mxfp4), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    assert got == expected
    assert expected[0] == hf_greedy(dequantized, prompts[0], GREEDY.max_tokens)[0]


@cpu_engine_with_triton
def test_triton_mxfp4_kernels_keep_experts_packed_and_agree(checkpoints, monkeypatch):
    mxfp4, dequantized, published = checkpoints
    monkeypatch.setenv("BARYON_KERNEL_FUSED_MOE_MXFP4", "triton")
    llm = LLM(str(mxfp4), **ENGINE)
    layer = _layers(llm)[0].mlp.experts
    blocks, scales = published["model.layers.0.mlp.experts.gate_up_proj"]
    assert layer.w13_blocks.dtype == torch.uint8 and not hasattr(layer, "w13_weight")
    assert torch.equal(layer.w13_blocks, _gate_then_up(blocks)) and torch.equal(layer.w13_scales, _gate_then_up(scales))
    prompts = random_prompts(2, 128, 5, 12, 12)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    expected = [o.outputs[0].token_ids for o in LLM(str(dequantized), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == expected


def test_bf16_experts_in_an_mxfp4_config_are_refused_by_name(checkpoints, tmp_path):
    """An MXFP4 config whose experts were published in float: the unexpected float tensor is named."""
    _, dequantized, _ = checkpoints
    broken = _write(dequantized, tmp_path / "mislabelled", load_file(dequantized / "model.safetensors"),
                    {"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match=r"unexpected tensor .*experts\.(gate_up|down)_proj"):
        LLM(str(broken), **ENGINE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mxfp4_on_gpu_matches_the_dequantized_checkpoint(checkpoints):
    """On a GPU (float32, CUDA graphs): the packed MXFP4 Triton kernels give the tokens of the
    float kernels on the dequantized checkpoint."""
    mxfp4, dequantized, _ = checkpoints
    engine = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_memory_gib=0.5)
    prompts = random_prompts(6, 128, 3, 40, 13)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for path in (mxfp4, dequantized):
        llm = LLM(str(path), **engine)
        kernel = _layers(llm)[0].mlp.experts.method.kernel
        assert kernel.name == "triton" and kernel.family == ("fused_moe_mxfp4" if path == mxfp4 else "fused_moe")
        runs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                  params, use_tqdm=False)])
    assert runs[0] == runs[1]
