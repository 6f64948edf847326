"""Loading mixture-of-experts checkpoints.

- Broken Qwen3-MoE / Mixtral checkpoints (a missing expert tensor, an expert the config does not
  have, a config whose expert count disagrees with the checkpoint) are refused with an error that
  names the checkpoint tensor under its own name (Mixtral's `block_sparse_moe` / `w3`).
- GLM-4.5's multi-token-prediction layers, stored past `num_hidden_layers`, are skipped (and the
  model still matches transformers), but only as many of them as `num_nextn_predict_layers` says.
- Expert parallelism: a FusedMoE rank keeps exactly its slice of the experts at load and its
  forward is the reference restricted to that slice.
- GGUF files of Qwen3-MoE, Qwen2-MoE and Mixtral written the way llama.cpp's converter writes
  them (experts stacked per layer) load back to transformers' greedy tokens.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from baryon import LLM, SamplingParams
from baryon.kernels.moe.experts_torch import fused_experts_reference
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.loader.weights import WeightLoadError
from conftest import TEST_SEED, hf_greedy, make_checkpoint, random_prompts
from test_gguf import hf_state, write_gguf
from test_loader import variant

VOCAB = 128
NUM_LAYERS = 2  # conftest's BASE_CONFIG
NUM_EXPERTS = 8  # conftest's MOE_BASE for qwen3_moe and glm4_moe
NUM_NEW = 16
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# A checkpoint name of one expert's tensor, as it may appear in an error message.
EXPERT_TENSOR = re.compile(r"model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.\w+\.weight")


# -- helpers ----------------------------------------------------------------------------------

def build(path) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.01)


def load_error(path) -> str:
    """The message of the WeightLoadError that loading `path` raises."""
    with pytest.raises(WeightLoadError) as e:
        build(path)
    return str(e.value)


def expert_tensors_named(message: str) -> set[str]:
    return set(EXPERT_TENSOR.findall(message))


def assert_greedy_matches_transformers(llm: LLM, ckpt: Path, seed: int) -> None:
    prompts = random_prompts(2, VOCAB, 3, 20, seed)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(ckpt, prompt, NUM_NEW)[0], f"prompt {prompt}"


def with_expert_count(src: Path, dst: Path, num_experts: int, mutate=lambda tensors: None) -> Path:
    """A copy of `src` whose config says `num_experts` (edited through transformers' config class,
    which stores the count under whichever key this transformers version uses) and whose
    tensors went through `mutate`."""
    from transformers import AutoConfig

    variant(src, dst, mutate)
    config = AutoConfig.from_pretrained(src)
    config.num_experts = num_experts
    config.save_pretrained(dst)
    return dst


# -- loader errors ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    seed = (TEST_SEED + zlib.crc32(b"test_moe")) % 2**31
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=seed)


def test_missing_expert_tensor_is_named(qwen3_moe, tmp_path, seed):
    rng = random.Random(seed)
    layer, expert, projection = rng.randrange(NUM_LAYERS), rng.randrange(NUM_EXPERTS), rng.choice(PROJECTIONS)
    name = f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
    path, _ = variant(qwen3_moe, tmp_path / "missing", lambda tensors: tensors.pop(name))

    message = load_error(path)
    assert expert_tensors_named(message) == {name}, message
    stacked = "w2_weight" if projection == "down_proj" else "w13_weight"
    assert f"model.layers.{layer}.mlp.experts.{stacked}" in message


def test_expert_beyond_the_config_is_named(qwen3_moe, tmp_path, seed):
    rng = random.Random(seed)
    layer, projection = rng.randrange(NUM_LAYERS), rng.choice(PROJECTIONS)
    name = f"model.layers.{layer}.mlp.experts.{NUM_EXPERTS}.{projection}.weight"

    def add_expert(tensors):
        like = tensors[f"model.layers.{layer}.mlp.experts.0.{projection}.weight"]
        tensors[name] = torch.randn(like.shape, generator=torch.Generator().manual_seed(seed))

    path, _ = variant(qwen3_moe, tmp_path / "extra", add_expert)
    message = load_error(path)
    assert repr(name) in message and f"expert {NUM_EXPERTS} does not exist" in message, message


def test_config_with_fewer_experts_than_the_checkpoint(qwen3_moe, tmp_path):
    """num_experts 8 -> 6: the router weight [8, hidden] is mis-shaped and experts 6, 7 are extra;
    whichever the loader meets first is named."""
    message = load_error(with_expert_count(qwen3_moe, tmp_path / "six", 6))
    named = re.search(r"'(model\.layers\.\d+\.mlp\.(?:gate\.weight|experts\.[67]\.\w+\.weight))'", message)
    assert named, f"the error names neither the router nor an extra expert: {message}"
    if named[1].endswith(".gate.weight"):
        assert "(8, 64)" in message and "(6, 64)" in message, message
    else:
        assert "does not exist" in message, message


def test_config_with_more_experts_than_the_checkpoint(qwen3_moe, tmp_path, seed):
    """num_experts 8 -> 10: the router [8, hidden] is mis-shaped for 10 experts; with a router of
    10 rows, every tensor of experts 8 and 9 is missing and named."""
    message = load_error(with_expert_count(qwen3_moe, tmp_path / "ten", 10))
    assert re.search(r"'model\.layers\.\d+\.mlp\.gate\.weight'", message), message
    assert "(8, 64)" in message and "(10, 64)" in message, message

    gen = torch.Generator().manual_seed(seed)

    def widen_routers(tensors):
        for layer in range(NUM_LAYERS):
            name = f"model.layers.{layer}.mlp.gate.weight"
            tensors[name] = torch.cat([tensors[name], torch.randn(2, tensors[name].shape[1], generator=gen)])

    message = load_error(with_expert_count(qwen3_moe, tmp_path / "ten_routers", 10, widen_routers))
    assert expert_tensors_named(message) == {f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
                                             for layer in range(NUM_LAYERS) for expert in (8, 9)
                                             for projection in PROJECTIONS}, message


def test_missing_mixtral_expert_is_named_as_in_the_checkpoint(tmp_path, seed):
    """Mixtral's tensors load through a rename (`block_sparse_moe` -> `mlp`, w1/w3/w2): the error
    still gives the checkpoint's own name."""
    ckpt = make_checkpoint(tmp_path / "mixtral", "mixtral", seed=seed)
    rng = random.Random(seed)
    layer, expert, projection = rng.randrange(NUM_LAYERS), rng.randrange(4), rng.choice(("w1", "w2", "w3"))
    name = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{projection}.weight"
    path, _ = variant(ckpt, tmp_path / "missing", lambda tensors: tensors.pop(name))

    assert expert_tensors_named(load_error(path)) == {name}


# -- GLM-4.5 multi-token-prediction layers ----------------------------------------------------

def add_mtp_layer(tensors: dict[str, torch.Tensor], index: int, gen: torch.Generator) -> None:
    """A multi-token-prediction layer at `index`: a full decoder layer (the last one's tensors,
    experts included) plus the MTP projections and norms, as GLM-4.5 checkpoints store it."""
    last = f"model.layers.{NUM_LAYERS - 1}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[name.replace(last, f"model.layers.{index}.")] = torch.randn(tensors[name].shape, generator=gen)
    hidden = tensors["model.norm.weight"].shape[0]
    tensors[f"model.layers.{index}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{index}.{norm}.weight"] = torch.randn(hidden, generator=gen)


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory) -> Path:
    seed = (TEST_SEED + zlib.crc32(b"test_moe_glm")) % 2**31
    ckpt = make_checkpoint(tmp_path_factory.mktemp("glm4_moe"), "glm4_moe", seed=seed)
    assert json.loads((ckpt / "config.json").read_text())["num_nextn_predict_layers"] == 1  # HF default
    return ckpt


def test_glm_mtp_layer_is_skipped(glm4_moe, tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    path, _ = variant(glm4_moe, tmp_path / "mtp", lambda tensors: add_mtp_layer(tensors, NUM_LAYERS, gen))
    assert_greedy_matches_transformers(build(path), glm4_moe, seed)


@pytest.mark.parametrize("nextn,index", [(1, NUM_LAYERS + 1), (0, NUM_LAYERS)],
                         ids=["past-the-mtp-count", "no-mtp-layers"])
def test_layer_past_the_mtp_layers_is_unexpected(glm4_moe, tmp_path, seed, nextn, index):
    gen = torch.Generator().manual_seed(seed)
    path, _ = variant(glm4_moe, tmp_path / "extra", lambda tensors: add_mtp_layer(tensors, index, gen))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": nextn}))
    message = load_error(path)
    assert re.search(rf"unexpected tensor 'model\.layers\.{index}\.", message), message


# -- expert parallelism -----------------------------------------------------------------------

HIDDEN, INTER, TOP_K = 32, 16, 2


def random_experts(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every expert's gate (w1), up (w3) and down (w2) matrix: [experts, out, in]."""
    return {"w1": torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=gen),
            "w3": torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=gen),
            "w2": torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen)}


@pytest.mark.parametrize("ep_size,rank", [(2, 1), (2, 0), (4, 2)])
def test_expert_parallel_rank_keeps_its_slice(seed, ep_size, rank):
    gen = torch.Generator().manual_seed(seed)
    weights = random_experts(gen)
    with torch.device("cpu"):
        layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTER, ep_size=ep_size, ep_rank=rank)
    assert layer.w13_weight.dtype == torch.float32
    local = NUM_EXPERTS // ep_size
    start = rank * local
    assert (layer.expert_start, layer.num_local_experts) == (start, local)

    layer.w13_weight.data.fill_(float("nan"))  # anything left unwritten shows
    layer.w2_weight.data.fill_(float("nan"))
    loads = [(shard, expert) for shard in ("w1", "w2", "w3") for expert in range(NUM_EXPERTS)]
    random.Random(seed).shuffle(loads)
    for shard, expert in loads:  # other ranks' experts are skipped without error
        param = layer.w2_weight if shard == "w2" else layer.w13_weight
        param.weight_loader(param, weights[shard][expert], shard, expert)

    mine = slice(start, start + local)
    assert torch.equal(layer.w13_weight, torch.cat([weights["w1"][mine], weights["w3"][mine]], dim=1))
    assert torch.equal(layer.w2_weight, weights["w2"][mine])

    tokens = 24
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.rand(tokens, NUM_EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    ids[0] = torch.tensor([e for e in range(NUM_EXPERTS) if not start <= e < start + local][:TOP_K])
    topk_weights = torch.rand(tokens, TOP_K, generator=gen).softmax(dim=1)
    out = layer(x, topk_weights, ids)

    w13_all = torch.cat([weights["w1"], weights["w3"]], dim=1)
    expected = fused_experts_reference(x, w13_all[mine], weights["w2"][mine], topk_weights, ids, start)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # The same as all experts with the other ranks' zeroed: they contribute nothing.
    others = torch.ones(NUM_EXPERTS, dtype=torch.bool)
    others[mine] = False
    zeroed = fused_experts_reference(x, w13_all.masked_fill(others[:, None, None], 0),
                                     weights["w2"].masked_fill(others[:, None, None], 0), topk_weights, ids)
    torch.testing.assert_close(out, zeroed, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0], torch.zeros(HIDDEN))  # routed to other ranks only
    assert out[1:].abs().sum(dim=1).gt(0).any()


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_stacked_expert_tensors_load_on_an_expert_parallel_rank(seed, mxfp4):
    """GPT-OSS publishes each layer's experts in one tensor ([experts, gate rows then up rows, ...]
    once the model has converted them): rank 1 of 2 keeps its experts' slices, biases included
    (MXFP4 blocks and scales too, dequantized at load on CPU), and the layer equals the float
    reference on its experts."""
    from baryon.kernels.moe.expert_activation import ExpertActivation
    from baryon.kernels.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from baryon.quantization.mxfp4 import Mxfp4MoEMethod

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 64, 32
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=gen) / 8
    w2 = torch.randn(NUM_EXPERTS, hidden, inter, generator=gen) / 6
    b13, b2 = torch.randn(NUM_EXPERTS, 2 * inter, generator=gen), torch.randn(NUM_EXPERTS, hidden, generator=gen)
    activation = ExpertActivation("clamped_swiglu", limit=1.0)
    with torch.device("cpu"):
        layer = FusedMoE(NUM_EXPERTS, TOP_K, hidden, inter, ep_size=2, ep_rank=1, bias=True, activation=activation)
        if mxfp4:
            layer.use_method(Mxfp4MoEMethod())
    tensors = {"w13_bias": b13, "w2_bias": b2}
    if mxfp4:
        (w13_blocks, w13_scales), (w2_blocks, w2_scales) = quantize_mxfp4(w13), quantize_mxfp4(w2)
        tensors.update(w13_blocks=w13_blocks, w13_scales=w13_scales, w2_blocks=w2_blocks, w2_scales=w2_scales)
        w13, w2 = dequantize_mxfp4(w13_blocks, w13_scales), dequantize_mxfp4(w2_blocks, w2_scales)
    else:
        tensors.update(w13_weight=w13, w2_weight=w2)
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor, name.split("_")[0], None)
    with pytest.raises(ValueError, match="first dimension should be the 8 experts"):
        layer.w2_bias.weight_loader(layer.w2_bias, b2[:4], "w2", None)
    layer.method.process_weights_after_loading(layer)
    mine = slice(NUM_EXPERTS // 2, NUM_EXPERTS)
    assert torch.equal(layer.w13_bias, b13[mine]) and torch.equal(layer.w2_bias, b2[mine])
    held13, held2 = layer.method.dequantize(layer)
    assert torch.equal(held13, w13[mine]) and torch.equal(held2, w2[mine])
    x = torch.randn(12, hidden, generator=gen)
    ids = torch.rand(12, NUM_EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    weights = torch.rand(12, TOP_K, generator=gen).softmax(dim=1)
    expected = fused_experts_reference(x, w13[mine], w2[mine], weights, ids, NUM_EXPERTS // 2, b13[mine], b2[mine],
                                       activation)
    torch.testing.assert_close(layer(x, weights, ids), expected, rtol=1e-4, atol=1e-4)


def test_expert_weight_loader_rejects_bad_shard_and_expert_ids(seed):
    weights = random_experts(torch.Generator().manual_seed(seed))
    with torch.device("cpu"):
        layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTER, ep_size=2, ep_rank=1)
    expert = random.Random(seed).randrange(4, NUM_EXPERTS)
    with pytest.raises(ValueError, match="shard id 'w4'"):
        layer.weight_loader(layer.w13_weight, weights["w1"][expert], "w4", expert)
    for bad in (NUM_EXPERTS, NUM_EXPERTS + 5, -1):
        with pytest.raises(ValueError, match=f"expert {bad} does not exist"):
            layer.weight_loader(layer.w13_weight, weights["w1"][expert], "w1", bad)
    with pytest.raises(ValueError, match="does not match"):  # an up matrix of the down's shape
        layer.weight_loader(layer.w13_weight, weights["w2"][expert], "w3", expert)


# -- GGUF ---------------------------------------------------------------------------------------

def stack_experts(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's converter: each layer's per-expert matrices `<prefix>.experts.<e>.<proj>.weight`
    become one [experts, out, in] tensor `<prefix>.experts.<proj>.weight` (which gguf's
    TensorNameMap names `blk.<i>.ffn_{gate,up,down}_exps`)."""
    per_expert = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
    stacks: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    out = {}
    for name, array in state.items():
        match = per_expert.match(name)
        if match:
            stacks[f"{match['prefix']}.{match['proj']}.weight"][int(match["expert"])] = array
        else:
            out[name] = array
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def moe_gguf_from_checkpoint(ckpt: Path, arch: str, path: Path) -> None:
    config, state = hf_state(ckpt)
    rope = config.get("rope_parameters") or {}
    config = {**config, "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0))}

    def expert_metadata(writer):
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if arch != "llama":  # Mixtral's experts have the feed_forward_length (intermediate_size)
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])

    stored = write_gguf(path, arch, config, stack_experts(state), extra_metadata=expert_metadata)
    assert "blk.1.ffn_gate_exps.weight" in stored and "blk.1.ffn_gate_inp.weight" in stored
    assert ("blk.1.ffn_gate_inp_shexp.weight" in stored) == (arch == "qwen2moe")


# llama.cpp renormalises the top-k weights of Qwen3-MoE and Mixtral, not Qwen2-MoE's: the
# source checkpoints say the same, so transformers on them is the reference.
GGUF_CASES = [
    ("qwen3moe", "qwen3_moe", dict(norm_topk_prob=True)),
    ("qwen2moe", "qwen2_moe", dict(norm_topk_prob=False)),
    ("llama", "mixtral", dict()),
]


@pytest.mark.parametrize("gguf_arch,arch,overrides", GGUF_CASES, ids=[c[1] for c in GGUF_CASES])
def test_moe_gguf_greedy_parity(tmp_path, seed, gguf_arch, arch, overrides):
    ckpt = make_checkpoint(tmp_path / arch, arch, seed=seed, **overrides)
    moe_gguf_from_checkpoint(ckpt, gguf_arch, tmp_path / f"{arch}.gguf")
    llm = build(tmp_path / f"{arch}.gguf")
    hf_config = llm.config.model.hf_config
    assert hf_config.architectures == json.loads((ckpt / "config.json").read_text())["architectures"]
    if "norm_topk_prob" in overrides:
        assert hf_config.norm_topk_prob == overrides["norm_topk_prob"]
    assert_greedy_matches_transformers(llm, ckpt, seed)
