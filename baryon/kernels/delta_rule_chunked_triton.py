"""The gated delta rule over a prefill's chunks of CHUNK tokens, as tensor-core matrix products (the
chunked form of linear_attention._rule_chunk; the semantics, layouts and state rules of
linear_attention.py). TritonGatedDeltaRule runs it for steps with long new-token spans; a decode
step's single tokens go through the token walk.

Two kernels:
- `_chunk_inverse_kernel`, one program per (sequence, chunk, value head), all at once: the chunk's
  A[t, i] = beta_t exp(G_t - G_i) k_t . k_i (i < t) and T = (I + A)^-1 by forward substitution, row
  after row in registers (the doubling product (I - A)(I + A^2)(I + A^4)... is all tensor-core
  work but loses every digit to cancellation when a chunk's keys are alike). T's rows are stored
  by token ([T, Hv, CHUNK]).
- `_chunked_rule_kernel`, one program per (sequence, value head, block of BLOCK_V value features),
  walking its chunks in order with its Dk x BLOCK_V slice of the state in registers:
      W = T (beta exp(G) k);  U = T (beta v);  delta = U - W S
      out = exp(G) q S + ([i <= t] exp(G_t - G_i) q_t . k_i) delta
      S = exp(G_last) S + (exp(G_last - G) k)^T delta
The products take float32 operands in TF32 with a correction pass ("tf32x3", close to float32) for
16-bit models (bf16 operands, as FLA's kernels, hit an illegal memory access at Qwen3-Next's widths
on the H200: not yet understood), float32 throughout for float32 models.
"""

from __future__ import annotations

import torch

from baryon.kernels.linear_attention import L2_NORM_EPS
from baryon.kernels.triton_utils import next_power_of_2, tl, triton

CHUNK = 64  # tokens a chunk (FLA's choice too)
INVERSE_WARPS = 4


def chunked_rule_tiles(num_seqs: int, num_v_heads: int, head_v_dim: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the chunk walk (at least 16 features: a tensor-core tile)."""
    return max(16, min(32, next_power_of_2(head_v_dim))), 4


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
    def _chunk_inverse_kernel(qkv, a, b, a_log, dt_bias, inverse, query_start, seq_lens,
                              stride_qkv, stride_a, stride_b, eps,
                              NUM_V_HEADS: tl.constexpr, GROUP: tl.constexpr, KEY_DIM: tl.constexpr,
                              DK: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr):
        """Grid: (num_seqs, cdiv(max_query_len, C), NUM_V_HEADS)."""
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
        strict = i[:, None] > i[None, :]
        gaps = tl.exp(tl.where(strict, big_g[:, None] - big_g[None, :], 0.0))
        kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)  # [C, C]
        # A transposed (a_t[i, t] = A[t, i]), so that A's row t comes out along the first axis
        a_t = tl.trans(tl.where(strict, beta[:, None] * gaps * kk, 0.0))
        inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0)  # [C, C], row t final once step t is done
        for t in range(1, C):  # forward substitution: T[t] = e_t - A[t, :t] T[:t]
            a_row = tl.sum(tl.where(i[None, :] == t, a_t, 0.0), axis=1)  # [C]: A[t, :]
            inv = tl.where(i[:, None] == t, inv - tl.sum(a_row[:, None] * inv, axis=0)[None, :], inv)
        tl.store(inverse + (rows[:, None] * NUM_V_HEADS + head) * C + i[None, :], inv, mask=ok[:, None])

    @triton.jit
    def _chunked_rule_kernel(qkv, a, b, a_log, dt_bias, inverse, states, out, query_start, seq_lens, slots,
                             stride_qkv, stride_a, stride_b, stride_out, scale, eps,
                             NUM_V_HEADS: tl.constexpr, GROUP: tl.constexpr, KEY_DIM: tl.constexpr,
                             DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr,
                             PRECISION: tl.constexpr):
        """Grid: (num_seqs, NUM_V_HEADS, cdiv(DV, BLOCK_V))."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        start = tl.load(query_start + seq)
        end = tl.load(query_start + seq + 1)
        seq_len = tl.load(seq_lens + seq)
        if end == start or seq_len == 0:
            return
        slot = tl.load(slots + seq).to(tl.int64)
        dk = tl.arange(0, DK)
        dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        v_ok = dv < DV
        i = tl.arange(0, C)
        has_initial = (dk * 0 + slot >= 0) & (dk * 0 + seq_len > end - start)  # [DK] (a tensor: see the conv kernel)
        state_at = states + ((slot * NUM_V_HEADS + head) * DK + dk[:, None]) * DV + dv[None, :]  # [DK, BLOCK_V]
        state = tl.load(state_at, mask=has_initial[:, None] & v_ok[None, :], other=0.0)
        decay_rate = -tl.exp(tl.load(a_log + head).to(tl.float32))
        bias = tl.load(dt_bias + head).to(tl.float32)
        q_at = qkv + (head // GROUP) * DK
        causal = i[:, None] >= i[None, :]
        first = start
        while first < end:
            rows = (first + i).to(tl.int64)  # [C]
            ok = rows < end
            q = _load_normalised(q_at, rows, ok, stride_qkv, dk, eps) * scale  # [C, DK]
            k = _load_normalised(q_at + KEY_DIM, rows, ok, stride_qkv, dk, eps)
            v = tl.load(qkv + 2 * KEY_DIM + head * DV + rows[:, None] * stride_qkv + dv[None, :],
                        mask=ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)  # [C, BLOCK_V]
            g, beta = _row_gates(a, b, rows, ok, head, stride_a, stride_b, decay_rate, bias)
            big_g = tl.cumsum(g, axis=0)
            inv = tl.load(inverse + (rows[:, None] * NUM_V_HEADS + head) * C + i[None, :], mask=ok[:, None],
                          other=0.0)  # [C, C]
            w = tl.dot(inv, k * (beta * tl.exp(big_g))[:, None], input_precision=PRECISION)  # [C, DK]
            u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)  # [C, BLOCK_V]
            delta = u - tl.dot(w, state, input_precision=PRECISION)
            gaps = tl.where(causal, tl.exp(tl.where(causal, big_g[:, None] - big_g[None, :], 0.0)), 0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * gaps  # [C, C]
            o = tl.exp(big_g)[:, None] * tl.dot(q, state, input_precision=PRECISION)
            o += tl.dot(scores, delta, input_precision=PRECISION)
            tl.store(out + rows[:, None] * stride_out + head * DV + dv[None, :], o.to(out.dtype.element_ty),
                     mask=ok[:, None] & v_ok[None, :])
            last = tl.sum(g, axis=0)  # G at the chunk's last token (g is 0 past the span)
            decayed_k = k * tl.exp(last - big_g)[:, None]
            state = state * tl.exp(last) + tl.dot(tl.trans(decayed_k), delta, input_precision=PRECISION)
            first += C
        if slot >= 0:
            tl.store(state_at, state, mask=v_ok[None, :])


def chunk_inverses(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                   query_start: torch.Tensor, seq_lens: torch.Tensor, num_k_heads: int, num_v_heads: int,
                   head_k_dim: int, max_query_len: int) -> torch.Tensor:
    """Each chunk's (I + A)^-1, its rows by token: [T, Hv, CHUNK] float32."""
    inverse = torch.empty(qkv.shape[0], num_v_heads, CHUNK, dtype=torch.float32, device=qkv.device)
    _chunk_inverse_kernel[(seq_lens.shape[0], triton.cdiv(max_query_len, CHUNK), num_v_heads)](
        qkv, a, b, a_log, dt_bias, inverse, query_start, seq_lens, qkv.stride(0), a.stride(0), b.stride(0),
        L2_NORM_EPS, NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // num_k_heads, KEY_DIM=num_k_heads * head_k_dim,
        DK=head_k_dim, C=CHUNK, PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32x3",
        num_warps=INVERSE_WARPS)
    return inverse


def chunked_delta_rule(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                       dt_bias: torch.Tensor, recurrent_states: torch.Tensor, query_start: torch.Tensor,
                       seq_lens: torch.Tensor, state_slots: torch.Tensor, num_k_heads: int, head_k_dim: int,
                       max_query_len: int, out: torch.Tensor) -> torch.Tensor:
    """As TorchGatedDeltaRule.forward, into `out` [T, Hv, Dv] (head_k_dim a power of two >= 16)."""
    _, num_v_heads, _, head_v_dim = recurrent_states.shape
    num_seqs = seq_lens.shape[0]
    inverse = chunk_inverses(qkv, a, b, a_log, dt_bias, query_start, seq_lens, num_k_heads, num_v_heads, head_k_dim,
                             max_query_len)
    block_v, warps = chunked_rule_tiles(num_seqs, num_v_heads, head_v_dim)
    _chunked_rule_kernel[(num_seqs, num_v_heads, triton.cdiv(head_v_dim, block_v))](
        qkv, a, b, a_log, dt_bias, inverse, recurrent_states, out, query_start, seq_lens, state_slots,
        qkv.stride(0), a.stride(0), b.stride(0), out.stride(0), head_k_dim ** -0.5, L2_NORM_EPS,
        NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // num_k_heads, KEY_DIM=num_k_heads * head_k_dim,
        DK=head_k_dim, DV=head_v_dim, BLOCK_V=block_v, C=CHUNK, PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32x3",
        num_warps=warps)
    return out
