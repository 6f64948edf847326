"""bitsandbytes checkpoints as transformers saves them (4-bit NF4 / FP4 with and without double
quantization, LLM.int8 8-bit), written here with the bitsandbytes package's own quantizers: the
engine dequantizes each weight at load to exactly what bitsandbytes' dequantizer gives, so it
generates as the float checkpoint of those weights does (dense, MoE, two tensor-parallel ranks),
and a checkpoint missing a part of a quantized weight fails naming it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import quant_checkpoints as qc
from baryon import LLM, SamplingParams
from conftest import make_checkpoint, random_prompts

bnb_functional = pytest.importorskip("bitsandbytes.functional", reason="the bitsandbytes package writes the checkpoints")

ENGINE = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.01)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
WIDE = dict(hidden_size=128, intermediate_size=256)  # every weight a multiple of 64 values a row
QUANTIZED = re.compile(qc.QUANTIZED_LINEAR.pattern)


def _bnb_checkpoint(src: Path, dst: Path, four_bit: bool, quant_type: str = "nf4", double_quant: bool = True,
                    blocksize: int = 64) -> tuple[Path, Path]:
    """(the bitsandbytes checkpoint of `src`'s decoder linears, the float checkpoint of their
    dequantized weights as bitsandbytes' own dequantizers give them)."""
    state = qc.load_float(src)
    out, reference = {}, dict(state)
    for name, w in state.items():
        if not QUANTIZED.match(name):
            continue
        module = name[: -len(".weight")]
        if four_bit:
            codes, quant_state = bnb_functional.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type,
                                                              compress_statistics=double_quant)
            out[name] = codes  # uint8 [N * K / 2, 1]
            out.update({f"{name}.{key}": value for key, value in quant_state.as_dict(packed=True).items()})
            reference[name] = bnb_functional.dequantize_4bit(codes, quant_state).float()
        else:
            codes, scales, _ = bnb_functional.int8_vectorwise_quant(w)
            out[name], out[f"{module}.SCB"] = codes, scales
            out[f"{module}.weight_format"] = torch.tensor(0, dtype=torch.uint8)
            reference[name] = bnb_functional.int8_vectorwise_dequant(codes, scales).float()
    out.update({k: v for k, v in state.items() if k not in out})
    config = {"quant_method": "bitsandbytes", "load_in_4bit": four_bit, "load_in_8bit": not four_bit,
              "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": double_quant,
              "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8",
              "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0}
    path = qc.write_checkpoint(src, dst, out, config)
    return path, qc.write_checkpoint(src, dst.with_name(dst.name + "-reference"), reference, None)


def _greedy(path: Path, prompts, **engine) -> list[tuple[list[int], list[float]]]:
    with LLM(str(path), **ENGINE, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("arch,four_bit,quant_type,double_quant", [
    ("llama", True, "nf4", True), ("llama", True, "nf4", False), ("qwen3", True, "fp4", True),
    ("llama", False, None, None), ("qwen3_moe", True, "nf4", True)],
    ids=["nf4-double", "nf4", "fp4-double", "int8", "nf4-double-moe"])
def test_bnb_checkpoint_generates_as_its_dequantized_weights(tmp_path, seed, arch, four_bit, quant_type,
                                                            double_quant):
    overrides = dict(WIDE, head_dim=32) if arch != "qwen3_moe" else dict(hidden_size=128, head_dim=32,
                                                                         moe_intermediate_size=64)
    src = make_checkpoint(tmp_path / "float", arch, seed=seed % 2**31, **overrides)
    path, reference = _bnb_checkpoint(src, tmp_path / "bnb", four_bit, quant_type or "nf4", bool(double_quant))
    with LLM(str(path), **ENGINE) as llm:  # the weights as held: bitsandbytes' dequantization, exactly
        o_proj = llm.engine.core.runner.model.model.layers[1].self_attn.o_proj.weight
        want = qc.load_float(reference)["model.layers.1.self_attn.o_proj.weight"]
        assert torch.equal(o_proj, want)
        assert not torch.equal(want, qc.load_float(src)["model.layers.1.self_attn.o_proj.weight"])  # rounded
    prompts = random_prompts(4, 128, 3, 12, seed)
    expected, got = _greedy(reference, prompts), _greedy(path, prompts)
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(expected, got):
        assert tokens2 == tokens1
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2)) < 1e-5
    if arch == "llama" and double_quant:  # the dequantized weights split over two ranks like float ones
        assert [t for t, _ in _greedy(path, prompts, tensor_parallel_size=2)] == [t for t, _ in expected]


def test_bnb_checkpoint_missing_a_part_fails_naming_it(tmp_path, seed):
    from safetensors.torch import load_file

    src = make_checkpoint(tmp_path / "float", "llama", seed=seed % 2**31, **WIDE)
    path, _ = _bnb_checkpoint(src, tmp_path / "bnb", True)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight.absmax"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj.*\['absmax'\]"):
        LLM(str(path), **ENGINE)


def test_bnb_configs_it_cannot_read_are_refused(tmp_path):
    src = make_checkpoint(tmp_path / "float", "llama", seed=1, **WIDE)
    for config, message in (({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"},
                             "bnb_4bit_quant_storage='bfloat16'.*supported: uint8"),
                            ({"quant_method": "bitsandbytes"}, "load_in_4bit and load_in_8bit")):
        path = qc.write_checkpoint(src, tmp_path / json.dumps(len(message)), qc.load_float(src), config)
        with pytest.raises(ValueError, match=message):
            LLM(str(path), **ENGINE)
