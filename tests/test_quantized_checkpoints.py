"""Quantized checkpoints: FP8 (per-tensor and block), compressed-tensors, GPTQ and AWQ, and
quantizing a float checkpoint at load (quantization="fp8" / "w8a8" / "w4a16").

The checkpoints are written by tests/quant_checkpoints.py in each format's published layout from
tiny random transformers models, together with the float weights they stand for (dequantized from
the tensors as written). On CPU every quantized method computes "dequantize the weight, then
F.linear", so loading a quantized checkpoint in float32 must give exactly the greedy tokens of the
float checkpoint holding the dequantized weights, and each layer must hold exactly those weights.
Broken checkpoints (a scale missing or mis-shaped), unsupported methods or schemes and a
`quantization=` argument that contradicts the checkpoint are refused with errors naming them.

The builders are checked on their own too (no engine): their float references are within the
quantization error of the original weights, and independent readers of the formats
(transformers for compressed-tensors and block FP8, compressed-tensors' AutoAWQ converter for
AWQ, AutoGPTQ's own unpacking for GPTQ) read the same weights back.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import quant_checkpoints as qc
from baryon import LLM, SamplingParams
from conftest import TEST_SEED, make_checkpoint, random_prompts

# Token-for-token comparisons with float checkpoints: the exact packed CPU kernel.
pytestmark = pytest.mark.usefixtures("exact_packed_kernels")

NUM_NEW = 16
VOCAB = 128
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
ENGINE = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.01)
QWEN3 = dict(head_dim=32)  # (Qwen3's default head_dim is 128)
WIDE = dict(hidden_size=128, intermediate_size=256)  # room for groups of 128 (head_dim 32)
NOT_CONVERTED = "model.layers.1.mlp.down_proj"  # the module a modules_to_not_convert case keeps bf16
BA = ("model.layers.0.linear_attn.in_proj_ba", "model.layers.2.linear_attn.in_proj_ba")  # (Qwen3-Next's)


@dataclass(frozen=True)
class Case:
    id: str
    arch: str
    overrides: dict
    build: Callable  # (src, dst, seed) -> qc.QuantizedCheckpoint
    fmt: str  # the format's name for quantization=
    bits: int | None = None  # integer formats: weight bits (else FP8)
    victims: tuple[str, ...] = ()  # scale / zero / g_idx tensors the broken-checkpoint tests remove / mis-shape


def _ct(preset, **kw):
    ignore = kw.pop("ignore", None)
    kv_cache = kw.pop("kv_cache", False)
    dtype = kw.pop("dtype", torch.float32)
    return lambda src, dst, seed: qc.compressed_tensors(src, dst, qc.ct_scheme(preset, **kw), ignore=ignore,
                                                        kv_cache=kv_cache, dtype=dtype, seed=seed)


CASES = [
    # FP8, AutoFP8 / vLLM per-tensor layout.
    Case("fp8-tensor-static-llama", "llama", {}, lambda s, d, seed: qc.fp8_per_tensor(s, d, "static", seed), "fp8",
         victims=("model.layers.0.self_attn.k_proj.weight_scale",)),
    Case("fp8-tensor-dynamic-qwen3", "qwen3", QWEN3, lambda s, d, seed: qc.fp8_per_tensor(s, d, "dynamic", seed),
         "fp8", victims=("model.layers.1.mlp.down_proj.weight_scale",)),
    # Phi-3: q/k/v and gate/up fused in the checkpoint, one scale each (cut into the engine's parts).
    Case("fp8-tensor-static-phi3", "phi3", {}, lambda s, d, seed: qc.fp8_per_tensor(s, d, "static", seed), "fp8",
         victims=("model.layers.0.self_attn.qkv_proj.weight_scale",)),
    Case("fp8-tensor-static-qwen3moe", "qwen3_moe", {}, lambda s, d, seed: qc.fp8_per_tensor(s, d, "static", seed),
         "fp8", victims=("model.layers.1.mlp.experts.2.up_proj.weight_scale",)),
    # FP8 with block scales, DeepSeek-V3 / Qwen3-FP8 layout.
    Case("fp8-block32-llama", "llama", {}, lambda s, d, seed: qc.fp8_block(s, d, (32, 32)), "fp8",
         victims=("model.layers.1.mlp.up_proj.weight_scale_inv",)),
    Case("fp8-block32x64-partial-k-llama", "llama", {}, lambda s, d, seed: qc.fp8_block(s, d, (32, 64)), "fp8",
         victims=("model.layers.0.mlp.down_proj.weight_scale_inv",)),
    Case("fp8-block16-bf16-scales-qwen3", "qwen3", QWEN3,
         lambda s, d, seed: qc.fp8_block(s, d, (16, 16), scale_dtype=torch.bfloat16, dense_dtype=torch.bfloat16),
         "fp8"),
    Case("fp8-block32-not-convert-bf16-llama", "llama", {},
         lambda s, d, seed: qc.fp8_block(s, d, (32, 32), dense_dtype=torch.bfloat16, not_convert=(NOT_CONVERTED,)),
         "fp8"),
    Case("fp8-block16-tied-qwen3", "qwen3", {**QWEN3, "tie_word_embeddings": True},
         lambda s, d, seed: qc.fp8_block(s, d, (16, 16)), "fp8"),
    Case("fp8-block16-qwen3moe", "qwen3_moe", {}, lambda s, d, seed: qc.fp8_block(s, d, (16, 16)), "fp8",
         victims=("model.layers.0.mlp.experts.3.down_proj.weight_scale_inv",
                  "model.layers.1.self_attn.q_proj.weight_scale_inv")),
    Case("fp8-block16-deepseekv3", "deepseek_v3", {}, lambda s, d, seed: qc.fp8_block(s, d, (16, 16)), "fp8",
         victims=("model.layers.1.self_attn.kv_b_proj.weight_scale_inv",
                  "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv")),
    # V3.2: the indexer's wq_b / wk in FP8 blocks, its weights_proj in float (as published); 8 x 8 blocks:
    # transformers' dequantizer (the oracle below) takes only whole blocks, and kv_a is 40 rows here
    Case("fp8-block8-deepseekv32", "deepseek_v32", {}, lambda s, d, seed: qc.fp8_block(s, d, (8, 8)), "fp8",
         victims=("model.layers.1.self_attn.indexer.wk.weight_scale_inv",
                  "model.layers.0.self_attn.indexer.wq_b.weight_scale_inv")),
    # compressed-tensors, written by the compressed_tensors package.
    Case("ct-fp8-static-llama", "llama", {}, _ct("FP8"), "compressed-tensors",
         victims=("model.layers.0.self_attn.v_proj.weight_scale",)),
    Case("ct-fp8-dynamic-kv-cache-llama", "llama", {}, _ct("FP8_DYNAMIC", kv_cache=True), "compressed-tensors",
         victims=("model.layers.1.mlp.gate_proj.weight_scale",)),
    Case("ct-fp8-dynamic-qwen2-bias", "qwen2", {}, _ct("FP8_DYNAMIC"), "compressed-tensors"),
    Case("ct-fp8-dynamic-qwen3moe", "qwen3_moe", {}, _ct("FP8_DYNAMIC"), "compressed-tensors",
         victims=("model.layers.1.mlp.experts.5.up_proj.weight_scale",)),
    Case("ct-fp8-static-qwen3moe", "qwen3_moe", {}, _ct("FP8"), "compressed-tensors",
         victims=("model.layers.0.mlp.experts.1.down_proj.weight_scale",)),
    Case("ct-fp8-block32-llama", "llama", {}, _ct("FP8_BLOCK", block_structure=[32, 32]), "compressed-tensors",
         victims=("model.layers.0.self_attn.k_proj.weight_scale",)),
    Case("ct-fp8-block16-qwen3moe", "qwen3_moe", {}, _ct("FP8_BLOCK", block_structure=[16, 16]),
         "compressed-tensors", victims=("model.layers.1.mlp.experts.2.gate_proj.weight_scale",)),
    Case("ct-w8a8-int8-qwen3", "qwen3", QWEN3, _ct("W8A8"), "compressed-tensors", bits=8,
         victims=("model.layers.0.self_attn.o_proj.weight_scale",)),
    Case("ct-w8a8-int8-qwen3moe", "qwen3_moe", {}, _ct("W8A8"), "compressed-tensors", bits=8,
         victims=("model.layers.1.mlp.experts.3.down_proj.weight_scale",)),
    Case("ct-w4a16-g128-llama", "llama", WIDE, _ct("W4A16"), "compressed-tensors", bits=4,
         victims=("model.layers.0.self_attn.q_proj.weight_scale",)),
    Case("ct-w4a16-g32-qwen3", "qwen3", QWEN3, _ct("W4A16", group_size=32), "compressed-tensors", bits=4),
    Case("ct-w4a16-g32-tied-qwen3", "qwen3", {**QWEN3, "tie_word_embeddings": True}, _ct("W4A16", group_size=32),
         "compressed-tensors", bits=4),
    Case("ct-w4a16-asym-g16-llama", "llama", {}, _ct("W4A16_ASYM", group_size=16), "compressed-tensors", bits=4,
         victims=("model.layers.1.mlp.gate_proj.weight_zero_point", "model.layers.0.mlp.down_proj.weight_scale")),
    Case("ct-w4a16-channel-asym-llama", "llama", {},
         _ct("W4A16_ASYM", strategy="channel", group_size=None), "compressed-tensors", bits=4),
    Case("ct-w4a16-channel-sym-bf16-llama", "llama", {},
         _ct("W4A16", strategy="channel", group_size=None, dtype=torch.bfloat16), "compressed-tensors", bits=4),
    Case("ct-w8a16-g32-llama", "llama", {}, _ct("W8A16", group_size=32), "compressed-tensors", bits=8),
    # actorder "weight" (the package's spelling since 0.20; "static" before): a calibration-time
    # order only, the layout of no act order
    Case("ct-w4a16-actorder-weight-g32-llama", "llama", {}, _ct("W4A16", group_size=32, actorder="weight"),
         "compressed-tensors", bits=4),
    # compressed-tensors actorder "group" (weight_g_idx), written without the package (0.20 dropped it)
    Case("ct-w4a16-actorder-group-g16-asym-qwen3", "qwen3", QWEN3,
         lambda s, d, seed: qc.ct_group_act_order(s, d, 4, 16, sym=False, seed=seed), "compressed-tensors", bits=4,
         victims=("model.layers.1.self_attn.k_proj.weight_g_idx",)),
    Case("ct-w8a16-actorder-group-g32-llama", "llama", {},
         lambda s, d, seed: qc.ct_group_act_order(s, d, 8, 32, seed=seed), "compressed-tensors", bits=8),
    Case("ct-w4a16-actorder-group-g16-qwen3moe", "qwen3_moe", {},
         lambda s, d, seed: qc.ct_group_act_order(s, d, 4, 16, seed=seed), "compressed-tensors", bits=4),
    # GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq").
    Case("gptq-4bit-g32-sym-llama", "llama", {}, lambda s, d, seed: qc.gptq(s, d, 4, 32, seed=seed), "gptq", bits=4,
         victims=("model.layers.0.mlp.gate_proj.scales", "model.layers.1.self_attn.v_proj.qzeros")),
    Case("gptq-4bit-g16-act-order-asym-qwen3", "qwen3", QWEN3,
         lambda s, d, seed: qc.gptq(s, d, 4, 16, desc_act=True, sym=False, seed=seed), "gptq", bits=4,
         victims=("model.layers.1.self_attn.q_proj.g_idx",)),
    Case("gptq-4bit-g32-act-order-qwen2-bias", "qwen2", {},
         lambda s, d, seed: qc.gptq(s, d, 4, 32, desc_act=True, seed=seed), "gptq", bits=4),
    Case("gptq-4bit-one-group-asym-llama", "llama", {}, lambda s, d, seed: qc.gptq(s, d, 4, -1, sym=False, seed=seed),
         "gptq", bits=4),
    # GPTQModel's checkpoint_format gptq_v2: qzeros hold the zeros (v1: zero - 1)
    Case("gptq-v2-4bit-g16-asym-llama", "llama", {}, lambda s, d, seed: qc.gptq(s, d, 4, 16, sym=False, seed=seed, v2=True),
         "gptq", bits=4, victims=("model.layers.0.mlp.up_proj.qzeros",)),
    Case("gptq-8bit-g32-act-order-llama", "llama", {},
         lambda s, d, seed: qc.gptq(s, d, 8, 32, desc_act=True, seed=seed), "gptq", bits=8),
    Case("gptq-8bit-one-group-qwen3", "qwen3", QWEN3, lambda s, d, seed: qc.gptq(s, d, 8, -1, seed=seed), "gptq",
         bits=8),
    Case("ct-w4a16-g32-qwen3moe-regex-ignore", "qwen3_moe", {},
         _ct("W4A16", group_size=32, ignore=["lm_head", "re:.*mlp.gate$"]), "compressed-tensors", bits=4),
    Case("gptq-4bit-g16-asym-phi3", "phi3", {}, lambda s, d, seed: qc.gptq(s, d, 4, 16, sym=False, seed=seed),
         "gptq", bits=4, victims=("model.layers.0.self_attn.qkv_proj.scales",)),
    Case("gptq-4bit-g32-qwen3moe", "qwen3_moe", {}, lambda s, d, seed: qc.gptq(s, d, 4, 32, seed=seed), "gptq",
         bits=4),
    # One group per row: the gate/up rows' group of 48 values fits no packed CPU block (the torch
    # kernel), the down rows' of 32 does: each projection keeps a kernel of its own shape.
    Case("gptq-4bit-one-group-qwen3moe-h48", "qwen3_moe", dict(hidden_size=48, head_dim=16),
         lambda s, d, seed: qc.gptq(s, d, 4, -1, seed=seed), "gptq", bits=4),
    # AWQ (AutoAWQ GEMM).
    Case("awq-g32-llama", "llama", {}, lambda s, d, seed: qc.awq(s, d, 32), "awq", bits=4,
         victims=("model.layers.1.self_attn.o_proj.scales", "model.layers.0.mlp.up_proj.qzeros")),
    Case("awq-g32-phi3", "phi3", {}, lambda s, d, seed: qc.awq(s, d, 32), "awq", bits=4,
         victims=("model.layers.1.mlp.gate_up_proj.qzeros",)),
    Case("awq-g16-qwen3", "qwen3", QWEN3, lambda s, d, seed: qc.awq(s, d, 16), "awq", bits=4),
    Case("awq-g32-qwen2-bias", "qwen2", {}, lambda s, d, seed: qc.awq(s, d, 32), "awq", bits=4),
    Case("awq-g128-llama", "llama", WIDE, lambda s, d, seed: qc.awq(s, d, 128), "awq", bits=4),
    # Qwen3-Next: the Gated DeltaNet's projections interleaved per key head, reordered as they load
    # with their scales and codes (per row; per 16-row block; per 8 rows packed along the outputs).
    # in_proj_ba's b and a parts (4 rows each here, 32 in the published model) fit no such block:
    # left float, as the published quantized checkpoints leave it; per-row layouts quantize it
    Case("fp8-block16-qwen3next", "qwen3_next", {}, lambda s, d, seed: qc.fp8_block(s, d, (16, 16), not_convert=BA),
         "fp8", victims=("model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv",)),
    Case("ct-fp8-dynamic-qwen3next", "qwen3_next", {},
         _ct("FP8_DYNAMIC", ignore=["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$"]), "compressed-tensors",
         victims=("model.layers.2.linear_attn.in_proj_ba.weight_scale",)),
    Case("ct-w4a16-g16-qwen3next", "qwen3_next", {},
         _ct("W4A16", group_size=16, ignore=["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$"]),
         "compressed-tensors", bits=4),
    Case("gptq-4bit-g16-asym-qwen3next", "qwen3_next", {},
         lambda s, d, seed: qc.gptq(s, d, 4, 16, sym=False, seed=seed, not_convert=BA), "gptq", bits=4,
         victims=("model.layers.2.linear_attn.in_proj_qkvz.qzeros",)),
    Case("awq-g16-qwen3next", "qwen3_next", {}, lambda s, d, seed: qc.awq(s, d, 16, not_convert=BA), "awq", bits=4),
]
BY_ID = {c.id: c for c in CASES}
VICTIMS = [(c.id, v) for c in CASES for v in c.victims]


def case_seed(name: str) -> int:
    return (TEST_SEED + zlib.crc32(name.encode())) % (2**31)


# -- building (memoized: every test of a case reuses its folders) ---------------------------

@dataclass
class Built:
    case: Case
    src: Path  # the float checkpoint quantized
    qc: qc.QuantizedCheckpoint
    ref_path: Path  # the float checkpoint of the dequantized weights
    prompts: list[list[int]]


_BUILT: dict[str, Built] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    _BUILT.clear()
    return tmp_path_factory.mktemp("quantized")


def build_case(case: Case, root: Path) -> Built:
    if case.id not in _BUILT:
        seed = case_seed(case.id)
        src = make_checkpoint(root / case.id / "float", case.arch, seed=seed, **case.overrides)
        checkpoint = case.build(src, root / case.id / "quantized", seed)
        ref_path = qc.write_reference(checkpoint, root / case.id / "dequantized")
        _BUILT[case.id] = Built(case, src, checkpoint, ref_path, random_prompts(3, VOCAB, 4, 12, seed))
    return _BUILT[case.id]


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def built(request, workdir) -> Built:
    return build_case(request.param, workdir)


@pytest.fixture(scope="module")
def engines(built) -> tuple[LLM, LLM]:
    """(the quantized checkpoint, the float checkpoint of its dequantized weights), both in float32."""
    return LLM(str(built.qc.path), **ENGINE), LLM(str(built.ref_path), **ENGINE)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.runner.model


def _linear_classes():
    from baryon.layers.fused_moe.layer import FusedMoE
    from baryon.layers.linear import LinearBase

    return LinearBase, FusedMoE


def _describe(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    diff = (got - want).abs()
    return f"max |diff| {float(diff.max()):.3e} at {tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])}"


QUANTIZABLE = qc.QUANTIZED_LINEAR


def engine_name(module: str) -> str:
    for part, fused in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
                        ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")):
        if module.endswith(f".{part}") and ".experts." not in module:
            return module[: -len(part)] + fused
    return re.sub(r"\.experts\.\d+\..*$", ".experts", module.replace(".linear_attn.", ".self_attn."))


# -- a quantized checkpoint against the float checkpoint of its dequantized weights -----------

def test_weight_load_error_is_a_value_error():
    from baryon.loader.weights import WeightLoadError

    assert issubclass(WeightLoadError, ValueError)


def test_greedy_tokens_match_the_dequantized_float_checkpoint(built, engines):
    quantized, reference = engines
    got, want = greedy(quantized, built.prompts), greedy(reference, built.prompts)
    assert got == want, (f"{built.case.id}: greedy tokens of the quantized checkpoint differ from those of the "
                         f"float checkpoint holding its dequantized weights")


def assert_holds_reference(model: torch.nn.Module, checkpoint: qc.QuantizedCheckpoint) -> None:
    """Every quantized linear's `method.dequantize(layer)` is exactly the reference weight (q/k/v
    and gate/up fused in the engine's order; experts stacked); layers the checkpoint keeps
    float hold its float weights; biases, embeddings, LM head, norms and routers are the
    checkpoint's float tensors."""
    linear_base, fused_moe = _linear_classes()
    modules = dict(model.named_modules())
    ref = checkpoint.reference
    converters = getattr(type(model), "checkpoint_converters", None)
    config = SimpleNamespace(**json.loads((checkpoint.path / "config.json").read_text()))
    layout = qc.engine_layout(ref, converters(config) if converters is not None else None)
    kept_float = {engine_name(m) for m in checkpoint.float_linears if QUANTIZABLE.match(m + ".weight")}
    checked = set()
    for name, want in layout.items():
        assert name in modules, f"the engine has no module {name}"
        layer = modules[name]
        if isinstance(want, tuple):
            assert isinstance(layer, fused_moe), f"{name} is a {type(layer).__name__}, not FusedMoE"
            w13, w2 = layer.method.dequantize(layer)
            for label, got, expected in (("w13", w13, want[0]), ("w2", w2, want[1])):
                assert got.dtype == torch.float32 and torch.equal(got, expected), \
                    f"{name} {label}: dequantize() is not the checkpoint's weight ({_describe(got, expected)})"
        elif name in kept_float:
            assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, want), \
                f"{name} is in the checkpoint's unconverted modules: it should hold the float weight " \
                f"({_describe(layer.weight, want)})"
        else:
            assert isinstance(layer, linear_base), f"{name} is a {type(layer).__name__}, not a LinearBase"
            got = layer.method.dequantize(layer)
            assert got.dtype == torch.float32 and torch.equal(got, want), \
                f"{name}: dequantize() is not the checkpoint's weight ({_describe(got, want)})"
        checked.add(name)
    for name, layer in modules.items():  # nothing quantized escaped the comparison
        if isinstance(layer, (linear_base, fused_moe)) and not name.endswith(".mlp.gate"):
            assert name in checked, f"{name} ({type(layer).__name__}) was not compared with the checkpoint"
    bias_layout = qc.engine_layout({k[: -len("bias")] + "weight": v for k, v in ref.items() if k.endswith(".bias")})
    for name, want in bias_layout.items():
        got = modules[name].bias
        assert got is not None, f"{name} has no bias; the checkpoint has one"
        assert torch.equal(got, want), f"{name}.bias: {_describe(got, want)}"
    from baryon.loader.names import CheckpointNames
    from baryon.models.gemma2 import GemmaRMSNorm

    names = CheckpointNames(model, AutoConfig.from_pretrained(checkpoint.path))
    params = dict(model.named_parameters(remove_duplicate=False))
    lm_head = ref.get("lm_head.weight", ref["model.embed_tokens.weight"])  # (tied)
    for name, want in [("model.embed_tokens.weight", ref["model.embed_tokens.weight"]), ("lm_head.weight", lm_head),
                       *[(k, ref[k]) for k in ref if k.endswith((".mlp.gate.weight", "norm.weight"))]]:
        name = names.target(name).param
        if isinstance(modules.get(name.rpartition(".")[0]), GemmaRMSNorm):
            want = (want.double() + 1).float()  # (1 + weight) held
        assert params[name].dtype == torch.float32 and torch.equal(params[name], want), \
            f"{name} should be the checkpoint's float tensor ({_describe(params[name], want)})"


def test_layers_hold_the_dequantized_weights(built, engines):
    assert_holds_reference(model_of(engines[0]), built.qc)


def _held_bytes(layer) -> int:
    """Bytes of the tensors a layer holds: its parameters and buffers (not the bias) and what its
    method keeps after repacking (attributes, also inside dataclasses)."""
    seen, total = set(), 0

    def visit(value, depth=0):
        nonlocal total
        if isinstance(value, torch.Tensor):
            if id(value) not in seen and value is not getattr(layer, "bias", None):
                seen.add(id(value))
                total += value.numel() * value.element_size()
        elif depth < 2 and hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
            for item in vars(value).values():
                visit(item, depth + 1)
        elif depth < 2 and isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)

    for tensor in [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]:
        visit(tensor)
    visit(layer.method)
    return total


def test_quantized_layers_are_stored_quantized(built, engines):
    """A quantized layer holds its weight in less than half the memory of float32 (the
    checkpoint's codes and scales, not a float copy)."""
    linear_base, fused_moe = _linear_classes()
    model = model_of(engines[0])
    kept_float = {engine_name(m) for m in built.qc.float_linears if QUANTIZABLE.match(m + ".weight")}
    for name, layer in model.named_modules():
        if not isinstance(layer, (linear_base, fused_moe)) or name in kept_float:
            continue
        if not getattr(layer, "quantizable", True):  # routers, V3.2's indexer weights: float in checkpoints
            continue
        if getattr(layer.method, "holds_dequantized", False):
            continue  # experts in a layout no MoE kernel here reads (or on CPU): held dequantized
        held = _held_bytes(layer)
        if isinstance(layer, fused_moe):
            w13, w2 = layer.method.dequantize(layer)
            dense = 4 * (w13.numel() + w2.numel())
        else:
            dense = 4 * layer.method.dequantize(layer).numel()
        assert 0 < held < dense / 2, f"{name} holds {held} bytes, a float32 weight takes {dense}: not stored quantized"


FIRST_OF_FORMAT = [next(c.id for c in CASES if c.fmt == fmt) for fmt in ("fp8", "compressed-tensors", "gptq", "awq")]


@pytest.mark.parametrize("case_id", FIRST_OF_FORMAT)
def test_naming_the_checkpoint_format_loads_it(workdir, case_id):
    """quantization=<the checkpoint's own format> is the same load as none."""
    built = build_case(BY_ID[case_id], workdir)
    named = LLM(str(built.qc.path), quantization=built.case.fmt, **ENGINE)
    assert greedy(named, built.prompts) == greedy(LLM(str(built.qc.path), **ENGINE), built.prompts)


def test_kv_cache_scales_load_into_the_attention_layers(workdir):
    """compressed-tensors' kv_cache_scheme writes self_attn.k_scale / v_scale: they load into
    the attention layers (self_attn.attn.k_scale / v_scale) and leave float32 results alone."""
    built = build_case(BY_ID["ct-fp8-dynamic-kv-cache-llama"], workdir)
    tensors = load_file(built.qc.path / "model.safetensors")
    assert built.qc.quantization_config["kv_cache_scheme"]["num_bits"] == 8
    model = model_of(LLM(str(built.qc.path), **ENGINE))
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for i in range(2):
        for kv in ("k_scale", "v_scale"):
            stored = tensors[f"model.layers.{i}.self_attn.{kv}"]
            held = params.get(f"model.layers.{i}.self_attn.attn.{kv}")
            assert held is not None, f"model.layers.{i}.self_attn.attn has no {kv}"
            assert held.numel() == 1 and float(held) == float(stored), \
                f"model.layers.{i}.self_attn.attn.{kv} = {held} but the checkpoint's is {stored}"


def test_fused_parts_with_different_act_orders_are_loaded_exactly_or_refused(workdir, tmp_path):
    """GPTQ gives modules that read the same input one column order (q/k/v share a g_idx, so do
    gate/up). A checkpoint whose fused parts have different g_idx is not what GPTQ writes, but
    it must not load silently wrong: loaded exactly, or refused with an error naming g_idx."""
    seed = case_seed("gptq-unshared-act-order")
    src = make_checkpoint(tmp_path / "float", "llama", seed=seed)
    checkpoint = qc.gptq(src, tmp_path / "quantized", 4, 16, desc_act=True, seed=seed, shared_order=False)
    try:
        llm = LLM(str(checkpoint.path), **ENGINE)
    except ValueError as e:
        assert "g_idx" in str(e), f"refused without naming g_idx: {e}"
        return
    assert_holds_reference(model_of(llm), checkpoint)
    prompts = random_prompts(3, VOCAB, 4, 12, seed)
    reference = LLM(str(qc.write_reference(checkpoint, tmp_path / "dequantized")), **ENGINE)
    assert greedy(llm, prompts) == greedy(reference, prompts)


# -- broken checkpoints -----------------------------------------------------------------------

def _broken_copy(built: Built, dst: Path, mutate) -> tuple[Path, Path]:
    shutil.copytree(built.qc.path, dst)
    file = dst / "model.safetensors"
    tensors = load_file(file)
    mutate(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return dst, file


def _assert_names_tensor(message: str, name: str) -> None:
    """The error names the checkpoint tensor, or (for a part of a fused layer) the fused
    parameter and the shard."""
    if name in message:
        return
    module, _, suffix = name.rpartition(".")
    for part, fused, shard in (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"),
                               ("v_proj", "qkv_proj", "v"), ("gate_proj", "gate_up_proj", "0"),
                               ("up_proj", "gate_up_proj", "1")):
        if module.endswith(f".{part}") and ".experts." not in module:
            fused_module = module[: -len(part)] + fused
            if fused_module in message and suffix in message and re.search(rf"\b{shard}\b", message):
                return
    pytest.fail(f"the error does not name tensor {name!r}: {message}")


@pytest.mark.parametrize("case_id,victim", VICTIMS, ids=[f"{c}:{v.split('.', 2)[2]}" for c, v in VICTIMS])
def test_missing_scale_tensor(workdir, tmp_path, case_id, victim):
    """A quantized module's scale (or zero points, or g_idx) missing: a WeightLoadError naming it."""
    from baryon.loader.weights import WeightLoadError

    built = build_case(BY_ID[case_id], workdir)
    path, _ = _broken_copy(built, tmp_path / "missing", lambda t: t.pop(victim))
    with pytest.raises(WeightLoadError) as e:
        LLM(str(path), **ENGINE)
    _assert_names_tensor(str(e.value), victim)


def _misshape(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0 or t.numel() == 1:
        bad = torch.ones(2, dtype=t.dtype if t.dtype != torch.float8_e4m3fn else torch.float32)
    else:
        bad = torch.cat([t, t[:1]])  # one row (or element) more
    return bad.to(t.dtype)


@pytest.mark.parametrize("case_id,victim", VICTIMS, ids=[f"{c}:{v.split('.', 2)[2]}" for c, v in VICTIMS])
def test_misshaped_scale_tensor(workdir, tmp_path, case_id, victim):
    """The same tensor with one row (element) more: a WeightLoadError naming it."""
    from baryon.loader.weights import WeightLoadError

    built = build_case(BY_ID[case_id], workdir)

    def mutate(tensors):
        tensors[victim] = _misshape(tensors[victim])

    path, _ = _broken_copy(built, tmp_path / "misshaped", mutate)
    with pytest.raises(WeightLoadError) as e:
        LLM(str(path), **ENGINE)
    _assert_names_tensor(str(e.value), victim)


# -- what is refused ---------------------------------------------------------------------------

SUPPORTED_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")


@pytest.fixture(scope="module")
def float_llama(workdir) -> Path:
    return make_checkpoint(workdir / "float_llama", "llama", seed=case_seed("float_llama"))


def _with_config(src: Path, dst: Path, quantization_config: dict) -> Path:
    return qc.write_checkpoint(src, dst, qc.load_float(src), quantization_config)


@pytest.mark.parametrize("config", [
    {"quant_method": "eetq", "weights": "int8"},
    {"quant_method": "hqq", "quant_config": {"weight_quant_params": {"nbits": 4, "group_size": 64}}},
], ids=["eetq", "hqq"])
def test_unsupported_quant_method(float_llama, tmp_path, config):
    path = _with_config(float_llama, tmp_path / "unsupported", config)
    with pytest.raises(ValueError) as e:
        LLM(str(path), **ENGINE)
    message = str(e.value)
    assert config["quant_method"] in message, f"the error does not name the method: {message}"
    for method in SUPPORTED_METHODS:
        assert method in message, f"the error does not list the supported method {method!r}: {message}"


@pytest.mark.parametrize("scheme,named", [
    (lambda: qc.ct_scheme("W3A16", group_size=32), r"\b3\b"),
    (lambda: qc.ct_scheme("W8A8", strategy="block", block_structure=[32, 32]), r"block"),
], ids=["int3-weights", "int8-block-weights"])
def test_unsupported_compressed_tensors_scheme(float_llama, tmp_path, scheme, named):
    path = tmp_path / "unsupported"
    qc.compressed_tensors(float_llama, path, scheme())
    with pytest.raises(ValueError) as e:
        LLM(str(path), **ENGINE)
    assert re.search(named, str(e.value)), f"the error does not name the scheme ({named}): {e.value}"


@pytest.mark.parametrize("fmt", ["ct-w4a16-g32", "ct-fp8-dynamic", "gptq-4bit-g32"])
def test_a_quantized_lm_head_loads_quantized(tmp_path, fmt, seed):
    """A checkpoint that quantized the LM head too (compressed-tensors with `ignore: []`, GPTQModel's
    lm_head=True) loads it in its layout: the head holds the checkpoint's codes (under half the
    float32 bytes), dequantizes to exactly the reference weight, and greedy tokens equal the float
    checkpoint of the dequantized weights; W4A16 over two tensor-parallel ranks (the vocabulary's
    127 rows split 64 + 63, the last rank's padding row zero) gives the same tokens. (GPTQ packs the
    head's zero points 8 rows a word: its vocabulary is a multiple of 8, as real ones are.)"""
    from baryon.layers.quantized_lm_head import QuantizedLMHead

    vocab = 128 if fmt.startswith("gptq") else 127
    float_llama = make_checkpoint(tmp_path / "float", "llama", seed=seed % 2**31, vocab_size=vocab,
                                  **WIDE)  # (WIDE: layers whose halves are whole 32-groups)
    path = tmp_path / "quantized_head"
    if fmt == "gptq-4bit-g32":
        built = qc.gptq(float_llama, path, 4, 32, seed=seed, lm_head=True)
    else:
        scheme = qc.ct_scheme("W4A16", group_size=32) if fmt == "ct-w4a16-g32" else qc.ct_scheme("FP8_DYNAMIC")
        built = qc.compressed_tensors(float_llama, path, scheme, ignore=[], seed=seed)
    stored = load_file(path / "model.safetensors")
    assert "lm_head" in built.quantized and {"lm_head.weight_scale", "lm_head.scales"} & set(stored)
    reference = qc.write_reference(built, tmp_path / "reference")
    prompts = random_prompts(4, vocab, 3, 12, seed)
    quantized = LLM(str(path), **ENGINE)
    head = model_of(quantized).lm_head
    assert isinstance(head, QuantizedLMHead)
    assert torch.equal(head.method.dequantize(head), built.reference["lm_head.weight"])
    assert 0 < _held_bytes(head) < 4 * head.method.dequantize(head).numel() / 2
    want = greedy(LLM(str(reference), **ENGINE), prompts)
    assert greedy(quantized, prompts) == want
    if fmt == "ct-w4a16-g32":
        with LLM(str(path), **ENGINE, tensor_parallel_size=2) as two:
            assert greedy(two, prompts) == want


def test_a_float_lm_head_under_a_config_that_covers_it_stays_dense(float_llama, tmp_path, seed):
    """A compressed-tensors config whose `ignore` does not list lm_head, over a checkpoint that
    stores it in float: the head stays dense (the tensors decide) and generates as before."""
    from baryon.layers.quantized_lm_head import QuantizedLMHead

    built = qc.compressed_tensors(float_llama, tmp_path / "float_head", qc.ct_scheme("W4A16", group_size=32),
                                  seed=seed)  # ignore: lm_head
    stored = qc.load_float(built.path)
    assert stored["lm_head.weight"].is_floating_point()
    config = {**built.quantization_config, "ignore": []}
    path = qc.write_checkpoint(built.path, tmp_path / "unlisted", stored, config)
    prompts = random_prompts(3, VOCAB, 3, 12, seed)
    head = model_of(unlisted := LLM(str(path), **ENGINE)).lm_head
    assert not isinstance(head, QuantizedLMHead) and torch.equal(head.weight, stored["lm_head.weight"])
    assert greedy(unlisted, prompts) == greedy(LLM(str(built.path), **ENGINE), prompts)


def test_a_quantized_lm_head_whose_rows_split_off_its_blocks_is_refused(tmp_path, seed):
    """GPTQ packs the head's zero points 8 rows to a word: 120 rows over two ranks (60 each) would
    cut a word, so the error names the alignment and what would work."""
    float_llama = make_checkpoint(tmp_path / "float", "llama", seed=seed % 2**31, vocab_size=120, **WIDE)
    path = qc.gptq(float_llama, tmp_path / "head", 4, 32, seed=seed, lm_head=True).path
    with pytest.raises(Exception, match=r"60 vocabulary rows a rank do not align with this tensor's 8-row blocks"):
        LLM(str(path), **ENGINE, tensor_parallel_size=2)


def test_a_quantized_lm_head_the_config_does_not_name_is_refused_by_name(float_llama, tmp_path, seed):
    """A GPTQ checkpoint whose LM head tensors are quantized while its config says `lm_head: false`:
    the load error says so and what would load, not only which tensor surprised it."""
    from baryon.loader.weights import WeightLoadError

    built = qc.gptq(float_llama, tmp_path / "head", 4, 32, seed=seed, lm_head=True)
    path = qc.write_checkpoint(built.path, tmp_path / "mislabelled", qc.load_float(built.path),
                               {**built.quantization_config, "lm_head": False})
    with pytest.raises(WeightLoadError, match=r"LM head quantized \('lm_head\.\w+'.*`lm_head: true`"):
        LLM(str(path), **ENGINE)


@pytest.mark.parametrize("preset,arch,tp", [("NVFP4", "llama", 2), ("NVFP4A16", "qwen3", 1), ("NVFP4", "qwen3_moe", 1)])
def test_nvfp4_checkpoint_generates_as_its_dequantized_weights(tmp_path, seed, preset, arch, tp):
    """compressed-tensors NVFP4 (written by the compressed_tensors package: e2m1 codes, e4m3 scales
    per 16 values, a global scale; with 4-bit activations or without) is dequantized as it loads:
    each layer holds exactly the weight the package's decompressor computes (before its bf16
    rounding), experts too, and the engine generates as the float checkpoint of those weights,
    over two tensor-parallel ranks as well."""
    overrides = dict(WIDE, head_dim=32) if arch != "qwen3_moe" else dict(hidden_size=128, head_dim=32)
    src = make_checkpoint(tmp_path / "float", arch, seed=seed % 2**31, **overrides)
    built = qc.compressed_tensors(src, tmp_path / "nvfp4", qc.ct_scheme(preset), seed=seed)
    stored = load_file(built.path / "model.safetensors")
    assert stored["model.layers.1.self_attn.o_proj.weight_packed"].dtype == torch.uint8
    assert stored["model.layers.1.self_attn.o_proj.weight_scale"].dtype == torch.float8_e4m3fn
    reference = qc.write_reference(built, tmp_path / "reference")
    prompts = random_prompts(4, VOCAB, 3, 12, seed)
    with LLM(str(built.path), **ENGINE) as quantized:
        layer = model_of(quantized).model.layers[1]
        assert torch.equal(layer.self_attn.o_proj.weight, built.reference["model.layers.1.self_attn.o_proj.weight"])
        if arch == "qwen3_moe":
            w2 = torch.stack([built.reference[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(8)])
            assert torch.equal(layer.mlp.experts.w2_weight, w2)
        got = greedy(quantized, prompts)
    assert got == greedy(LLM(str(reference), **ENGINE), prompts)
    if tp > 1:
        with LLM(str(built.path), **ENGINE, tensor_parallel_size=tp) as split:
            assert greedy(split, prompts) == got


def test_nvfp4_checkpoint_missing_a_part_fails_naming_it(float_llama, tmp_path, seed):
    built = qc.compressed_tensors(float_llama, tmp_path / "nvfp4", qc.ct_scheme("NVFP4A16"), seed=seed)
    tensors = load_file(built.path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_global_scale"]
    save_file(tensors, built.path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"NVFP4.*model\.layers\.0\.mlp\.up_proj but not \['weight_global_scale'\]"):
        LLM(str(built.path), **ENGINE)


@pytest.mark.parametrize("case_id,asked", [("fp8-block32-llama", "gptq"), ("ct-w8a8-int8-qwen3", "awq"),
                                           ("gptq-4bit-g32-sym-llama", "fp8")])
def test_quantization_argument_contradicting_the_checkpoint(workdir, case_id, asked):
    built = build_case(BY_ID[case_id], workdir)
    with pytest.raises(ValueError) as e:
        LLM(str(built.qc.path), quantization=asked, **ENGINE)
    message = str(e.value)
    assert asked in message and built.case.fmt in message, \
        f"the error should name both {asked!r} and the checkpoint's {built.case.fmt!r}: {message}"


# -- quantizing a float checkpoint at load -------------------------------------------------------


@pytest.mark.parametrize("method", ["w8a8"])
def test_online_int_quantization_of_experts_is_refused_naming_what_works(workdir, method):
    """Online w8a8 does not quantize experts: the error names the method, the layer and what
    would load the model quantized (fp8, or the checkpoint formats that hold experts)."""
    path = make_checkpoint(workdir / f"float_moe_{method}", "qwen3_moe", seed=case_seed("float_moe"))
    with pytest.raises(ValueError, match=rf"{method} quantization does not cover mixture-of-experts layers "
                                         rf"\(model\.layers\.0\.mlp\.experts\).*fp8"):
        LLM(str(path), quantization=method, **ENGINE)

ONLINE = [("fp8", "llama", {}), ("fp8", "qwen3", QWEN3), ("fp8", "qwen3_moe", {}), ("w8a8", "llama", {}),
          ("w4a16", "llama", {}), ("w4a16", "llama", WIDE), ("w4a16", "qwen3_moe", {})]


def _online_bound(method: str, w: torch.Tensor) -> torch.Tensor:
    """Largest |dequantized - float| allowed per element of weight(s) w [..., out, in]."""
    row_max = w.abs().amax(-1, keepdim=True)
    if method == "fp8":  # e4m3 rounds to 2**-4 relative; the smallest numbers have absolute steps
        return 2**-3 * w.abs() + 2**-12 * w.abs().amax()
    if method == "w8a8":  # int8 per channel: one step of the row's range
        return row_max / 127 * 1.001
    return 2 * row_max / 15 * 1.001  # int4 groups (within a row): one step of the widest range


def _unfuse(model: torch.nn.Module, original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint the engine's held weights make: every layer's dequantize() split back into
    the checkpoint's q/k/v, gate/up and per-expert tensors (their sizes from `original`)."""
    linear_base, fused_moe = _linear_classes()
    out = dict(original)
    for name, layer in model.named_modules():
        if isinstance(layer, fused_moe):
            w13, w2 = layer.method.dequantize(layer)
            half = w13.shape[1] // 2
            for e in range(w13.shape[0]):
                out[f"{name}.{e}.gate_proj.weight"] = w13[e, :half].clone()
                out[f"{name}.{e}.up_proj.weight"] = w13[e, half:].clone()
                out[f"{name}.{e}.down_proj.weight"] = w2[e].clone()
        elif isinstance(layer, linear_base) and not name.endswith(".mlp.gate"):
            w = layer.method.dequantize(layer)
            prefix, _, leaf = name.rpartition(".")
            parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(leaf,
                                                                                                           [leaf])
            sizes = [original[f"{prefix}.{p}.weight"].shape[0] for p in parts]
            for part, piece in zip(parts, w.split(sizes)):
                out[f"{prefix}.{part}.weight"] = piece.clone()
    return out


@pytest.mark.parametrize("method,arch,overrides", ONLINE,
                         ids=[f"{m}-{a}{'-wide' if o is WIDE else ''}" for m, a, o in ONLINE])
def test_online_quantization(tmp_path, method, arch, overrides):
    """quantization=fp8 / w8a8 / w4a16 on a float checkpoint: every decoder linear (and expert)
    holds a weight within that format's rounding of the float one, the embeddings and LM head
    stay float, and the greedy tokens are exactly those of a float checkpoint holding the
    engine's own dequantized weights."""
    linear_base, fused_moe = _linear_classes()
    seed = case_seed(f"online-{method}-{arch}-{len(overrides)}")
    src = make_checkpoint(tmp_path / "float", arch, seed=seed, **overrides)
    original = load_file(src / "model.safetensors")
    llm = LLM(str(src), quantization=method, **ENGINE)
    model = model_of(llm)
    layout = qc.engine_layout(original)
    for name, want in layout.items():
        layer = dict(model.named_modules())[name]
        pairs = zip(layer.method.dequantize(layer), want) if isinstance(want, tuple) else [
            (layer.method.dequantize(layer), want)]
        for got, ref in pairs:
            assert got.shape == ref.shape and got.dtype == torch.float32, f"{name}: {_describe(got, ref)}"
            err = (got - ref).abs()
            bound = _online_bound(method, ref)
            worst = torch.argmax(err - bound)
            assert bool((err <= bound).all()), (f"{name}: |dequantized - float| = {float(err.flatten()[worst]):.3e} "
                                                f"> {float(bound.flatten()[worst]):.3e} ({method})")
            assert not torch.equal(got, ref), f"{name} was not quantized"
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert params[name].dtype == torch.float32 and torch.equal(params[name], original[name]), \
            f"{name} should stay float"
    prompts = random_prompts(3, VOCAB, 4, 12, seed)
    got = greedy(llm, prompts)
    assert all(len(t) == NUM_NEW for t in got)
    held = qc.write_checkpoint(src, tmp_path / "held", _unfuse(model, original), None)
    assert got == greedy(LLM(str(held), **ENGINE), prompts), \
        f"online {method}: greedy tokens differ from a float checkpoint of the engine's own dequantized weights"


# -- the builders on their own (no engine) -----------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_builder_reference_is_within_quantization_error(workdir, case):
    built = build_case(case, workdir)
    original = qc.load_float(built.src)
    assert built.qc.quantized, "nothing was quantized"
    expected_quantized = {k[: -len(".weight")] for k in original if qc.QUANTIZED_LINEAR.match(k)}
    kept = set(built.qc.float_linears)
    assert set(built.qc.quantized) == expected_quantized - kept
    stored = load_file(built.qc.path / "model.safetensors")
    dense_dtype = stored["model.embed_tokens.weight"].dtype  # what the quantizer saw (bf16 cases: bf16 weights)
    for module in built.qc.quantized:
        w, ref = original[f"{module}.weight"].to(dense_dtype).float(), built.qc.reference[f"{module}.weight"]
        assert ref.dtype == torch.float32 and ref.shape == w.shape
        err = (ref - w).abs()
        if case.bits is None:  # fp8: half an e4m3 step (2**-4 relative), subnormals below 2**-6 * scale
            bound = 2**-4 * w.abs() * (1 + 2**-12) + 2**-10 * w.abs().amax() / qc.FP8_MAX * 1.01
        else:  # integers: one step of the widest range a row's groups can have
            bound = 2 * w.abs().amax(1, keepdim=True) / (2**case.bits - 1) * 1.002
            if case.fmt == "awq":  # AutoAWQ clamps zero points into the code range, so a group whose
                # values share one sign cannot reach them all: those past its ends are clipped
                group = built.qc.quantization_config["group_size"]
                ends = ref.unflatten(1, (-1, group))
                low = ends.amin(-1).repeat_interleave(group, 1)
                high = ends.amax(-1).repeat_interleave(group, 1)
                bound = bound + (w - high).clamp(min=0) + (low - w).clamp(min=0)
        assert bool((err <= bound).all()), f"{module}: reference off by {float((err - bound).max()):.3e} past the bound"
        assert not torch.equal(ref, w), f"{module}: the reference is the float weight"
    config = json.loads((built.qc.path / "config.json").read_text())
    assert config["quantization_config"] == built.qc.quantization_config
    assert config["quantization_config"]["quant_method"] == case.fmt
    assert "quantization_config" not in json.loads((built.ref_path / "config.json").read_text())
    for name, tensor in built.qc.reference.items():  # everything else is the stored tensor, upcast
        assert tensor.dtype == torch.float32
        if name[: -len(".weight")] not in built.qc.quantized:
            assert torch.equal(tensor, stored[name].float())
            assert torch.equal(tensor, original[name].to(stored[name].dtype).float())


# Not read back by transformers: partial edge blocks (its load-time FP8 dequantizer derives the
# block from the scale grid; the case is read by its forward-pass dequantizer below) and
# compressed-tensors FP8-block and INT8 experts (it cannot merge them into its fused experts; the
# builder checks them against compressed_tensors' own decompressor), and the DeepSeek case, whose
# latent projections have partial blocks too (24 and 40 rows in blocks of 16).
READ_BACK = [c.id for c in CASES if (c.fmt == "compressed-tensors" or c.id.startswith("fp8-block"))
             and "partial" not in c.id and "actorder-group" not in c.id and c.id not in ("ct-fp8-block16-qwen3moe", "ct-w8a8-int8-qwen3moe",
                                                         "fp8-block16-deepseekv3")]


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("case_id", READ_BACK)
def test_transformers_reads_the_same_weights(workdir, case_id):
    """transformers dequantizes the compressed-tensors and block-FP8 checkpoints to exactly the
    builders' references (experts: its fused gate_up_proj = gate rows then up rows)."""
    import transformers as tf

    built = build_case(BY_ID[case_id], workdir)
    if built.case.fmt == "compressed-tensors":
        config = tf.CompressedTensorsConfig(run_compressed=False)
    else:
        given = built.qc.quantization_config
        config = tf.FineGrainedFP8Config(dequantize=True, **{
            k: given[k] for k in ("weight_block_size", "modules_to_not_convert") if k in given})
    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()  # (its load report lists the KV scales it has no use for)
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(built.qc.path, dtype=torch.float32, quantization_config=config)
    finally:
        tf.logging.set_verbosity(verbosity)
    ref = built.qc.reference
    stored = load_file(built.qc.path / "model.safetensors")
    scale_dtype = next(t.dtype for k, t in stored.items() if k.endswith(("weight_scale", "weight_scale_inv")))
    if built.case.fmt != "compressed-tensors":
        scale_dtype = torch.float32  # its FP8 dequantizer multiplies in float32
    for name, got in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix, leaf = name.rsplit(".", 1)
            parts = ["gate_proj", "up_proj"] if leaf == "gate_up_proj" else ["down_proj"]
            want = torch.stack([torch.cat([ref[f"{prefix}.{e}.{p}.weight"] for p in parts])
                                for e in range(got.shape[0])])
        else:
            want = ref[name] if name != "lm_head.weight" else ref.get(name, ref["model.embed_tokens.weight"])
        if scale_dtype == torch.bfloat16 and name[: -len(".weight")] in built.qc.quantized:
            want = want.to(torch.bfloat16).float()  # it multiplies in the scales' dtype: one bf16 rounding
        assert torch.equal(got.float(), want), f"{name}: transformers reads {_describe(got.float(), want)}"


def test_transformers_fp8_block_dequantization_reads_partial_blocks(workdir):
    """Scales are [ceil(N/bn), ceil(K/bk)]: the last column block of down_proj (K = 96, bk = 64)
    is partial. transformers' forward-pass dequantizer (block size from the config) agrees."""
    dequantize = pytest.importorskip("transformers.integrations.finegrained_fp8")._dequantize_fp8_weight
    built = build_case(BY_ID["fp8-block32x64-partial-k-llama"], workdir)
    tensors = load_file(built.qc.path / "model.safetensors")
    block = built.qc.quantization_config["weight_block_size"]
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (64 // block[0], -(-96 // block[1]))
    for module in built.qc.quantized:
        got = dequantize(tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"], block, torch.float32)
        want = built.qc.reference[f"{module}.weight"]
        assert torch.equal(got, want), f"{module}: {_describe(got, want)}"


@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.fmt == "awq"])
def test_compressed_tensors_awq_converter_reads_the_same_weights(workdir, case_id):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    built = build_case(BY_ID[case_id], workdir)
    converter = AutoAWQConverter.from_autoawq_config(built.qc.quantization_config)
    tensors = converter.process(load_file(built.qc.path / "model.safetensors"))
    scheme = converter._build_quant_config().config_groups["config_group_0"]
    for module in built.qc.quantized:
        local = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".")}
        local["weight_scale"] = local["weight_scale"].float()
        got = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        want = built.qc.reference[f"{module}.weight"]
        assert torch.equal(got, want), f"{module}: {_describe(got, want)}"


def _autogptq_dequantize(qweight, qzeros, scales, g_idx, bits, v2: bool = False) -> torch.Tensor:
    """AutoGPTQ's qlinear_cuda_old forward (torch path), transcribed: [N, K] float32 (v2: GPTQModel's
    gptq_v2, whose zeros are stored as they are, not less one)."""
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits), wf.unsqueeze(0))
    zeros = torch.bitwise_and(zeros.to(torch.int16 if bits == 8 else torch.int8), (2**bits) - 1)
    zeros = (zeros + (0 if v2 else 1)).reshape(scales.shape)
    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1))
    weight = torch.bitwise_and(weight.to(torch.int16 if bits == 8 else torch.int8), (2**bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return (scales.float()[g_idx.long()] * (weight - zeros[g_idx.long()]).float()).T


@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.fmt == "gptq"])
def test_autogptq_unpacking_reads_the_same_weights(workdir, case_id):
    built = build_case(BY_ID[case_id], workdir)
    tensors = load_file(built.qc.path / "model.safetensors")
    config = built.qc.quantization_config
    bits = config["bits"]
    for module in built.qc.quantized:
        qweight, qzeros, scales, g_idx = (tensors[f"{module}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx"))
        k, n = g_idx.shape[0], scales.shape[1]
        groups = 1 if config["group_size"] == -1 else k // config["group_size"]
        assert qweight.dtype == qzeros.dtype == g_idx.dtype == torch.int32 and scales.dtype == torch.float16
        assert qweight.shape == (k * bits // 32, n) and qzeros.shape == (groups, n * bits // 32)
        assert scales.shape == (groups, n)
        if not config["desc_act"]:
            assert torch.equal(g_idx, (torch.arange(k) // (k if config["group_size"] == -1 else config["group_size"]))
                               .to(torch.int32))
        else:
            assert torch.equal(torch.bincount(g_idx.long()), torch.full((groups,), k // groups))
        if config["sym"]:  # v1 stores zero - 1: 2**(bits-1) - 1 in every field
            assert bool((qzeros == {4: 0x77777777, 8: 0x7F7F7F7F}[bits]).all())
        got = _autogptq_dequantize(qweight, qzeros, scales, g_idx, bits, v2=config["checkpoint_format"] == "gptq_v2")
        want = built.qc.reference[f"{module}.weight"]
        assert torch.equal(got, want), f"{module}: {_describe(got, want)}"



def test_block_quantized_in_proj_ba_is_refused_by_name(workdir, tmp_path):
    """Qwen3-Next's in_proj_ba in FP8 blocks: its b and a parts (4 rows each here) share a 16-row
    block, which the fused parts cannot be cut along: an error naming the tensor and the blocks."""
    from baryon.loader.weights import WeightLoadError

    seed = case_seed("block-quantized-in-proj-ba")
    src = make_checkpoint(tmp_path / "float", "qwen3_next", seed=seed)
    checkpoint = qc.fp8_block(src, tmp_path / "quantized", (16, 16))
    assert "model.layers.0.linear_attn.in_proj_ba" in checkpoint.quantized
    with pytest.raises(WeightLoadError, match=r"linear_attn\.in_proj_ba\.weight_scale_inv.*16-row"):
        LLM(str(checkpoint.path), **ENGINE)
