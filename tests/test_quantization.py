"""The quantization mechanism: which config a checkpoint or engine argument selects, per-layer
decisions, how a method's parameters load into fused layers, and the format helpers (unpacking,
rounding). Each published format end to end: test_quantized_checkpoints.py."""

from __future__ import annotations

import json
import pytest
import torch

from baryon.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from baryon.quantization.base import is_ignored
from baryon.quantization.fp8_rounding import expand_block_scale, quantize_fp8_blocks, quantize_fp8_per_channel
from baryon.quantization.registry import resolve_quantization
from baryon.quantization.wna16 import AWQ_ORDER, quantize_int_groups, unpack_int32
from conftest import make_checkpoint


class _Config:
    def __init__(self, quantization_config=None):
        self.quantization_config = quantization_config


def test_registry_reads_the_checkpoint_format_and_the_engine_argument():
    assert resolve_quantization(_Config(), None) is None
    assert resolve_quantization(_Config({"quant_method": "fp8", "weight_block_size": [128, 128]}), None).block \
        == (128, 128)
    assert resolve_quantization(_Config({"quant_method": "fp8"}), "fp8").name == "fp8"
    assert resolve_quantization(_Config(), "fp8").online
    assert resolve_quantization(_Config(), "w8a8").name == "w8a8"
    assert resolve_quantization(_Config(), "w4a16").name == "w4a16"
    with pytest.raises(ValueError, match="'hqq'.*supported.*fp8.*compressed-tensors.*gptq.*awq.*bitsandbytes"):
        resolve_quantization(_Config({"quant_method": "hqq"}), None)
    with pytest.raises(ValueError, match="'gptq'.*quantized with 'fp8'"):
        resolve_quantization(_Config({"quant_method": "fp8"}), "gptq")
    with pytest.raises(ValueError, match="'awq' needs a checkpoint quantized"):
        resolve_quantization(_Config(), "awq")
    with pytest.raises(ValueError, match="quantization='int3' is not supported"):
        resolve_quantization(_Config(), "int3")


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme 'weird'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 128,
                                           "symmetric": True}}}}, "int 3-bit group weights"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     "int 8-bit tensor weights"),
])
def test_unsupported_schemes_name_themselves(config, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(_Config(config), None)


def test_ignore_lists():
    assert is_ignored("lm_head", ["lm_head"])
    assert is_ignored("model.layers.3.mlp.gate", ["re:.*mlp.gate$"])
    assert not is_ignored("model.layers.3.mlp.gate_proj", ["re:.*mlp.gate$"])
    assert is_ignored("model.layers.0.self_attn.q_proj", ["model.layers.0"])
    assert is_ignored("model.layers.1.mlp.down_proj", ["down_proj"])
    assert not is_ignored("model.layers.1.mlp.down_proj", ["gate"])
    assert not is_ignored("model.layers.1.mlp.down_proj", None)


def test_per_part_scales_and_block_scales_load_into_fused_layers(seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=False)  # q 64 rows, k 32, v 32
    scale = qkv.add_param("weight_scale", (3,), torch.float32, output_dim=None, input_dim=None, per_shard=True)
    values = torch.rand(3, generator=gen)
    for i, part in enumerate("qkv"):
        qkv.weight_loader(scale, values[i].reshape(()), part)
    assert torch.equal(scale.data, values)
    assert qkv.shard_sizes == [64, 32, 32]
    with pytest.raises(ValueError, match="not one value"):
        qkv.weight_loader(scale, torch.ones(2), "k")

    merged = MergedColumnParallelLinear(64, [32, 64], bias=False)
    block = merged.add_param("weight_scale_inv", (6, 4), torch.float32, output_block=16)
    gate, up = torch.rand(2, 4, generator=gen), torch.rand(4, 4, generator=gen)
    merged.weight_loader(block, gate, 0)
    merged.weight_loader(block, up, 1)
    assert torch.equal(block.data, torch.cat([gate, up]))
    with pytest.raises(ValueError, match="does not match"):
        merged.weight_loader(block, torch.rand(3, 4), 0)
    misaligned = MergedColumnParallelLinear(64, [24, 72], bias=False)
    bad = misaligned.add_param("weight_scale_inv", (6, 4), torch.float32, output_block=16)
    with pytest.raises(ValueError, match="does not align with 16-row blocks"):
        misaligned.weight_loader(bad, torch.rand(2, 4), 0)


def test_unpack_matches_compressed_tensors_packing(seed):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(seed)
    for bits in (4, 8):
        half = 1 << (bits - 1)
        signed = torch.randint(-half, half, (12, 40), generator=gen, dtype=torch.int8)
        packed = pack_to_int32(signed, bits)  # [12, 40 * bits / 32], codes + 2**(bits-1)
        assert torch.equal(unpack_int32(packed, bits, 40), (signed.to(torch.int32) + half).to(torch.uint8))


def test_unpack_awq_order(seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (5, 24), generator=gen, dtype=torch.int32)
    words = torch.zeros(5, 3, dtype=torch.int32)
    for j in range(3):  # AWQ: word j, nibble i holds column 8j + order[i]
        for i, column in enumerate(AWQ_ORDER):
            words[:, j] |= codes[:, 8 * j + column] << (4 * i)
    assert torch.equal(unpack_int32(words, 4, 24, AWQ_ORDER), codes.to(torch.uint8))


def test_rounding_helpers(seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(70, 50, generator=gen)
    q, scale = quantize_fp8_blocks(weight, (32, 16))
    assert scale.shape == (3, 4)
    expanded = expand_block_scale(scale, 70, 50, (32, 16))
    # e4m3: 3 mantissa bits (half a step is 2**-4 relative); subnormals below 2**-6 step by 2**-9
    assert ((q.float() * expanded - weight).abs() <= weight.abs() * 2 ** -4 + expanded * 2 ** -10).all()
    q, scale = quantize_fp8_per_channel(weight)
    assert ((q.float() * scale[:, None] - weight).abs() <= weight.abs() * 2 ** -4 + scale[:, None] * 2 ** -10).all()
    codes, scales, zeros = quantize_int_groups(weight, 4, 16)
    dense = (codes.float() - zeros.float().repeat_interleave(16, 1)[:, :50]) * scales.repeat_interleave(16, 1)[:, :50]
    assert (dense - weight).abs().max() <= scales.max() / 2 + 1e-6


@pytest.mark.parametrize("quantization", ["fp8", "w8a8", "w4a16"])
def test_dummy_weights_in_a_quantized_layout(tmp_path, seed, quantization):
    """load_format=dummy with a quantization argument (the benchmark presets' path): random float
    weights rounded into the layout, the engine runs."""
    from baryon import LLM, SamplingParams

    path = make_checkpoint(tmp_path / "dense", "qwen3", seed=seed % 1000)
    llm = LLM(model=str(path), dtype="float32", device="cpu", load_format="dummy", quantization=quantization)
    layer = llm.engine.core.runner.model.model.layers[1].mlp.down_proj
    assert type(layer.method).__name__ != "DenseLinearMethod"
    assert "weight" not in dict(layer.named_parameters())  # the float weight is gone after repacking
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_online_quantized_engine_generates(tmp_path, seed):
    """Online FP8 / W8A8 / W4A16 of a float checkpoint: every decoder projection holds the new
    layout (the router, embeddings and LM head stay float) and the engine generates."""
    from baryon import LLM, SamplingParams

    path = make_checkpoint(tmp_path / "moe", "qwen3_moe", seed=seed % 1000)
    prompts = [{"prompt_token_ids": [3, 5, 7, 11]}]
    for quantization, linear, experts in [("fp8", "Fp8LinearMethod", "Fp8MoEMethod"),
                                          ("w8a8", "Int8LinearMethod", None),
                                          ("w4a16", "WNA16LinearMethod", "Int4MoEMethod")]:
        try:
            llm = LLM(model=str(path), dtype="float32", device="cpu", quantization=quantization)
        except ValueError as e:
            assert experts is None and "mixture-of-experts" in str(e)
            continue
        model = llm.engine.core.runner.model
        layer = model.model.layers[0]
        assert type(layer.self_attn.qkv_proj.method).__name__ == linear
        assert type(layer.mlp.experts.method).__name__ == experts
        assert type(layer.mlp.gate.method).__name__ == "DenseLinearMethod"
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6


def test_quantization_argument_on_a_gguf_file_is_an_error(tmp_path):
    pytest.importorskip("gguf")
    from baryon import LLM

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError):
        LLM(model=str(gguf), device="cpu", quantization="fp8")


def test_fused_parts_must_agree(tmp_path, seed):
    from baryon import LLM

    path = make_checkpoint(tmp_path / "dense", "llama", seed=seed % 1000)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "ignored_layers": ["model.layers.0.self_attn.k_proj"]}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only some are quantized"):
        LLM(model=str(path), dtype="float32", device="cpu", skip_tokenizer_init=True)


def _layer_with(method, n: int, k: int, gen: torch.Generator, checkpoint: dict[str, torch.Tensor]):
    from baryon.layers.linear import ReplicatedLinear
    from baryon.loader.quantized import process_weights_after_loading

    layer = ReplicatedLinear(k, n, bias=False)
    layer.use_method(method)
    params = dict(layer.named_parameters())
    for name, tensor in checkpoint.items():
        params[name].weight_loader(params[name], tensor)
    process_weights_after_loading(layer)
    return layer


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton route in the CPU interpreter (float32); on CUDA "
                    "the kernel test files run the kernels")
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_act_order_layers_gather_activations_for_each_kernel(seed, kernel, monkeypatch):
    """A GPTQ act-order layer (g_idx a permutation of the groups) through the selected W4A16
    kernel, the Triton one in the interpreter: its output is x @ dequantized weight.T."""
    from baryon.quantization.wna16 import WNA16LinearMethod

    monkeypatch.setenv("BARYON_KERNEL_W4A16_LINEAR", kernel)
    gen = torch.Generator().manual_seed(seed)
    n, k, group = 48, 96, 16
    g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32)  # column k's group
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    qweight = sum(codes[j::8] << (4 * j) for j in range(8)).to(torch.int32)  # [k / 8, n], along K
    zeros = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.int32)
    qzeros = sum(((zeros[:, j::8] - 1) & 15) << (4 * j) for j in range(8)).to(torch.int32)  # v1: zero - 1
    scales = torch.rand(k // group, n, generator=gen) * 0.01 + 0.001
    layer = _layer_with(WNA16LinearMethod("gptq", 4, group, symmetric=False, act_order=True), n, k, gen,
                        {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx})
    expected_weight = (codes.float() - zeros.float()[g_idx.long()]) * scales[g_idx.long()]  # [k, n]
    assert torch.equal(layer.method.dequantize(layer), expected_weight.t())
    x = torch.randn(5, k, generator=gen)
    torch.testing.assert_close(layer(x), x @ expected_weight, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton route in the CPU interpreter (float32); on CUDA "
                    "the kernel test files run the kernels")
@pytest.mark.parametrize("scheme", ["fp8-channel", "fp8-block", "int8"])
def test_activation_quantized_layers_on_triton(seed, scheme, monkeypatch):
    """The GPU route of FP8 / INT8 layers (activation quantization + the Triton GEMM), here in the
    interpreter: within the activations' quantization error of x @ dequantized weight.T."""
    from baryon.quantization.fp8 import Fp8LinearMethod
    from baryon.quantization.int8 import Int8LinearMethod

    for family in ("ACT_QUANT", "FP8_LINEAR", "INT8_LINEAR"):
        monkeypatch.setenv(f"BARYON_KERNEL_{family}", "triton")
    gen = torch.Generator().manual_seed(seed)
    n, k = 64, 96
    weight = torch.randn(n, k, generator=gen) * 0.05
    if scheme == "fp8-channel":
        q, scale = quantize_fp8_per_channel(weight)
        method, checkpoint = Fp8LinearMethod("channel", False), {"weight": q, "weight_scale": scale[:, None]}
    elif scheme == "fp8-block":
        q, scale = quantize_fp8_blocks(weight, (32, 32))
        method = Fp8LinearMethod("block", False, (32, 32), scale_name="weight_scale_inv")
        checkpoint = {"weight": q, "weight_scale_inv": scale}
    else:
        from baryon.quantization.int8 import quantize_int8_per_channel

        q, scale = quantize_int8_per_channel(weight)
        method, checkpoint = Int8LinearMethod(), {"weight": q, "weight_scale": scale[:, None]}
    layer = _layer_with(method, n, k, gen, checkpoint)
    assert layer.method.kernel.name == "triton"
    dense = layer.method.dequantize(layer)
    x = torch.randn(7, k, generator=gen)
    exact = x @ dense.t()
    # activations rounded to e4m3 (3 mantissa bits) or to 1/127 of their row's max: a few percent
    # of the output at most, where a wrong scale or tile would be off by its whole size
    bound = 0.06 if scheme.startswith("fp8") else 0.02
    assert (layer(x) - exact).norm() <= bound * exact.norm()


def test_fp8_to_float_is_the_cast(seed):
    """The CPU table conversion equals torch's cast for every byte and for strided tensors."""
    from baryon.kernels.quant.act_quant import FP8, fp8_to_float

    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    assert torch.equal(fp8_to_float(every).nan_to_num(0.5), every.float().nan_to_num(0.5))
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(37, 50, generator=gen) * 40).to(FP8)
    assert torch.equal(fp8_to_float(q.t()), q.t().float())
    assert fp8_to_float(q).shape == (37, 50)


@pytest.mark.parametrize("rank", [0, 1])
def test_quantized_parameters_shard_across_tensor_parallel_ranks(seed, rank, monkeypatch):
    """Rank `rank` of 2 takes its rows of block scales in a fused column layer (each part cut in
    two) and its input rows of GPTQ tensors in a row-parallel layer (packed along K)."""
    import baryon.layers.linear as linear

    monkeypatch.setattr(linear, "tp_world_size", lambda: 2)
    monkeypatch.setattr(linear, "tp_rank", lambda: rank)
    gen = torch.Generator().manual_seed(seed)
    merged = linear.MergedColumnParallelLinear(64, [64, 128], bias=False)  # this rank: 32 + 64 rows
    scale = merged.add_param("weight_scale_inv", (6, 4), torch.float32, output_block=16)
    gate, up = torch.rand(4, 4, generator=gen), torch.rand(8, 4, generator=gen)  # whole checkpoint tensors
    merged.weight_loader(scale, gate, 0)
    merged.weight_loader(scale, up, 1)
    assert torch.equal(scale.data, torch.cat([gate[2 * rank:2 * rank + 2], up[4 * rank:4 * rank + 4]]))

    row = linear.RowParallelLinear(128, 48, bias=False)  # this rank: input features 64 * rank ...
    qweight = row.add_param("qweight", (8, 48), torch.int32, output_dim=1, input_dim=0)
    scales = row.add_param("scales", (2, 48), torch.float32, output_dim=1, input_dim=0)
    full_q = torch.randint(0, 2**31 - 1, (16, 48), generator=gen, dtype=torch.int32)  # [K / 8, N]
    full_s = torch.rand(4, 48, generator=gen)  # groups of 32 over K = 128
    row.weight_loader(qweight, full_q)
    row.weight_loader(scales, full_s)
    assert torch.equal(qweight.data, full_q[8 * rank:8 * rank + 8])
    assert torch.equal(scales.data, full_s[2 * rank:2 * rank + 2])


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": True},
    {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
    {"quant_method": "fp8", "activation_scheme": "static"},
])
def test_dummy_weights_in_a_checkpoints_own_layout(tmp_path, seed, quantization_config):
    """load_format=dummy on a quantized checkpoint's config: random codes, valid scales and
    act-order maps in the published layout; the engine runs (dense and MoE)."""
    from baryon import LLM, SamplingParams

    for arch in ("qwen3", "qwen3_moe"):
        overrides = {"head_dim": 32} if arch == "qwen3" else {}
        path = make_checkpoint(tmp_path / arch, arch, seed=seed % 1000, **overrides)
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (path / "config.json").write_text(json.dumps(config))
        llm = LLM(model=str(path), dtype="float32", device="cpu", load_format="dummy", skip_tokenizer_init=True)
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_compressed_tensors_groups_rank_exact_names_then_patterns_then_the_class():
    """As the compressed_tensors package matches them, whatever the groups' order in the config: a
    module's exact name wins over a `re:` pattern, which wins over the class target `Linear`."""
    from baryon.quantization.compressed_tensors import CompressedTensorsConfig

    def group(targets, bits):
        return {"targets": targets, "weights": {"type": "int", "num_bits": bits, "strategy": "group",
                                                "group_size": 32, "symmetric": True}}

    config = CompressedTensorsConfig({"format": "pack-quantized", "config_groups": {
        "everything": group(["Linear"], 4), "attention": group(["re:.*self_attn.*"], 8),
        "one": group(["model.layers.0.self_attn.o_proj"], 4)}})
    assert config._group_for("model.layers.0.mlp.up_proj")["targets"] == ["Linear"]
    assert config._group_for("model.layers.1.self_attn.q_proj")["targets"] == ["re:.*self_attn.*"]
    assert config._group_for("model.layers.0.self_attn.o_proj")["targets"] == ["model.layers.0.self_attn.o_proj"]
    assert config.linear_method(None, "model.layers.1.self_attn.q_proj").bits == 8
