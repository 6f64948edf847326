"""Tensor parallelism over quantized checkpoints (CPU, gloo, two processes): each rank takes its
part of the packed weights and of their block / group / channel scales, so TP=2 gives the same
greedy tokens and logprobs as TP=1 on the same checkpoint; online W4A16 too (online FP8 scales
each rank's shard: close, not identical). GPTQ act order: row-parallel layers dequantize their columns."""

from __future__ import annotations

import pytest
import torch

import quant_checkpoints as qc
from baryon import LLM, SamplingParams
from conftest import cpu_engine_with_triton, make_checkpoint, random_prompts

# Token-for-token comparisons with float checkpoints: the exact packed CPU kernel.
pytestmark = pytest.mark.usefixtures("exact_packed_kernels")

FORMATS = {
    "fp8-block16": lambda src, dst: qc.fp8_block(src, dst, (16, 16)),
    "fp8-tensor": lambda src, dst: qc.fp8_per_tensor(src, dst),
    "gptq-g32": lambda src, dst: qc.gptq(src, dst, bits=4, group_size=32),
    "awq-g32": lambda src, dst: qc.awq(src, dst, group_size=32),
    "ct-w8a8": lambda src, dst: qc.compressed_tensors(src, dst, qc.ct_scheme("W8A8")),
    "ct-w4a16-g32": lambda src, dst: qc.compressed_tensors(src, dst, qc.ct_scheme("W4A16", group_size=32)),
}


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    # Widths whose halves are still multiples of 128 (online W4A16's group size).
    return make_checkpoint(tmp_path_factory.mktemp("tpq_float"), "llama", seed=4, hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def greedy(path, prompts, tp: int, **kwargs) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    with LLM(str(path), tensor_parallel_size=tp, skip_tokenizer_init=True, device="cpu", **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def assert_same(one, two) -> None:
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(one, two):
        assert tokens2 == tokens1
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2)) < 1e-4


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_checkpoint_tp2_matches_tp1(float_llama, tmp_path, seed, name):
    if name.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
    path = FORMATS[name](float_llama, tmp_path / name).path
    prompts = random_prompts(3, 128, 3, 12, seed)
    assert_same(greedy(path, prompts, 1), greedy(path, prompts, 2))


def test_online_w4a16_tp2_matches_tp1(float_llama, seed):
    """Each rank's half of a row-parallel input is a whole number of 128-column groups: the same
    codes and scales as on one rank."""
    prompts = random_prompts(3, 128, 3, 12, seed)
    assert_same(greedy(float_llama, prompts, 1, quantization="w4a16"),
                greedy(float_llama, prompts, 2, quantization="w4a16"))


def test_online_fp8_tp2_follows_tp1(float_llama, seed):
    """Online FP8 scales each output channel, and each token's activations, over the columns a
    rank holds, so row-parallel layers (o_proj, down_proj) quantize per shard: TP=2 is a
    different FP8 rounding of the same model, not TP=1's bits. Its error against the float model
    (first token's logprob, same prefix everywhere), averaged over the prompts, must be of TP=1's
    size (one prompt's error alone varies too much: 0.005 on TP=1 against 0.145 on TP=2 was seen)."""
    prompts = random_prompts(6, 128, 3, 12, seed)
    exact = greedy(float_llama, prompts, 1)
    one, two = greedy(float_llama, prompts, 1, quantization="fp8"), greedy(float_llama, prompts, 2, quantization="fp8")
    errors_one, errors_two = [], []
    for (tokens0, logprobs0), (tokens1, logprobs1), (tokens2, logprobs2) in zip(exact, one, two):
        if tokens1[0] != tokens0[0] or tokens2[0] != tokens0[0]:
            continue  # a near-tie that FP8 rounding flips: the logprobs are of different tokens
        errors_one.append(abs(logprobs1[0] - logprobs0[0]))
        errors_two.append(abs(logprobs2[0] - logprobs0[0]))
    assert errors_two, "every prompt's first token flipped under FP8"
    mean_one, mean_two = sum(errors_one) / len(errors_one), sum(errors_two) / len(errors_two)
    assert mean_two < 3 * mean_one + 0.1, (errors_one, errors_two)


@pytest.mark.parametrize("fmt, bits, sym, static_groups", [("gptq", 4, False, False), ("gptq", 8, True, False),
                                                          ("gptq", 4, True, True), ("ct", 4, False, False)])
def test_gptq_act_order_tp2_matches_tp1(float_llama, tmp_path, seed, fmt, bits, sym, static_groups):
    """GPTQ act order (desc_act=True) and compressed-tensors' actorder "group": a row-parallel
    layer's ranks each hold a share of every group's columns, so each loads every group's scales
    and zero points and dequantizes its columns at load (its weights exactly the checkpoint's
    dequantized columns); with static groups (g_idx in column order) each rank keeps its own
    groups packed. Column-parallel layers keep the packed kernel. TP=2 gives TP=1's greedy tokens
    and logprobs."""
    if fmt == "ct":
        checkpoint = qc.ct_group_act_order(float_llama, tmp_path / "ct-act", bits=bits, group_size=32, sym=sym,
                                           seed=seed)
    else:
        checkpoint = qc.gptq(float_llama, tmp_path / "gptq-act", bits=bits, group_size=32, desc_act=True, sym=sym,
                             seed=seed, static_groups=static_groups)
    prompts = random_prompts(3, 128, 3, 12, seed)
    one = greedy(checkpoint.path, prompts, 1)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    with LLM(str(checkpoint.path), tensor_parallel_size=2, skip_tokenizer_init=True, device="cpu") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        layer = llm.engine.core.runner.model.model.layers[0]
        for module, name in ((layer.self_attn.o_proj, "self_attn.o_proj"), (layer.mlp.down_proj, "mlp.down_proj")):
            assert module.method.dense_columns != static_groups
            whole = checkpoint.reference[f"model.layers.0.{name}.weight"]  # [N, K] float32
            half = whole.shape[1] // 2
            held = module.weight.float() if module.method.dense_columns else module.method.dequantize(module)
            assert torch.equal(held, whole[:, :half])
        assert not layer.self_attn.qkv_proj.method.dense_columns  # the input whole: the packed kernel
    two = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
           for o in outs]
    assert_same(one, two)


def test_gptq_act_order_experts_over_two_ranks(tmp_path, seed):
    """MoE experts with act order: with expert parallelism each rank holds whole experts and
    gives TP=1's tokens and logprobs; splitting every expert's intermediate size over the ranks
    would leave each rank a share of every group's columns, and is refused by name."""
    src = make_checkpoint(tmp_path / "float", "qwen3_moe", seed=seed, hidden_size=128, intermediate_size=256,
                          moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32)
    path = qc.gptq(src, tmp_path / "gptq-act", bits=4, group_size=16, desc_act=True, seed=seed).path
    prompts = random_prompts(2, 128, 3, 8, seed)
    assert_same(greedy(path, prompts, 1), greedy(path, prompts, 2, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="act order .* cannot split their intermediate size .* enable_expert_parallel"):
        LLM(str(path), tensor_parallel_size=2, skip_tokenizer_init=True, device="cpu")


@cpu_engine_with_triton
def test_packed_int4_experts_over_two_ranks(tmp_path, seed, monkeypatch):
    """GPTQ experts held packed for the int4 expert kernels (interpreted here, in every rank's
    process): split over two ranks by their intermediate size (each rank packing its half of
    gate/up's rows and of down's K groups) or by expert, TP=2 gives TP=1's tokens and logprobs."""
    monkeypatch.setenv("BARYON_KERNEL_FUSED_MOE_INT4", "triton")
    src = make_checkpoint(tmp_path / "float", "qwen3_moe", seed=seed, hidden_size=128, intermediate_size=256,
                          moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, num_hidden_layers=1)
    path = qc.gptq(src, tmp_path / "gptq", bits=4, group_size=32, seed=seed).path
    prompts = random_prompts(2, 128, 3, 8, seed)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1)

    def run(tp: int, **kwargs):
        with LLM(str(path), tensor_parallel_size=tp, skip_tokenizer_init=True, device="cpu", **kwargs) as llm:
            if tp == 1:  # the int4 kernel's layout, not float experts
                assert llm.engine.core.runner.model.model.layers[0].mlp.experts.method.packed
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    one = run(1)
    assert_same(one, run(2))  # every expert, half its intermediate size per rank
    assert_same(one, run(2, enable_expert_parallel=True))  # two whole experts per rank
