"""Gated DeltaNet's kernels (kernels/linear_attention.py): the torch references against
transformers' Qwen3-Next functions, and the Triton kernels against the references on a varlen
batch with states carried over, fresh sequences, a stateless row and padding (on CUDA when
present, else in Triton's interpreter, set by conftest)."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.linear_attention import TorchCausalConv1d, TorchGatedDeltaRule, TorchGatedRMSNorm

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HK, HV, DK, DV, WIDTH = 2, 4, 16, 8, 4
KEY_DIM = HK * DK
CHANNELS = 2 * KEY_DIM + HV * DV


def _layer_inputs(gen, tokens):
    qkv = torch.randn(tokens, CHANNELS + 5, generator=gen)[:, :CHANNELS]  # rows strided, as a slice of a projection
    a, b = torch.randn(tokens, HV, generator=gen), torch.randn(tokens, HV, generator=gen)
    a_log = torch.rand(HV, generator=gen) * 2 - 1
    dt_bias = torch.randn(HV, generator=gen)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen) * 0.5
    return qkv, a, b, a_log, dt_bias, weight


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


def _hf_layer(qkv, a, b, a_log, dt_bias, weight, conv_state=None, recurrent_state=None):
    """transformers' computation for one sequence: convolution (with the K - 1 inputs before it),
    then the recurrent gated delta rule from recurrent_state. Returns (out [n, Hv, Dv], state)."""
    x = qkv.t()[None]  # [1, C, n]
    if conv_state is not None:
        x = torch.cat((conv_state.t()[None], x), dim=-1)
    conv = hf.causal_conv1d_fn(x, weight, None, activation="silu")[:, :, -qkv.shape[0]:][0].t()  # [n, C]
    # each key head serves HV / HK consecutive value heads (repeated here: transformers < 5.2x
    # expects as many key heads as value heads)
    q = conv[:, :KEY_DIM].reshape(1, -1, HK, DK).repeat_interleave(HV // HK, dim=2)
    k = conv[:, KEY_DIM:2 * KEY_DIM].reshape(1, -1, HK, DK).repeat_interleave(HV // HK, dim=2)
    v = conv[:, 2 * KEY_DIM:].reshape(1, -1, HV, DV)
    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    out, state = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g[None], beta=b.sigmoid()[None],
                                                     initial_state=recurrent_state, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    return out[0], state


def _reference_layer(qkv, a, b, a_log, dt_bias, weight, conv_states, states, query_start, seq_lens, slots):
    layout = (_int32(query_start), _int32(seq_lens), _int32(slots))
    max_query_len = max(query_start[i + 1] - query_start[i] for i in range(len(seq_lens)))
    conv = TorchCausalConv1d.forward(qkv, weight, None, conv_states, *layout, max_query_len)
    return conv, TorchGatedDeltaRule.forward(conv, a, b, a_log, dt_bias, states, *layout, HK, DK, max_query_len)


def test_references_match_transformers_across_chunks(seed):
    """One sequence run in chunks of 5, 1 and 7 tokens (its states carried in slot 1) equals
    transformers' convolution and recurrent rule over all 13 at once; the chunked rule agrees."""
    gen = torch.Generator().manual_seed(seed)
    qkv, a, b, a_log, dt_bias, weight = _layer_inputs(gen, 13)
    expected, expected_state = _hf_layer(qkv, a, b, a_log, dt_bias, weight)
    conv_states = torch.randn(3, WIDTH - 1, CHANNELS, generator=gen)  # slot 1's garbage is not read at first
    states = torch.randn(3, HV, DK, DV, generator=gen)
    outs, done = [], 0
    for n in (5, 1, 7):
        rows = slice(done, done + n)
        _, out = _reference_layer(qkv[rows], a[rows], b[rows], a_log, dt_bias, weight, conv_states, states,
                                  [0, n], [done + n], [1])
        outs.append(out)
        done += n
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[1], expected_state[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_states[1], qkv[-(WIDTH - 1):])
    x = qkv.t()[None]
    conv = hf.causal_conv1d_fn(x, weight, None, activation="silu")[0].t()
    q = conv[:, :KEY_DIM].reshape(1, -1, HK, DK).repeat_interleave(HV // HK, dim=2)
    k = conv[:, KEY_DIM:2 * KEY_DIM].reshape(1, -1, HK, DK).repeat_interleave(HV // HK, dim=2)
    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    chunked, _ = hf.torch_chunk_gated_delta_rule(q, k, conv[:, 2 * KEY_DIM:].reshape(1, -1, HV, DV), g=g[None],
                                                 beta=b.sigmoid()[None], chunk_size=4, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(chunked[0], expected, atol=1e-4, rtol=1e-4)


def test_reference_batch_keeps_sequences_apart(seed):
    """A batch of a continued sequence, a fresh one, a stateless one and padding gives each
    sequence what it gets alone; the stateless and padding rows store nothing."""
    gen = torch.Generator().manual_seed(seed)
    qkv, a, b, a_log, dt_bias, weight = _layer_inputs(gen, 12)
    conv_states = torch.randn(4, WIDTH - 1, CHANNELS, generator=gen)
    states = torch.randn(4, HV, DK, DV, generator=gen) * 0.1
    before_conv, before = conv_states.clone(), states.clone()
    # seq 0: 1 new token after 6 (slot 2); seq 1: 5 fresh tokens (slot 0); seq 2: 6 tokens, no slot; seq 3: padding
    query_start, seq_lens, slots = [0, 1, 6, 12, 12], [7, 5, 6, 0], [2, 0, -1, 3]
    _, out = _reference_layer(qkv, a, b, a_log, dt_bias, weight, conv_states, states, query_start, seq_lens, slots)
    expected0, state0 = _hf_layer(qkv[:1], a[:1], b[:1], a_log, dt_bias, weight, before_conv[2], before[2:3])
    expected1, state1 = _hf_layer(qkv[1:6], a[1:6], b[1:6], a_log, dt_bias, weight)
    expected2, _ = _hf_layer(qkv[6:], a[6:], b[6:], a_log, dt_bias, weight)
    torch.testing.assert_close(out, torch.cat((expected0, expected1, expected2)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[2], state0[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], state1[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[[1, 3]], before[[1, 3]], atol=0, rtol=0)
    torch.testing.assert_close(conv_states[2], torch.cat((before_conv[2, 1:], qkv[:1])))
    torch.testing.assert_close(conv_states[0], qkv[3:6])
    torch.testing.assert_close(conv_states[[1, 3]], before_conv[[1, 3]], atol=0, rtol=0)


@pytest.mark.parametrize("dtype,with_bias", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_triton_kernels_match_references(seed, dtype, with_bias):
    lt = pytest.importorskip("baryon.kernels.linear_attention_triton")
    if lt.triton is None:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(seed)
    # decodes with state, a 2-token continuation, a chunk longer than the convolution's token block,
    # a fresh 1-token prompt, a stateless prefill, padding
    query_start = [0, 1, 2, 4, 24, 25, 28, 29]
    seq_lens, slots = [9, 3, 6, 20, 1, 3, 0], [4, 1, 0, 2, 5, -1, 3]
    tokens = query_start[-1]
    qkv, a, b, a_log, dt_bias, weight = _layer_inputs(gen, tokens)
    qkv, a, b, weight = (t.to(dtype) for t in (qkv, a, b, weight))
    bias = torch.randn(CHANNELS, generator=gen).to(dtype) if with_bias else None
    conv_states = torch.randn(6, WIDTH - 1, CHANNELS, generator=gen).to(dtype)
    states = torch.randn(6, HV, DK, DV, generator=gen) * 0.1
    layout = (_int32(query_start), _int32(seq_lens), _int32(slots))
    ref_conv_states, ref_states = conv_states.clone(), states.clone()
    ref_conv = TorchCausalConv1d.forward(qkv, weight, bias, ref_conv_states, *layout, 20)
    ref_out = TorchGatedDeltaRule.forward(ref_conv, a, b, a_log, dt_bias, ref_states, *layout, HK, DK, 20)
    dev = [t.to(DEVICE) for t in (qkv, a, b, a_log, dt_bias, weight, conv_states, states)]
    qkv_d, a_d, b_d, a_log_d, dt_bias_d, weight_d, conv_states_d, states_d = dev
    layout_d = tuple(t.to(DEVICE) for t in layout)
    conv = lt.TritonCausalConv1d.forward(qkv_d, weight_d, None if bias is None else bias.to(DEVICE),
                                         conv_states_d, *layout_d, 20)
    out = lt.TritonGatedDeltaRule.forward(conv, a_d, b_d, a_log_d, dt_bias_d, states_d, *layout_d, HK, DK, 20)
    real = slice(0, query_start[-2])  # the padding row's output is not defined
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(conv[real].cpu(), ref_conv[real], **tol)
    torch.testing.assert_close(out[real].cpu(), ref_out[real], **tol)
    torch.testing.assert_close(states_d.cpu(), ref_states, **tol)
    torch.testing.assert_close(conv_states_d.cpu(), ref_conv_states, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gated_rms_norm_reference_is_transformers(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(7, HV, DV, generator=gen) * 3).to(dtype)
    gate = torch.randn(7, HV, DV + 3, generator=gen)[..., :DV].to(dtype)  # strided, as a slice of a projection
    norm = hf.Qwen3NextRMSNormGated(DV, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DV, generator=gen) * 0.5 + 1)
        expected = norm(x.reshape(-1, DV), gate.reshape(-1, DV)).reshape(x.shape)
    got = TorchGatedRMSNorm.forward(x, gate, norm.weight.detach(), 1e-6)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [8, 128, 96])
def test_triton_gated_rms_norm_matches_reference(seed, dtype, dim):
    lt = pytest.importorskip("baryon.kernels.linear_attention_triton")
    if lt.triton is None:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(seed)
    tokens, heads = 5, 3
    x = (torch.randn(tokens, heads, dim, generator=gen) * 2).to(dtype)
    gate = torch.randn(tokens, heads * dim + 7, generator=gen)[:, :heads * dim].to(dtype).view(tokens, heads, dim)
    weight = (torch.randn(dim, generator=gen) * 0.5 + 1).to(dtype)
    expected = TorchGatedRMSNorm.forward(x, gate, weight, 1e-6)
    got = lt.TritonGatedRMSNorm.forward(x.to(DEVICE), gate.to(DEVICE), weight.to(DEVICE), 1e-6).cpu()
    # The same roundings; float32's sums and exp may differ in their last bits (one 16-bit ulp on a
    # GPU; Triton's interpreter truncates its bf16 conversions, which two roundings make ~3 ulps).
    bf16_rtol = 8e-3 if DEVICE == "cuda" else 3e-2
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=bf16_rtol, rtol=bf16_rtol)
    torch.testing.assert_close(got, expected, **tol)


def test_reference_chunks_match_the_token_walk(seed, monkeypatch):
    """The torch rule's chunked form (a prefill's whole chunks as matrix products) against the same
    rule walked token by token: a continued prefill of two chunks and a remainder, a fresh exact
    chunk, a decode, in one batch."""
    import baryon.kernels.linear_attention as la

    gen = torch.Generator().manual_seed(seed)
    chunk = la.CHUNK
    lengths = [2 * chunk + 20, chunk, 1]
    query_start = [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    seq_lens, slots = [lengths[0] + 9, chunk, 30], [1, 0, 2]
    qkv, a, b, a_log, dt_bias, _ = _layer_inputs(gen, sum(lengths))
    a = a - 2.0  # slower decay than the default inputs' (so the chunk's early tokens still count)
    states = torch.randn(3, HV, DK, DV, generator=gen) * 0.1
    layout = (_int32(query_start), _int32(seq_lens), _int32(slots))
    chunked_states = states.clone()
    chunked = TorchGatedDeltaRule.forward(qkv, a, b, a_log, dt_bias, chunked_states, *layout, HK, DK, lengths[0])
    monkeypatch.setattr(la, "CHUNK", 10**9)  # every token walked
    walked_states = states.clone()
    walked = TorchGatedDeltaRule.forward(qkv, a, b, a_log, dt_bias, walked_states, *layout, HK, DK, lengths[0])
    torch.testing.assert_close(chunked, walked, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(chunked_states, walked_states, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_chunked_rule_matches_reference(seed, dtype):
    """The Triton rule's chunked form (a step with a long span) against the torch reference, in one
    batch: a continued prefill of two chunks and a remainder, a fresh exact chunk, a decode with
    state, a fresh 1-token prompt, a stateless span, padding."""
    lt = pytest.importorskip("baryon.kernels.linear_attention_triton")
    if lt.triton is None:
        pytest.skip("triton is not installed")
    import baryon.kernels.delta_rule_chunked_triton as chunked

    gen = torch.Generator().manual_seed(seed)
    chunk = chunked.CHUNK
    lengths = [2 * chunk + 23, chunk, 1, 1, 40, 0]
    query_start = [0]
    for n in lengths:
        query_start.append(query_start[-1] + n)
    seq_lens, slots = [lengths[0] + 11, chunk, 17, 1, 40, 0], [3, 0, 1, 4, -1, 2]
    tokens = query_start[-1]
    qkv, a, b, a_log, dt_bias, _ = _layer_inputs(gen, tokens)
    a = a - 2.0  # slow decay, so that a chunk's early tokens and the carried state still count
    # the first span's keys close to one direction: (I + A)'s inverse then needs its high powers
    keys = qkv[:lengths[0], KEY_DIM:2 * KEY_DIM].view(-1, HK, DK)
    keys += 4 * torch.randn(HK, DK, generator=gen)
    qkv, a, b = (t.to(dtype) for t in (qkv, a, b))
    states = torch.randn(5, HV, DK, DV, generator=gen) * 0.1
    layout = (_int32(query_start), _int32(seq_lens), _int32(slots))
    max_query_len = max(lengths)
    assert lt.uses_chunked_rule(len(lengths), HV, DK, max_query_len)
    ref_states = states.clone()
    ref_out = TorchGatedDeltaRule.forward(qkv, a, b, a_log, dt_bias, ref_states, *layout, HK, DK, max_query_len)
    states_d = states.to(DEVICE)
    out = lt.TritonGatedDeltaRule.forward(qkv.to(DEVICE), a.to(DEVICE), b.to(DEVICE), a_log.to(DEVICE),
                                          dt_bias.to(DEVICE), states_d, *(t.to(DEVICE) for t in layout), HK, DK,
                                          max_query_len).cpu()
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # (bf16 outputs)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(states_d.cpu(), ref_states, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(states_d[2].cpu(), states[2], atol=0, rtol=0)  # the padding row's slot


def _drafts(commit, source, target, device="cpu"):
    from baryon.kernels.attention.metadata import DraftRows

    return DraftRows(_int32(commit).to(device), _int32(source).to(device), _int32(target).to(device),
                     active=True)


PENDING = 5  # pending rows per block: drafts of up to 4 + the last token


def _pending_buffers(gen, slots, dtype=torch.float32):
    """Two pending blocks per slot, of garbage (nothing reads rows not recorded)."""
    return (torch.randn(2 * slots, PENDING, CHANNELS, generator=gen).to(dtype),
            torch.randn(2 * slots, PENDING, CHANNELS, generator=gen).to(dtype),
            torch.randn(2 * slots, PENDING, 2 * HV, generator=gen).to(dtype))


def _layer_with_drafts(kernels, qkv, a, b, a_log, dt_bias, weight, conv_states, states, pending, layout,
                       drafts, max_query_len):
    conv_kernel, rule_kernel = kernels
    inputs, outputs, ba = pending
    conv = conv_kernel.forward(qkv, weight, None, conv_states, *layout, max_query_len, drafts, inputs, outputs)
    return rule_kernel.forward(conv, a, b, a_log, dt_bias, states, *layout, HK, DK, max_query_len, drafts,
                               outputs, ba)


def test_reference_drafts_keep_the_state_and_commit_what_was_accepted(seed):
    """A verification step's sequences (drafts recorded, the state kept as before them), then a
    step that folds in the accepted ones first: every output and the final states equal running
    the accepted tokens, then the next step's, with no drafts at all."""
    gen = torch.Generator().manual_seed(seed)
    # after a 6-token prefill each of three sequences (slots 2, 0, 1) verifies n drafts + its last token
    prompt, verify = [6, 4, 9], [3, 5, 1]
    qkv, a, b, a_log, dt_bias, weight = _layer_inputs(gen, sum(prompt) + sum(verify) + 8)
    conv_states = torch.randn(3, WIDTH - 1, CHANNELS, generator=gen)
    states = torch.randn(3, HV, DK, DV, generator=gen) * 0.1
    slots = [2, 0, 1]
    plain = (conv_states.clone(), states.clone())
    starts = [0, 6, 10, 19]
    _reference_layer(qkv[:19], a[:19], b[:19], a_log, dt_bias, weight, conv_states, states, starts, prompt, slots)
    _reference_layer(qkv[:19], a[:19], b[:19], a_log, dt_bias, weight, *plain, starts, prompt, slots)
    kernels = (TorchCausalConv1d, TorchGatedDeltaRule)
    pending = _pending_buffers(gen, 3)
    # the verification: sequences record into block 2 slot + 1
    rows = slice(19, 28)
    vstart = [0, 3, 8, 9]
    layout = (_int32(vstart), _int32([p + v for p, v in zip(prompt, verify)]), _int32(slots))
    kept = (conv_states.clone(), states.clone())
    verified = _layer_with_drafts(kernels, qkv[rows], a[rows], b[rows], a_log, dt_bias, weight, conv_states, states,
                                  pending, layout, _drafts([0] * 3, [-1] * 3, [2 * s + 1 for s in slots]), 5)
    torch.testing.assert_close(conv_states, kept[0], atol=0, rtol=0)
    torch.testing.assert_close(states, kept[1], atol=0, rtol=0)
    alone = _reference_layer(qkv[rows], a[rows], b[rows], a_log, dt_bias, weight, kept[0].clone(), kept[1].clone(),
                             vstart, layout[1].tolist(), slots)[1]
    torch.testing.assert_close(verified, alone, atol=1e-6, rtol=1e-6)
    # accepted: 2 of 3, 5 of 5, 1 of 1 tokens; the next step: 2, 1, 3 tokens (the first a verification
    # again, recording into the slot's other block), each committing its accepted ones first
    accepted, following = [2, 5, 1], [2, 1, 3]
    accepted_rows = torch.cat([torch.arange(19 + s, 19 + s + n) for s, n in zip(vstart, accepted)])
    done = [p + n for p, n in zip(prompt, accepted)]
    _reference_layer(qkv[accepted_rows], a[accepted_rows], b[accepted_rows], a_log, dt_bias, weight, *plain,
                     [0, 2, 7, 8], done, slots)
    rows = slice(28, 34)
    nstart = [0, 2, 3, 6]
    after = [d + f for d, f in zip(done, following)]
    expected = _reference_layer(qkv[rows], a[rows], b[rows], a_log, dt_bias, weight, *plain, nstart, after, slots)[1]
    layout = (_int32(nstart), _int32(after), _int32(slots))
    got = _layer_with_drafts(kernels, qkv[rows], a[rows], b[rows], a_log, dt_bias, weight, conv_states, states,
                             pending, layout, _drafts(accepted, [2 * s + 1 for s in slots], [4, -1, -1]), 3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for slot in (0, 1):  # sequences 1 and 2 stored their final states
        torch.testing.assert_close(states[slot], plain[1][slot], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_states[slot], plain[0][slot], atol=0, rtol=0)
    # sequence 0 verified: its state stands after its accepted tokens, before the step's
    committed = (kept[0].clone(), kept[1].clone())
    _reference_layer(qkv[accepted_rows[:2]], a[accepted_rows[:2]], b[accepted_rows[:2]], a_log, dt_bias, weight,
                     *committed, [0, 2], [8], [2])
    torch.testing.assert_close(states[2], committed[1][2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_states[2], committed[0][2], atol=0, rtol=0)
    torch.testing.assert_close(pending[0][4, :2], qkv[28:30], atol=0, rtol=0)


@pytest.mark.parametrize("dtype,with_prompt", [(torch.float32, False), (torch.bfloat16, False),
                                              (torch.float32, True)])
def test_triton_kernels_with_drafts_match_references(seed, dtype, with_prompt):
    """The Triton convolution and token walk with DraftRows: commits, recordings, a sequence doing
    both, a plain one and padding, against the references; with_prompt: beside them a fresh
    prompt long enough for the chunked rule, which it takes while the others walk."""
    lt = pytest.importorskip("baryon.kernels.linear_attention_triton")
    if lt.triton is None:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(seed)
    # seq 0 commits 3 then verifies 4; seq 1 commits 5 (all), 1 plain token; seq 2 commits 2 of a state that
    # covers nothing before them, verifies 2; seq 3 a plain 3-token continuation; seq 4 padding
    query_start, seq_lens, slots = [0, 4, 5, 7, 10, 10], [20, 16, 4, 13, 0], [1, 3, 0, 2, 4]
    commit, source, target = [3, 5, 2, 0, 0], [3, 6, 0, -1, -1], [2, -1, 1, -1, -1]
    if with_prompt:  # seq 5: 70 fresh tokens in slot 4 (the padding row's, which stores nothing)
        query_start, seq_lens, slots = query_start + [80], seq_lens + [70], slots + [4]
        commit, source, target = commit + [0], source + [-1], target + [-1]
        chunked = lt.chunked_delta_rule
        calls = []
        lt.chunked_delta_rule = lambda *args: (calls.append(args[7].tolist()), chunked(*args))[1]
    max_query_len = 70 if with_prompt else 4
    tokens = query_start[-1]
    qkv, a, b, a_log, dt_bias, weight = _layer_inputs(gen, tokens)
    qkv, a, b, weight = (t.to(dtype) for t in (qkv, a, b, weight))
    conv_states = torch.randn(5, WIDTH - 1, CHANNELS, generator=gen).to(dtype)
    states = torch.randn(5, HV, DK, DV, generator=gen) * 0.1
    pending = _pending_buffers(gen, 5, dtype)
    layout = (_int32(query_start), _int32(seq_lens), _int32(slots))
    ref = [t.clone() for t in (conv_states, states, *pending)]
    ref_out = _layer_with_drafts((TorchCausalConv1d, TorchGatedDeltaRule), qkv, a, b, a_log, dt_bias, weight,
                                 ref[0], ref[1], ref[2:], layout, _drafts(commit, source, target), max_query_len)
    dev = [t.to(DEVICE) for t in (conv_states, states, *pending)]
    try:
        out = _layer_with_drafts((lt.TritonCausalConv1d, lt.TritonGatedDeltaRule), *(t.to(DEVICE) for t in (
            qkv, a, b, a_log, dt_bias, weight)), dev[0], dev[1], dev[2:], tuple(t.to(DEVICE) for t in layout),
            _drafts(commit, source, target, DEVICE), max_query_len)
    finally:
        if with_prompt:
            lt.chunked_delta_rule = chunked
    if with_prompt:  # the chunked form saw only the prompt
        assert calls == [[0, 0, 0, 13, 0, 70]]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    real = slice(0, query_start[-1])  # (the padding sequence has no tokens)
    torch.testing.assert_close(out[real].cpu(), ref_out[real], **tol)
    torch.testing.assert_close(dev[1].cpu(), ref[1], **tol)
    torch.testing.assert_close(dev[0].cpu(), ref[0], atol=0, rtol=0)
    for got, expected in zip(dev[2:], ref[2:]):  # the recorded blocks
        torch.testing.assert_close(got[[2, 1]].cpu()[:, :4], expected[[2, 1]][:, :4], **tol)
