"""Triton kernels against the references: on CUDA when present, else in Triton's interpreter
(TRITON_INTERPRET=1, set by conftest) on small shapes."""

from __future__ import annotations

import math

import pytest
import torch

from test_kernels import _case, dense_attention

triton_paged = pytest.importorskip("baryon.kernels.attention.triton_paged")
if triton_paged.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [  # (heads, kv_heads, head_dim, block_size, window)
    (2, 2, 64, 16, None), (4, 2, 64, 8, None), (8, 2, 64, 16, 7), (4, 1, 128, 4, None), (16, 2, 64, 32, 3),
]


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", SHAPES)
@pytest.mark.parametrize("kind", ["mixed", "decode", "fresh-prefill"])
def test_triton_paged_attention_matches_dense(seed, heads, kv_heads, head_dim, block_size, window, kind):
    gen = torch.Generator().manual_seed(seed)
    if kind == "decode":
        seqs = [(int(torch.randint(0, 40, (1,), generator=gen)), 1) for _ in range(3)]
    elif kind == "fresh-prefill":  # nothing cached yet: every key comes from this step
        seqs = [(0, 9), (0, 40), (0, 1)]
    else:  # prefill with and without cached prefix, decodes, a 1-token prompt, a chunk > BLOCK_Q
        seqs = [(0, 5), (9, 1), (17, 4), (0, 1), (3, 37)]
    cache, md, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, block_size)
    cache, q, k, v = _to(DEVICE, cache, q, k, v)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(DEVICE))
    scale = 1 / math.sqrt(head_dim)
    out = triton_paged.TritonPagedAttention(heads, head_dim, kv_heads, scale, window).forward(q, k, v, cache, md)
    start = 0
    for (cached, new), fk, fv in zip(seqs, full_k, full_v):
        expected = dense_attention(q[start:start + new].cpu(), fk, fv, scale, window)
        torch.testing.assert_close(out[start:start + new].cpu(), expected, atol=2e-3, rtol=2e-3)
        start += new


def test_triton_store_kv_skips_padding(seed):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, 3, 4, 2, 64, device=DEVICE)
    key = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    value = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    slots = torch.tensor([6, -1, 0, 11], device=DEVICE)
    triton_paged.store_kv(key, value, cache, slots)
    flat = cache.view(2, 12, 2, 64)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat[0, slot], key[i])
            torch.testing.assert_close(flat[1, slot], value[i])
    assert int((flat.abs().sum((-1, -2)) > 0).sum()) == 6  # three slots, keys and values


def test_selector_keeps_torch_on_cpu_unless_forced(monkeypatch):
    from baryon.kernels import selector

    from baryon.kernels.triton_utils import INTERPRETED

    cpu = torch.device("cpu")
    assert selector.select("attention", cpu, head_dim=64).name in ("cpu", "torch")  # never Triton unforced
    if not INTERPRETED:
        pytest.skip("forcing Triton on CPU needs the interpreter (TRITON_INTERPRET=1 before import)")
    monkeypatch.setenv("BARYON_KERNEL_ATTENTION", "triton")
    assert selector.select("attention", cpu, head_dim=64).name == "triton"
    with pytest.raises(ValueError, match="head_dim 8"):
        selector.select("attention", cpu, head_dim=8)


@pytest.mark.parametrize("hidden", [64, 96, 1000])
@pytest.mark.parametrize("with_residual", [True, False])
def test_triton_rms_norm_matches_torch(seed, hidden, with_residual):
    from baryon.kernels.norm import TorchRMSNorm, TritonRMSNorm

    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(5, hidden, generator=gen).to(DEVICE) for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(DEVICE)
    res = residual if with_residual else None
    out, new_res = TritonRMSNorm.forward(x, weight, 1e-6, res)
    ref, ref_res = TorchRMSNorm.forward(x, weight, 1e-6, res)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if with_residual:
        torch.testing.assert_close(new_res, ref_res)
    else:
        assert new_res is None
    # Rows of a strided view (the per-head QK norm of Qwen3 normalises views of q and k).
    heads = x.view(5, -1, 8)[:, :2].reshape(-1, 8) if hidden % 8 == 0 else None
    if heads is not None:
        torch.testing.assert_close(TritonRMSNorm.forward(heads, weight[:8], 1e-6)[0],
                                   TorchRMSNorm.forward(heads, weight[:8], 1e-6)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="bit-exact bf16 needs a GPU: the interpreter's bf16 conversions do not round as the hardware's")
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_triton_rms_norm_rounds_as_torch_in_bf16(seed, weight_dtype):
    """bf16 rows, bit for bit with the reference: a bf16 weight scales the rounded normalised
    values, a float32 weight (Gemma's 1 + w) scales them in float32 and rounds once (also in the
    norm + add + norm kernel); the all-reduce + norm kernel's last step (the same helper) is
    checked on two GPUs."""
    from baryon.kernels.norm import TorchRMSNorm, TritonRMSNorm

    gen = torch.Generator().manual_seed(seed)
    x, residual = ((torch.randn(6, 320, generator=gen) * 4).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    weight = (torch.randn(320, generator=gen) + 1).to(weight_dtype).to(DEVICE)
    for res in (None, residual):
        out, _ = TritonRMSNorm.forward(x, weight, 1e-6, res)
        ref, _ = TorchRMSNorm.forward(x, weight, 1e-6, res)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    second = (torch.randn(320, generator=gen) + 1).to(weight_dtype).to(DEVICE)
    fused = TritonRMSNorm.norm_add_norm(x, weight, residual, second, 1e-6)
    for got, want in zip(fused, TorchRMSNorm.norm_add_norm(x, weight, residual, second, 1e-6)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("hidden", [64, 1000])
def test_triton_norm_add_norm_matches_torch(seed, hidden):
    """Gemma's sandwich norms in one kernel: rms_norm(x) * w1 + residual, then its norm * w2, and
    the sum as the new residual; float32 weights (Gemma's 1 + w) and rows of a strided view."""
    from baryon.kernels.norm import CpuRMSNorm, TorchRMSNorm, TritonRMSNorm

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 2 * hidden, generator=gen).to(DEVICE)[:, :hidden]  # strided rows
    residual = torch.randn(5, hidden, generator=gen).to(DEVICE)
    first, second = (torch.randn(hidden, generator=gen).to(DEVICE) + 1 for _ in range(2))
    out, new_residual = TritonRMSNorm.norm_add_norm(x, first, residual, second, 1e-6)
    ref, ref_residual = TorchRMSNorm.norm_add_norm(x, first, residual, second, 1e-6)
    torch.testing.assert_close(new_residual, ref_residual, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if DEVICE == "cpu" and CpuRMSNorm.unsupported_reason(torch.device("cpu")) is None:
        cpu_out, cpu_residual = CpuRMSNorm.norm_add_norm(x.contiguous(), first, residual, second, 1e-6)
        torch.testing.assert_close(cpu_out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cpu_residual, ref_residual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [24, 1500])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_triton_gated_activations_match_torch(seed, d, act):
    from baryon.kernels import activation

    triton_kernel, torch_kernel = {"silu": (activation.TritonSiluAndMul, activation.TorchSiluAndMul),
                                   "gelu_tanh": (activation.TritonGeluTanhAndMul, activation.TorchGeluTanhAndMul)}[act]
    # a wide range: GELU's tanh saturates both ways, and its cubic term matters past |x| ~ 1
    x = (torch.randn(3, 2 * d, generator=torch.Generator().manual_seed(seed)) * 3).to(DEVICE)
    torch.testing.assert_close(triton_kernel.forward(x), torch_kernel.forward(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim,qk_norm", [
    (4, 2, 64, 64, True), (8, 1, 64, 32, False), (3, 3, 128, 128, True), (2, 2, 128, 64, True)])
@pytest.mark.parametrize("dtype,norm_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
def test_triton_qkv_prologue_matches_torch(seed, heads, kv_heads, head_dim, rotary_dim, qk_norm, dtype, norm_dtype):
    """QK norm + rotary + KV write fused: same queries and the same cache as the reference,
    padding slots (-1) untouched, partial rotary leaves the tail features alone; norm weights of
    the model dtype or float32 (Gemma 3's 1 + w, scaled in float32)."""
    from baryon.kernels.qkv_prologue import TorchQKVPrologue, TritonQKVPrologue

    gen = torch.Generator().manual_seed(seed)
    tokens, num_blocks, block_size = 9, 4, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, 60, (tokens,), generator=gen).to(DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)
    weights = [torch.randn(head_dim, generator=gen).to(norm_dtype).to(DEVICE) if qk_norm else None for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:2]] = -1  # padding rows
    slots = slots.to(DEVICE)
    caches, queries = [], []
    for kernel in (TorchQKVPrologue, TritonQKVPrologue):
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
        q = kernel.forward(qkv.clone(), positions, cos_sin, weights[0], weights[1], 1e-6, cache, slots,
                           heads, kv_heads, head_dim)
        caches.append(cache)
        queries.append(q.clone())
    # bf16: a one-ulp rounding difference of the normalised value (|x| up to ~8) may carry through rotary.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=2e-2)
    torch.testing.assert_close(queries[1], queries[0], **tol)
    torch.testing.assert_close(caches[1], caches[0], **tol)
    written = caches[0].flatten(1, 2).abs().sum((0, 2, 3)) > 0  # [num_blocks * block_size]
    assert int(written.sum()) == int((slots >= 0).sum())
    if rotary_dim < head_dim and not qk_norm:  # the features past the rotary part are unchanged
        tail = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)[..., rotary_dim:]
        torch.testing.assert_close(queries[1].view(tokens, heads, head_dim)[..., rotary_dim:], tail)


def test_engine_greedy_parity_with_every_triton_kernel(tmp_path, seed, monkeypatch):
    """The whole engine with the Triton kernels selected (interpreted on CPU) still matches
    transformers token for token, through chunked prefill and paged decode."""
    from baryon import LLM
    from conftest import make_checkpoint

    for family in ("attention", "rms_norm", "qkv_prologue", "silu_and_mul"):
        monkeypatch.setenv(f"BARYON_KERNEL_{family.upper()}", "triton")
    path = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=seed, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, num_hidden_layers=2)
    llm = LLM(str(path), skip_tokenizer_init=True, device=DEVICE, dtype="float32", block_size=16,
              max_num_batched_tokens=12, kv_cache_memory_gib=0.01, enforce_eager=True)
    runner = llm.engine.core.runner
    assert {type(a.backend).__name__ for a in runner.attention_layers} == {"TritonPagedAttention"}
    layer = runner.model.model.layers[0]
    assert layer.input_layernorm.kernel.name == layer.self_attn.attn.prologue.name == "triton"
    assert layer.mlp.act_fn.kernel.name == "triton"
    _assert_follows_transformers(llm, path, seed)


@pytest.mark.parametrize("arch,overrides", [("gemma3", {}),
                                            ("gemma2", dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0))])
def test_gemma_engine_greedy_parity_with_the_triton_kernels(tmp_path, seed, monkeypatch, arch, overrides):
    """Gemma 3 and 2 with the Triton kernels selected (GELU-tanh gating, the (1 + weight) norms as
    held, Gemma 3's QK norm in the prologue, local windows, Gemma 2's soft-capped scores):
    transformers' tokens."""
    from baryon import LLM
    from conftest import make_checkpoint

    for family in ("attention", "rms_norm", "qkv_prologue", "gelu_tanh_and_mul"):
        monkeypatch.setenv(f"BARYON_KERNEL_{family.upper()}", "triton")
    path = make_checkpoint(tmp_path / arch, arch, seed=seed, head_dim=64, query_pre_attn_scalar=48,
                           sliding_window=6, layer_types=["sliding_attention", "full_attention"], **overrides)
    llm = LLM(str(path), skip_tokenizer_init=True, device=DEVICE, dtype="float32", block_size=16,
              max_num_batched_tokens=12, kv_cache_memory_gib=0.01, enforce_eager=True)
    layer = llm.engine.core.runner.model.model.layers[0]
    assert layer.mlp.act_fn.kernel.name == layer.post_feedforward_layernorm.kernel.name == "triton"
    _assert_follows_transformers(llm, path, seed)


@pytest.mark.parametrize("with_sinks,softcap", [(True, None), (False, 2.0), (True, 2.0)])
def test_triton_paged_attention_with_sinks_or_softcap(seed, with_sinks, softcap):
    """A mixed step (decode, prefill, chunk over a prefix) with attention sinks (GPT-OSS) and / or
    soft-capped scores (Gemma 2; cap 2 bends most of these scores)."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, block_size, window = 8, 2, 64, 16, 5
    seqs = [(6, 1), (0, 12), (20, 3)]
    cache, md, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, block_size)
    cache, q, k, v = (t.to(DEVICE) for t in (cache, q, k, v))
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(DEVICE))
    sinks = (torch.randn(heads, generator=gen) * 2).to(DEVICE) if with_sinks else None
    scale = 1 / math.sqrt(head_dim)
    q = q * 3  # scores well past the cap
    out = triton_paged.TritonPagedAttention(heads, head_dim, kv_heads, scale, window, sinks,
                                            logit_softcap=softcap).forward(q, k, v, cache, md)
    start = 0
    for (cached, new), fk, fv in zip(seqs, full_k, full_v):
        expected = dense_attention(q[start:start + new].cpu(), fk, fv, scale, window,
                                   None if sinks is None else sinks.cpu(), softcap)
        torch.testing.assert_close(out[start:start + new].cpu(), expected, atol=2e-3, rtol=2e-3)
        start += new


def _assert_split_decode_matches_dense(gen, seqs, block_size, splits, window, with_sinks, tiles=None,
                                       softcap=None) -> None:
    """Decodes (seqs: (cached, 1) each) through the Triton kernel with `splits` KV splits (and
    these DecodeTiles, and this score soft-cap) equal dense attention over each sequence's keys."""
    heads, kv_heads, head_dim = 4, 2, 64
    cache, md, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, block_size)
    cache, q, k, v = (t.to(DEVICE) for t in (cache, q, k, v))
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(DEVICE))
    sinks = (torch.randn(heads, generator=gen) * 2).to(DEVICE) if with_sinks else None
    scale = 1 / math.sqrt(head_dim)
    attn = triton_paged.TritonPagedAttention(heads, head_dim, kv_heads, scale, window, sinks, logit_softcap=softcap)
    attn.num_kv_splits = splits
    if tiles is not None:
        attn.decode_tiles = tiles
    out = attn.forward(q, k, v, cache, md)
    for i, (fk, fv) in enumerate(zip(full_k, full_v)):
        expected = dense_attention(q[i:i + 1].cpu(), fk, fv, scale, window, None if sinks is None else sinks.cpu(),
                                   softcap)
        torch.testing.assert_close(out[i:i + 1].cpu(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize("with_sinks,softcap", [(False, None), (True, None), (False, 1.0)])
def test_triton_split_kv_decode_matches_dense(seed, splits, with_sinks, softcap):
    """Flash decoding: each sequence's keys split over several programs, then merged (soft-capped
    scores too: the cap applies before each split's softmax)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [(int(torch.randint(0, 150, (1,), generator=gen)), 1) for _ in range(3)] + [(0, 1), (63, 1)]
    _assert_split_decode_matches_dense(gen, seqs, 16, splits, None, with_sinks, softcap=softcap)


@pytest.mark.parametrize("tile_n,min_chunk", [(16, 16), (16, 48), (32, 128)])
@pytest.mark.parametrize("with_sinks,window", [(False, None), (True, None), (True, 37)])
def test_triton_decode_tiles_leave_short_sequences_fewer_splits(seed, tile_n, min_chunk, with_sinks, window):
    """Decode launch shapes: 8 splits of at least min_chunk keys each, so short sequences leave
    most splits empty (they write no accumulator and the merge skips them) and long ones fill them
    all; with sinks seeding split 0 and a sliding window moving the first key."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(0, 300, (1,), generator=gen)) for _ in range(3)] + [0, 5, 17, 299]
    _assert_split_decode_matches_dense(gen, [(n, 1) for n in lengths], 8, 8, window, with_sinks,
                                       triton_paged.DecodeTiles(tile_n=tile_n, min_chunk=min_chunk))


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_deepseek_engine_greedy_parity_with_the_triton_mla_kernels(tmp_path, seed, monkeypatch, arch):
    """DeepSeek-V3 and V3.2 with the Triton MLA prologue, latent attention and (V3.2) indexer and
    sparse attention, interpreted on CPU: tokens and logprobs of transformers through chunked
    prefill over a cached prefix and paged decode."""
    from baryon import LLM
    from conftest import make_checkpoint

    for family in ("mla_attention", "mla_prologue", "mla_indexer", "rms_norm"):
        monkeypatch.setenv(f"BARYON_KERNEL_{family.upper()}", "triton")
    path = make_checkpoint(tmp_path / arch, arch, seed=seed)
    llm = LLM(str(path), skip_tokenizer_init=True, device=DEVICE, dtype="float32", block_size=16,
              max_num_batched_tokens=12, kv_cache_memory_gib=0.01, enforce_eager=True)
    attn = llm.engine.core.runner.model.model.layers[0].self_attn.attn
    assert (type(attn.backend).__name__, attn.prologue.name) == ("TritonMLAAttention", "triton")
    _assert_follows_transformers(llm, path, seed)


def _assert_follows_transformers(llm, path, seed) -> None:
    """Two random prompts, 8 greedy tokens: transformers' tokens, logprobs within 1e-4."""
    from baryon import SamplingParams
    from conftest import hf_greedy, random_prompts

    prompts = random_prompts(2, 128, 5, 20, seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(path, prompt, 8)
        assert out.outputs[0].token_ids == tokens
        got = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-4
