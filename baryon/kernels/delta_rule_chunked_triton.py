"""The gated delta rule over a prefill's chunks of CHUNK tokens, as tensor-core matrix products (the
chunked form of linear_attention._rule_chunk; the semantics, layouts and state rules of
linear_attention.py), in three kernels as FLA splits it. TritonGatedDeltaRule runs it for steps with
long new-token spans; a decode step's single tokens go through the token walk.

- `_chunk_prepare_kernel`, one program per (sequence, chunk, value head), all at once: what does
  not depend on the state. G, the chunk's cumulative log decay; A[t, i] = beta_t exp(G_t - G_i)
  k_t . k_i (i < t) and T = (I + A)^-1 by forward substitution, row after row in registers (the
  doubling product (I - A)(I + A^2)(I + A^4)... is all tensor-core work but loses every digit to
  cancellation when a chunk's keys are alike); W = T (beta exp(G) k), U = T (beta v) and the
  causal decayed scores exp(G_t - G_i) q_t . k_i. Stored by token: w [T, Hv, Dk], u [T, Hv, Dv],
  scores [T, Hv, CHUNK], G [T, Hv].
- `_chunk_states_kernel`, one program per (value block, value head, sequence), walking the
  sequence's chunks with its Dk x BLOCK_V slice of the state S in registers, two products a chunk:
      S kept as the chunk's starting state;  delta = U - W S;  S = exp(G_last) S + (exp(G_last - G) k)^T delta
- `_chunk_outputs_kernel`, one program per (sequence, chunk, value head and block), all at once:
      out = exp(G) q S_chunk + scores delta
Intermediates in float32; the products take float32 operands
in TF32 with a correction pass ("tf32x3", close to float32) for 16-bit models, float32 throughout for
float32 models. Scratch per step of T tokens (float32): (Dk + 2 Dv + CHUNK + 1) values per token and
value head, and one state per chunk and value head (Dk x Dv).
"""

from __future__ import annotations

import torch

from baryon.kernels.linear_attention import L2_NORM_EPS
from baryon.kernels.triton_utils import next_power_of_2, tl, triton

CHUNK = 64  # tokens a chunk (FLA's choice too)


if triton is not None:

    @triton.jit
    def _row_gates(a, b, rows, ok, head, stride_a, stride_b, decay_rate, bias):
        """(g, the log decay, 0 outside the span; beta, 0 outside) of a chunk's rows [CHUNK]."""
        x = tl.load(a + rows * stride_a + head, mask=ok, other=0.0).to(tl.float32) + bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = tl.where(ok, decay_rate * softplus, 0.0)
        beta = tl.where(ok, tl.sigmoid(tl.load(b + rows * stride_b + head, mask=ok, other=0.0).to(tl.float32)), 0.0)
        return g, beta

    @triton.jit
    def _load_normalised(at, rows, ok, stride, dk, eps):
        """A chunk's rows of one key head's queries or keys, l2-normalised: [CHUNK, DK] float32."""
        x = tl.load(at + rows[:, None] * stride + dk[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        return x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]

    @triton.jit
    def _chunk_prepare_kernel(qkv, a, b, a_log, dt_bias, w, u, aqk, gcum, query_start, seq_lens,
                              stride_qkv, stride_a, stride_b, scale, eps,
                              NUM_V_HEADS: tl.constexpr, GROUP: tl.constexpr, KEY_DIM: tl.constexpr,
                              DK: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr, C: tl.constexpr,
                              PRECISION: tl.constexpr):
        """Grid: (num_seqs, cdiv(max_query_len, C), NUM_V_HEADS). Everything of a chunk that does not
        depend on the state: G (the cumulative log decay), the causal decayed scores exp(G_t - G_i)
        q_t . k_i, and with T = (I + A)^-1, W = T (beta exp(G) k) and U = T (beta v)."""
        seq = tl.program_id(0)
        head = tl.program_id(2)
        start = tl.load(query_start + seq)
        end = tl.load(query_start + seq + 1)
        first = start + tl.program_id(1) * C
        if first >= end or tl.load(seq_lens + seq) == 0:
            return
        i = tl.arange(0, C)
        rows = (first + i).to(tl.int64)  # [C]
        ok = rows < end
        dk = tl.arange(0, DK)
        k = _load_normalised(qkv + KEY_DIM + (head // GROUP) * DK, rows, ok, stride_qkv, dk, eps)  # [C, DK]
        decay_rate = -tl.exp(tl.load(a_log + head).to(tl.float32))
        g, beta = _row_gates(a, b, rows, ok, head, stride_a, stride_b, decay_rate,
                             tl.load(dt_bias + head).to(tl.float32))
        big_g = tl.cumsum(g, axis=0)  # [C]
        tl.store(gcum + rows * NUM_V_HEADS + head, big_g, mask=ok)
        strict = i[:, None] > i[None, :]
        gaps = tl.exp(tl.where(strict, big_g[:, None] - big_g[None, :], 0.0))
        kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)  # [C, C]
        # A transposed (a_t[i, t] = A[t, i]), so that A's row t comes out along the first axis
        a_t = tl.trans(tl.where(strict, beta[:, None] * gaps * kk, 0.0))
        inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0)  # [C, C], row t final once step t is done
        for t in range(1, C):  # forward substitution: T[t] = e_t - A[t, :t] T[:t]
            a_row = tl.sum(tl.where(i[None, :] == t, a_t, 0.0), axis=1)  # [C]: A[t, :]
            inv = tl.where(i[:, None] == t, inv - tl.sum(a_row[:, None] * inv, axis=0)[None, :], inv)
        at_row = rows[:, None] * NUM_V_HEADS + head  # [C, 1]
        wk = tl.dot(inv, k * (beta * tl.exp(big_g))[:, None], input_precision=PRECISION)  # [C, DK]
        tl.store(w + at_row * DK + dk[None, :], wk, mask=ok[:, None])
        q = _load_normalised(qkv + (head // GROUP) * DK, rows, ok, stride_qkv, dk, eps) * scale
        causal = i[:, None] >= i[None, :]
        decayed = tl.where(causal, tl.exp(tl.where(causal, big_g[:, None] - big_g[None, :], 0.0)), 0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decayed  # [C, C]
        tl.store(aqk + at_row * C + i[None, :], scores, mask=ok[:, None])
        dv = tl.arange(0, DV_P)
        v = tl.load(qkv + 2 * KEY_DIM + head * DV + rows[:, None] * stride_qkv + dv[None, :],
                    mask=ok[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)  # [C, DV_P]
        uv = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)  # [C, DV_P]
        tl.store(u + at_row * DV + dv[None, :], uv, mask=ok[:, None] & (dv < DV)[None, :])

    @triton.jit
    def _chunk_states_kernel(qkv, w, u, gcum, states, chunk_states, delta, query_start, seq_lens, slots,
                             chunk_offsets, stride_qkv, eps, NUM_V_HEADS: tl.constexpr, GROUP: tl.constexpr,
                             KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                             C: tl.constexpr, PRECISION: tl.constexpr):
        """Grid: (cdiv(DV, BLOCK_V), NUM_V_HEADS, num_seqs). The sequential pass, two products a
        chunk: each chunk's starting state kept, delta = U - W S, S = exp(G_last) S +
        (exp(G_last - G) k)^T delta."""
        head = tl.program_id(1)
        seq = tl.program_id(2)
        start = tl.load(query_start + seq)
        end = tl.load(query_start + seq + 1)
        seq_len = tl.load(seq_lens + seq)
        if end == start or seq_len == 0:
            return
        slot = tl.load(slots + seq).to(tl.int64)
        dk = tl.arange(0, DK)
        dv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        v_ok = dv < DV
        i = tl.arange(0, C)
        has_initial = (dk * 0 + slot >= 0) & (dk * 0 + seq_len > end - start)  # [DK] (a tensor: see the conv kernel)
        state_at = states + ((slot * NUM_V_HEADS + head) * DK + dk[:, None]) * DV + dv[None, :]  # [DK, BLOCK_V]
        state = tl.load(state_at, mask=has_initial[:, None] & v_ok[None, :], other=0.0)
        key_at = qkv + KEY_DIM + (head // GROUP) * DK
        chunk = tl.load(chunk_offsets + seq).to(tl.int64)
        first = start
        while first < end:
            rows = (first + i).to(tl.int64)  # [C]
            ok = rows < end
            tl.store(chunk_states + ((chunk * NUM_V_HEADS + head) * DK + dk[:, None]) * DV + dv[None, :], state,
                     mask=v_ok[None, :])
            at_row = rows[:, None] * NUM_V_HEADS + head  # [C, 1]
            wk = tl.load(w + at_row * DK + dk[None, :], mask=ok[:, None], other=0.0)  # [C, DK]
            new = tl.load(u + at_row * DV + dv[None, :], mask=ok[:, None] & v_ok[None, :], other=0.0)
            new -= tl.dot(wk, state, input_precision=PRECISION)  # delta [C, BLOCK_V]
            tl.store(delta + at_row * DV + dv[None, :], new, mask=ok[:, None] & v_ok[None, :])
            big_g = tl.load(gcum + rows * NUM_V_HEADS + head, mask=ok, other=0.0)
            last = tl.load(gcum + (tl.minimum(first + C, end) - 1).to(tl.int64) * NUM_V_HEADS + head)
            k = _load_normalised(key_at, rows, ok, stride_qkv, dk, eps)  # [C, DK], 0 past the span
            decayed_k = k * tl.exp(last - big_g)[:, None]
            state = state * tl.exp(last) + tl.dot(tl.trans(decayed_k), new, input_precision=PRECISION)
            first += C
            chunk += 1
        if slot >= 0:
            tl.store(state_at, state, mask=v_ok[None, :])

    @triton.jit
    def _chunk_outputs_kernel(qkv, aqk, gcum, chunk_states, delta, out, query_start, seq_lens, chunk_offsets,
                              stride_qkv, stride_out, scale, eps, NUM_V_HEADS: tl.constexpr, GROUP: tl.constexpr,
                              DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, NUM_V_BLOCKS: tl.constexpr,
                              C: tl.constexpr, PRECISION: tl.constexpr):
        """Grid: (num_seqs, cdiv(max_query_len, C), NUM_V_HEADS * NUM_V_BLOCKS). Every chunk at once:
        out = exp(G) q S_chunk + scores delta."""
        seq = tl.program_id(0)
        head = tl.program_id(2) // NUM_V_BLOCKS
        start = tl.load(query_start + seq)
        end = tl.load(query_start + seq + 1)
        first = start + tl.program_id(1) * C
        if first >= end or tl.load(seq_lens + seq) == 0:
            return
        chunk = tl.load(chunk_offsets + seq).to(tl.int64) + tl.program_id(1)
        i = tl.arange(0, C)
        rows = (first + i).to(tl.int64)  # [C]
        ok = rows < end
        dk = tl.arange(0, DK)
        dv = (tl.program_id(2) % NUM_V_BLOCKS) * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = dv < DV
        at_row = rows[:, None] * NUM_V_HEADS + head  # [C, 1]
        q = _load_normalised(qkv + (head // GROUP) * DK, rows, ok, stride_qkv, dk, eps) * scale  # [C, DK]
        state = tl.load(chunk_states + ((chunk * NUM_V_HEADS + head) * DK + dk[:, None]) * DV + dv[None, :],
                        mask=v_ok[None, :], other=0.0)  # [DK, BLOCK_V]
        big_g = tl.load(gcum + rows * NUM_V_HEADS + head, mask=ok, other=0.0)
        scores = tl.load(aqk + at_row * C + i[None, :], mask=ok[:, None], other=0.0)  # [C, C]
        new = tl.load(delta + at_row * DV + dv[None, :], mask=ok[:, None] & v_ok[None, :], other=0.0)
        o = tl.exp(big_g)[:, None] * tl.dot(q, state, input_precision=PRECISION)
        o += tl.dot(scores, new, input_precision=PRECISION)
        tl.store(out + rows[:, None] * stride_out + head * DV + dv[None, :], o.to(out.dtype.element_ty),
                 mask=ok[:, None] & v_ok[None, :])


# The state pass's value block and warps, the outputs' value block and warps (H200, Qwen3-Next's
# widths: BENCHMARKS.md "The chunked delta rule in three kernels"); the first kernel's warps.
CHUNKED_TILES = (32, 4, 32, 4)
PREPARE_WARPS = 8


def chunked_delta_rule(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor, recurrent_states: torch.Tensor, query_start: torch.Tensor,
                     seq_lens: torch.Tensor, state_slots: torch.Tensor, num_k_heads: int, head_k_dim: int,
                     max_query_len: int, out: torch.Tensor) -> torch.Tensor:
    """As TorchGatedDeltaRule.forward, into `out` [T, Hv, Dv] (head_k_dim a power of two >= 16): the
    chunks' state-free parts all at once, the sequential pass over the state, the outputs all at once."""
    tokens = qkv.shape[0]
    _, num_v_heads, _, head_v_dim = recurrent_states.shape
    num_seqs = seq_lens.shape[0]
    device = qkv.device
    precision = "ieee" if qkv.dtype == torch.float32 else "tf32x3"
    shape = dict(NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim, C=CHUNK,
                 PRECISION=precision)
    key_dim = num_k_heads * head_k_dim
    scale = head_k_dim ** -0.5
    w = torch.empty(tokens, num_v_heads, head_k_dim, dtype=torch.float32, device=device)  # [T, Hv, Dk]
    u = torch.empty(tokens, num_v_heads, head_v_dim, dtype=torch.float32, device=device)  # [T, Hv, Dv]
    aqk = torch.empty(tokens, num_v_heads, CHUNK, dtype=torch.float32, device=device)  # [T, Hv, C]
    gcum = torch.empty(tokens, num_v_heads, dtype=torch.float32, device=device)  # [T, Hv]
    chunks = triton.cdiv(max_query_len, CHUNK)
    _chunk_prepare_kernel[(num_seqs, chunks, num_v_heads)](
        qkv, a, b, a_log, dt_bias, w, u, aqk, gcum, query_start, seq_lens, qkv.stride(0), a.stride(0), b.stride(0),
        scale, L2_NORM_EPS, KEY_DIM=key_dim, DV_P=next_power_of_2(head_v_dim), num_warps=PREPARE_WARPS, **shape)
    seq_chunks = ((query_start[1:] - query_start[:-1]).long() + CHUNK - 1) // CHUNK  # [num_seqs]
    chunk_offsets = torch.cumsum(seq_chunks, 0) - seq_chunks  # each sequence's first chunk in chunk_states
    max_chunks = triton.cdiv(tokens, CHUNK) + num_seqs  # at least the step's chunks (no sync to count them)
    chunk_states = torch.empty(max_chunks, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device)
    delta = torch.empty_like(u)
    state_block, state_warps, out_block, out_warps = CHUNKED_TILES
    _chunk_states_kernel[(triton.cdiv(head_v_dim, state_block), num_v_heads, num_seqs)](
        qkv, w, u, gcum, recurrent_states, chunk_states, delta, query_start, seq_lens, state_slots, chunk_offsets,
        qkv.stride(0), L2_NORM_EPS, KEY_DIM=key_dim, BLOCK_V=state_block, num_warps=state_warps, **shape)
    blocks = triton.cdiv(head_v_dim, out_block)
    _chunk_outputs_kernel[(num_seqs, chunks, num_v_heads * blocks)](
        qkv, aqk, gcum, chunk_states, delta, out, query_start, seq_lens, chunk_offsets, qkv.stride(0), out.stride(0),
        scale, L2_NORM_EPS, BLOCK_V=out_block, NUM_V_BLOCKS=blocks, num_warps=out_warps, **shape)
    return out
