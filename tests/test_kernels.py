"""Kernels against independent references: paged attention vs dense attention, RoPE, RMSNorm,
SiLU-and-mul, and the kernel selector's rules."""

from __future__ import annotations

import math

import pytest
import torch

from baryon.kernels import selector
from baryon.kernels.activation import TorchGeluTanhAndMul, TorchSiluAndMul
from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.attention.torch_paged import TorchPagedAttention
from baryon.kernels.norm import TorchRMSNorm
from baryon.kernels.rotary import apply_rotary


def dense_attention(q, k, v, scale, window, sinks=None, softcap=None):
    """q: [q_len, H, D] for the last q_len positions of k/v [seq_len, H_kv, D]; float64 softmax.
    sinks: [H] extra logits that join each head's softmax without a value; softcap: scores
    s -> softcap * tanh(s / softcap) before the mask (Gemma 2)."""
    q_len, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1).double()
    v = v.repeat_interleave(heads // kv_heads, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(-1, 1, 1).expand(heads, q_len, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _case(gen, seqs, heads, kv_heads, head_dim, block_size):
    """Random paged layout for sequences given as (cached_len, new_len)."""
    max_blocks = max(-(-(c + n) // block_size) for c, n in seqs)
    num_blocks = len(seqs) * max_blocks + 3
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered over the cache
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    full_k, full_v, queries, new_k, new_v, slots = [], [], [], [], [], []
    for i, (cached, new) in enumerate(seqs):
        length = cached + new
        blocks = [perm.pop() for _ in range(-(-length // block_size))]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(length, kv_heads, head_dim, generator=gen)
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        for pos in range(cached):  # the prefix is already in the cache
            cache[0, blocks[pos // block_size], pos % block_size] = k[pos]
            cache[1, blocks[pos // block_size], pos % block_size] = v[pos]
        full_k.append(k), full_v.append(v)
        queries.append(torch.randn(new, heads, head_dim, generator=gen))
        new_k.append(k[cached:]), new_v.append(v[cached:])
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, length)]
    q_lens = [n for _, n in seqs]
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    metadata = AttentionMetadata(
        num_tokens=sum(q_lens), query_start_loc=starts, seq_lens=seq_lens, block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    return cache, metadata, torch.cat(queries), torch.cat(new_k), torch.cat(new_v), full_k, full_v


SHAPES = [  # (heads, kv_heads, head_dim, block_size, window)
    (4, 4, 16, 4, None), (8, 2, 32, 8, None), (6, 1, 8, 16, None), (4, 2, 64, 4, 5), (8, 4, 16, 2, 1),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", SHAPES)
@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])  # cpu: the C++ kernel (kernels/cpu/paged_attention.cpp)
def test_paged_attention_matches_dense(seed, heads, kv_heads, head_dim, block_size, window, kind, backend):
    from baryon.kernels.attention.cpu_paged import CpuPagedAttention

    reason = CpuPagedAttention.unsupported_reason(torch.device("cpu")) if backend == "cpu" else None
    if reason is not None:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(seed)
    if kind == "decode":
        seqs = [(int(torch.randint(0, 30, (1,), generator=gen)), 1) for _ in range(5)]
    else:  # prefills with and without a cached prefix, decodes, a length-1 prompt
        seqs = [(0, 9), (7, 1), (12, 5), (0, 1), (3, 1), (20, 13)]
    cache, metadata, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, block_size)
    scale = 1 / math.sqrt(head_dim)
    attn = (TorchPagedAttention if backend == "torch" else CpuPagedAttention)(heads, head_dim, kv_heads, scale, window)
    out = attn.forward(q, k, v, cache, metadata)
    start = 0
    for (cached, new), fk, fv in zip(seqs, full_k, full_v):
        expected = dense_attention(q[start:start + new], fk, fv, scale, window)
        torch.testing.assert_close(out[start:start + new], expected, atol=1e-5, rtol=1e-5)
        start += new


@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_paged_attention_with_softcap_matches_dense(seed, kind, backend):
    """Gemma 2's soft-capped scores (cap 2: most random scores bend), with a window and GQA."""
    from baryon.kernels.attention.cpu_paged import CpuPagedAttention

    reason = CpuPagedAttention.unsupported_reason(torch.device("cpu")) if backend == "cpu" else None
    if reason is not None:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, block_size, window, cap = 8, 2, 16, 4, 7, 2.0
    seqs = [(5, 1), (0, 9), (13, 4)] if kind == "mixed" else [(5, 1), (17, 1), (0, 1)]
    cache, metadata, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, block_size)
    q = q * 3  # scores well past the cap
    scale = 1 / math.sqrt(head_dim)
    cls = TorchPagedAttention if backend == "torch" else CpuPagedAttention
    out = cls(heads, head_dim, kv_heads, scale, window, logit_softcap=cap).forward(q, k, v, cache, metadata)
    start = 0
    for (cached, new), fk, fv in zip(seqs, full_k, full_v):
        expected = dense_attention(q[start:start + new], fk, fv, scale, window, softcap=cap)
        torch.testing.assert_close(out[start:start + new], expected, atol=1e-5, rtol=1e-5)
        start += new
    uncapped = cls(heads, head_dim, kv_heads, scale, window).forward(q, None, None, cache, metadata)
    assert not torch.allclose(out, uncapped, atol=1e-2)  # the cap changes the result


def test_store_skips_padding_slots(seed):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, 4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    from baryon.kernels.attention.torch_paged import store_kv

    store_kv(key, value, cache, torch.tensor([5, -1, 14]))
    flat = cache.view(2, -1, 2, 8)
    torch.testing.assert_close(flat[0, 5], key[0])
    torch.testing.assert_close(flat[1, 14], value[2])
    assert int((flat.abs().sum((-1, -2)) > 0).sum()) == 4  # only two slots written, K and V


@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rotary_matches_transformers(seed, rotary_fraction):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(seed)
    head_dim, heads, kv_heads, tokens = 32, 4, 2, 11
    rotary_dim = int(head_dim * rotary_fraction)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    freqs = torch.outer(torch.arange(128).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    q = torch.randn(tokens, heads * head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads * head_dim, generator=gen)
    q_out, k_out = apply_rotary(positions, q, k, cache, head_dim)
    emb = torch.cat((freqs[positions], freqs[positions]), dim=-1)  # HF layout: [tokens, rotary_dim]
    q_heads, k_heads = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    q_ref, k_ref = apply_rotary_pos_emb(q_heads[..., :rotary_dim].transpose(0, 1).unsqueeze(0),
                                        k_heads[..., :rotary_dim].transpose(0, 1).unsqueeze(0),
                                        emb.cos().unsqueeze(0), emb.sin().unsqueeze(0))
    q_ref = torch.cat((q_ref[0].transpose(0, 1), q_heads[..., rotary_dim:]), -1).flatten(1)
    k_ref = torch.cat((k_ref[0].transpose(0, 1), k_heads[..., rotary_dim:]), -1).flatten(1)
    torch.testing.assert_close(q_out, q_ref)
    torch.testing.assert_close(k_out, k_ref)


def test_rms_norm_with_residual_matches_transformers(seed):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(7, 48, generator=gen), torch.randn(7, 48, generator=gen)
    weight = torch.randn(48, generator=gen)
    ref = LlamaRMSNorm(48, eps=1e-6)
    ref.weight.data.copy_(weight)
    out, new_residual = TorchRMSNorm.forward(x, weight, 1e-6, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, ref(x + residual))
    plain, none = TorchRMSNorm.forward(x, weight, 1e-6)
    assert none is None
    torch.testing.assert_close(plain, ref(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_rounds_as_transformers_for_the_weight_dtype(seed, dtype):
    """Bit for bit in every dtype: a weight of the model dtype as LlamaRMSNorm (the normalised
    values rounded, then scaled), a float32 weight holding Gemma's 1 + w as Gemma3RMSNorm (scaled
    in float32, rounded once). In 16 bits the two orders differ on some elements."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(16, 256, generator=gen) * 4).to(dtype)
    w = torch.randn(256, generator=gen).to(dtype)
    llama, gemma = LlamaRMSNorm(256, eps=1e-6).to(dtype), Gemma3RMSNorm(256, eps=1e-6).to(dtype)
    llama.weight.data.copy_(w)
    gemma.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(TorchRMSNorm.forward(x, w, 1e-6)[0], llama(x))
        as_gemma = TorchRMSNorm.forward(x, w.float() + 1, 1e-6)[0]
        assert as_gemma.dtype == dtype and torch.equal(as_gemma, gemma(x))
        if dtype != torch.float32:  # the float32 product is a different rounding than the model-dtype one
            assert not torch.equal(as_gemma, TorchRMSNorm.forward(x, (w.float() + 1).to(dtype), 1e-6)[0])


def test_silu_and_mul(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 2 * 24, generator=gen)
    gate, up = x[:, :24], x[:, 24:]
    torch.testing.assert_close(TorchSiluAndMul.forward(x), gate * torch.sigmoid(gate) * up)


def test_gelu_tanh_and_mul(seed):
    """Gemma's `gelu_pytorch_tanh` gating: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) * up."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 2 * 24, generator=gen, dtype=torch.float64) * 3
    gate, up = x[:, :24], x[:, 24:]
    expected = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) * up
    torch.testing.assert_close(TorchGeluTanhAndMul.forward(x), expected)


def test_selector_falls_back_and_can_be_forced(monkeypatch):
    cpu = torch.device("cpu")
    for family in selector.families():  # every family runs on CPU: C++ where built (or zentorch's, where
        # the `.[zen]` extra is installed and its op timed faster), else the reference
        assert selector.select(family, cpu, in_features=64, bits=4, dtype=torch.float32).name in (
            "cpu", "cpu_int8", "cpu_float32", "torch", "modules", "zentorch")
    monkeypatch.setenv("BARYON_KERNEL_ATTENTION", "torch")
    assert selector.select("attention", cpu) is TorchPagedAttention
    monkeypatch.setenv("BARYON_KERNEL_ATTENTION", "nonexistent")
    with pytest.raises(ValueError, match="names no attention kernel"):
        selector.select("attention", cpu)
    with pytest.raises(ValueError, match="unknown kernel family"):
        selector.select("nope", cpu)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 16, 17, 100, 256, 300])
def test_every_decode_batch_size_maps_to_a_captured_graph(max_num_seqs):
    from baryon.runner.cuda_graph import CUDAGraphRunner, default_capture_sizes

    sizes = default_capture_sizes(max_num_seqs)
    assert sizes[-1] == max_num_seqs and sizes == sorted(set(sizes))
    assert all(s in sizes for s in (1, 2, 4, 8, 16, 32, 48) if s < max_num_seqs)
    runner = CUDAGraphRunner(torch.nn.Identity(), lambda hidden, out: None, logits_width=32,
                             logits_dtype=torch.float32, capture_sizes=sizes, max_blocks_per_seq=4,
                             device=torch.device("cpu"))
    for n in range(1, max_num_seqs + 1):  # every batch the scheduler can form (<= max_num_seqs)
        padded = runner.padded_size(n)
        assert padded in sizes and 0 <= padded - n < 16  # a graph exists, padding under one step
    assert runner.padded_size(max_num_seqs + 1) is None  # larger batches run eagerly


def test_capture_times_name_the_total_and_the_slowest_size():
    from baryon.runner.cuda_graph import capture_times

    assert capture_times({256: 0.5, 8: 2.0, 1: 0.25}) == "2.8 s (slowest: size 8, 2.0 s)"


@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_paged_attention_with_sinks_matches_dense(seed, kind):
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, block_size, window = 8, 2, 16, 4, 6
    seqs = [(5, 1), (0, 7), (11, 1)] if kind == "mixed" else [(5, 1), (9, 1)]
    cache, metadata, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, block_size)
    sinks = torch.randn(heads, generator=gen) * 2
    scale = 1 / math.sqrt(head_dim)
    out = TorchPagedAttention(heads, head_dim, kv_heads, scale, window, sinks).forward(q, k, v, cache, metadata)
    start = 0
    for (cached, new), fk, fv in zip(seqs, full_k, full_v):
        expected = dense_attention(q[start:start + new], fk, fv, scale, window, sinks)
        torch.testing.assert_close(out[start:start + new], expected, atol=1e-5, rtol=1e-5)
        start += new
    no_sinks = TorchPagedAttention(heads, head_dim, kv_heads, scale, window).forward(q, k, v, cache, metadata)
    assert not torch.allclose(out, no_sinks, atol=1e-3)  # the sinks do take probability mass


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 4, 16, 4), (8, 2, 32, 8), (6, 1, 8, 16)])
def test_sdpa_prefill_matches_dense(seed, heads, kv_heads, head_dim, block_size):
    """Whole prompts and chunks over a cached prefix through the SDPA path, their keys and values
    read back from the paged cache (blocks scattered, a last block partly filled); a chunk is two
    attention calls merged by their log-sum-exps (float32 math on CPU, cuDNN on GPUs)."""
    from baryon.kernels.attention import sdpa_prefill
    from baryon.kernels.attention.torch_paged import store_kv

    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (5, 2), generator=gen).tolist()
    seqs = [(0, lens[0][1]), (1, lens[1][1])] + [(c, n) for c, n in lens[2:]]
    cache, metadata, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, block_size)
    store_kv(k, v, cache, metadata.slot_mapping)
    scale = 1 / math.sqrt(head_dim)
    out = sdpa_prefill.prefill(q, cache, metadata, scale, torch.full_like(q, float("nan")))
    start = 0
    for (_, new), fk, fv in zip(seqs, full_k, full_v):
        torch.testing.assert_close(out[start:start + new], dense_attention(q[start:start + new], fk, fv, scale, None),
                                   atol=1e-5, rtol=1e-5)
        start += new
    # Only the sequences asked for are written.
    some = sdpa_prefill.prefill(q, cache, metadata, scale, torch.full_like(q, float("nan")), (1, 3))
    starts = metadata.query_start_loc_cpu.tolist()
    for seq in range(len(seqs)):
        rows = some[starts[seq]:starts[seq + 1]]
        if seq in (1, 3):
            torch.testing.assert_close(rows, out[starts[seq]:starts[seq + 1]])
        else:
            assert rows.isnan().all()


def test_attention_with_lse_and_the_chunk_merge(seed):
    """attention_with_lse returns softmax attention and each row's log-sum-exp (GQA, no mask and
    causal); a chunk after a prefix, merged from its two calls, is causal attention over both."""
    from baryon.kernels.attention import sdpa_prefill

    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, q_len, prefix, dim = 4, 2, int(torch.randint(1, 12, (1,), generator=gen)), 9, 16
    q = torch.randn(heads, q_len, dim, generator=gen)
    k, v = torch.randn(2, kv_heads, prefix + q_len, dim, generator=gen).unbind(0)
    for causal, keys, values in ((False, k, v), (True, k[:, prefix:], v[:, prefix:])):
        out, lse = sdpa_prefill.attention_with_lse(q, keys, values, causal, 0.25)
        scores = torch.einsum("hld,hsd->hls", q.double(), keys.repeat_interleave(2, 0).double()) * 0.25
        if causal:
            scores = scores.masked_fill(torch.ones(q_len, q_len, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.einsum("hls,hsd->hld", scores.softmax(-1), values.repeat_interleave(2, 0).double())
        torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float(), atol=1e-5, rtol=1e-5)
    chunk = sdpa_prefill.attend_after_prefix(q, k, v, prefix, 0.25)
    expected = dense_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.25, None)
    torch.testing.assert_close(chunk.transpose(0, 1), expected, atol=1e-5, rtol=1e-5)


def test_sdpa_prefill_takes_the_long_queries_of_a_step(monkeypatch):
    from baryon.kernels.attention import sdpa_prefill

    monkeypatch.setattr(sdpa_prefill, "MIN_QUERY_TOKENS", 8)
    monkeypatch.setattr(sdpa_prefill, "MIN_QUERY_KEY_PAIRS", 80)  # a whole prompt of 9, a chunk of 8 after 2
    gen = torch.Generator().manual_seed(0)
    for seqs, expected in [([(0, 9), (0, 3)], (0,)), ([(0, 9), (4, 1)], (0,)), ([(0, 5), (0, 7)], ()),
                           ([(2, 12)], (0,)), ([(3, 1), (20, 8), (0, 30)], (1, 2)), ([(0, 8), (2, 8)], (1,)),
                           ([(90, 7)], ())]:
        metadata = _case(gen, seqs, 2, 2, 8, 4)[1]
        assert sdpa_prefill.long_queries(metadata) == expected, seqs


def test_query_tiles_leave_out_the_sequences_served_elsewhere():
    from baryon.kernels.attention.triton_paged import query_tiles

    metadata = _case(torch.Generator().manual_seed(0), [(0, 9), (3, 1), (0, 17), (5, 4)], 2, 2, 8, 4)[1]
    tile_seq, tile_q = query_tiles(metadata, 4)
    assert tile_seq.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 3] and tile_q.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0]
    tile_seq, tile_q = query_tiles(metadata, 4, skip=(0, 2))
    assert tile_seq.tolist() == [1, 3] and tile_q.tolist() == [0, 0]
    assert query_tiles(metadata, 4, skip=(0, 1, 2, 3))[0].numel() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_backend_hands_long_queries_to_sdpa(seed, dtype):
    """On CUDA the paged Triton backend serves a step's large attentions (a whole prompt of >= 4096
    tokens, a 4100-token chunk over a cached prefix, a 2032-token chunk over a 7k prefix) through
    cuDNN and the rest (a short prompt, a decode, a short chunk, a 600-token chunk over a 17k
    prefix: under 4096 x 4096 query-key pairs) with its own kernel; the result matches dense
    attention, and the paged kernel's on the whole step."""
    from baryon.kernels.attention import sdpa_prefill
    from baryon.kernels.attention.triton_paged import TritonPagedAttention

    gen = torch.Generator().manual_seed(seed)
    extra = int(torch.randint(0, 300, (1,), generator=gen))
    seqs = [(0, 700), (0, 4096 + extra), (50, 1), (3000 + extra, 4100), (33, 200), (7000 + extra, 2032), (17000, 600)]
    heads, kv_heads, head_dim = 4, 2, 128
    cache, metadata, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, 16)
    moved = [x.cuda().to(dtype) for x in (cache, q, k, v)]
    md = AttentionMetadata(metadata.num_tokens, metadata.query_start_loc.cuda(), metadata.seq_lens.cuda(),
                           metadata.block_tables.cuda(), metadata.slot_mapping.cuda(), metadata.max_query_len,
                           metadata.max_seq_len, metadata.query_start_loc_cpu, metadata.seq_lens_cpu)
    attn = TritonPagedAttention(heads, head_dim, kv_heads, head_dim ** -0.5, None)
    assert sdpa_prefill.takes(moved[1], moved[0], None, None, None) and sdpa_prefill.long_queries(md) == (1, 3, 5)
    out = attn.forward(moved[1], moved[2], moved[3], moved[0], md, output=torch.full_like(moved[1], float("nan")))
    md.backend_scratch["sdpa_long_queries"] = ()  # the paged kernel on the same step
    paged = attn.forward(moved[1], None, None, moved[0], md)
    torch.testing.assert_close(out, paged, atol=2e-2, rtol=2e-2)
    start = 0
    for (_, new), fk, fv in zip(seqs, full_k, full_v):
        expected = dense_attention(q[start:start + new], fk, fv, head_dim ** -0.5, None)
        torch.testing.assert_close(out[start:start + new].float().cpu(), expected, atol=3e-2, rtol=3e-2)
        start += new
