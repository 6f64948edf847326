"""Gated DeltaNet's causal convolution and gated delta rule as Triton kernels (the semantics, the
layouts and the state rules of linear_attention.py: read its docstring).

- The convolution: one program per (sequence, block of BLOCK_T new tokens, block of channels),
  each token's K taps read from the new tokens or, before the sequence's first new token, from
  its state; a second, small kernel then stores each sequence's last K - 1 inputs as its state
  (after every program of the first has read the old one).
- The gated RMSNorm: one program per block of (token, value head) rows, each row's D features
  whole in registers.
- The delta rule: one program per (sequence, value head, block of BLOCK_V value features), its
  Dk x BLOCK_V slice of the state in registers across the sequence's new tokens (a decode step
  reads and writes it once; a prefill chunk walks its tokens in order); `delta_rule_tiles`. A step
  with long new-token spans runs the chunked form instead (delta_rule_chunked_triton.py).

All of them read only device tensors, so decode steps are captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from baryon.kernels.attention.metadata import DraftRows
from baryon.kernels.delta_rule_chunked_triton import chunked_delta_rule
from baryon.kernels.linear_attention import L2_NORM_EPS
from baryon.kernels.triton_utils import TritonKernel, next_power_of_2, tl, triton

CONV_BLOCK_T = 16
CONV_BLOCK_C = 128
CHUNKED_MIN_QUERY_LEN = 64  # the delta rule in chunks once a sequence has this many new tokens ...
CHUNKED_MAX_PAIRS = 256  # ... and the step fewer (sequence, value head) pairs than this


def uses_chunked_rule(num_seqs: int, num_v_heads: int, head_k_dim: int, max_query_len: int) -> bool:
    """Whether a step's delta rule runs in chunks: a long span among few sequences, where the token
    walk has too few programs to fill the GPU (1 x 4096 tokens at Qwen3-Next's widths on an H200:
    2.5 ms against the walk's 6.3; 8 x 2048: 9.9 ms against 4.8, BENCHMARKS.md)."""
    return max_query_len >= CHUNKED_MIN_QUERY_LEN and num_seqs * num_v_heads < CHUNKED_MAX_PAIRS and head_k_dim >= 16


def delta_rule_tiles(num_seqs: int, num_v_heads: int, head_v_dim: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the delta rule: one warp a program, so that each thread holds whole
    Dk columns of its state slice and the per-token sums over Dk stay in its registers; 32 value
    features a program once the batch has 256 (sequence, head) pairs to spread, else 16 (twice the
    programs for a lone sequence). Measured on an H200 at Qwen3-Next's widths (BENCHMARKS.md)."""
    block_v = 32 if num_seqs * num_v_heads >= 256 else 16
    return min(block_v, next_power_of_2(head_v_dim)), 1


if triton is not None:

    @triton.jit
    def _draft_rows(commits, sources, targets, seq, HAS_DRAFTS: tl.constexpr):
        """(commit, source, target) of a sequence (DraftRows; 0, -1, -1 without speculative decoding)."""
        commit, source, target = 0, -1, -1
        if HAS_DRAFTS:
            commit = tl.load(commits + seq)
            source = tl.load(sources + seq).to(tl.int64)
            target = tl.load(targets + seq).to(tl.int64)
        return commit, source, target

    @triton.jit
    def _causal_conv1d_kernel(x, weight, bias, states, out, query_start, seq_lens, slots,
                              commits, sources, targets, pending_inputs, pending_outputs,
                              stride_x, stride_out, C, PENDING: tl.constexpr, WIDTH: tl.constexpr,
                              HAS_BIAS: tl.constexpr, HAS_DRAFTS: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """Grid: (num_seqs, cdiv(max_query_len, BLOCK_T), cdiv(C, BLOCK_C)). A tap before the
        sequence's first new token reads [its state's WIDTH - 1 rows | the `commit` pending inputs
        of block `source`]; a sequence of drafts (`target` >= 0) records its outputs in block `target`."""
        seq = tl.program_id(0)
        start = tl.load(query_start + seq)
        n = tl.load(query_start + seq + 1) - start
        seq_len = tl.load(seq_lens + seq)
        first = tl.program_id(1) * BLOCK_T
        if first >= n or seq_len == 0:
            return
        slot = tl.load(slots + seq).to(tl.int64)
        commit, source, target = _draft_rows(commits, sources, targets, seq, HAS_DRAFTS)
        ts = first + tl.arange(0, BLOCK_T)  # [BLOCK_T] positions among the new tokens
        # (a tensor: the interpreter turns a scalar condition in a mask into int32)
        has_initial = (ts * 0 + slot >= 0) & (ts * 0 + seq_len > n + commit)
        cs = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        t_ok = ts < n
        c_ok = cs < C
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias + cs, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(WIDTH):
            src = ts - (WIDTH - 1) + j  # [BLOCK_T]: < 0 reads row WIDTH - 1 + commit + src of the history
            in_x = src >= 0
            xv = tl.load(x + (start + src).to(tl.int64)[:, None] * stride_x + cs[None, :],
                         mask=(t_ok & in_x)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            history = WIDTH - 1 + commit + src  # [BLOCK_T]
            old = t_ok & (src < 0) & (history < WIDTH - 1)
            hv = tl.load(states + (slot * (WIDTH - 1) + history)[:, None] * C + cs[None, :],
                         mask=(old & has_initial)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            if HAS_DRAFTS:
                recorded = t_ok & (src < 0) & (history >= WIDTH - 1)
                hv += tl.load(pending_inputs + (source * PENDING + history - (WIDTH - 1))[:, None] * C + cs[None, :],
                              mask=recorded[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(weight + cs * WIDTH + j, mask=c_ok, other=0.0).to(tl.float32)
            acc += (xv + hv) * w[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(out + (start + ts).to(tl.int64)[:, None] * stride_out + cs[None, :],
                 y.to(out.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])
        if HAS_DRAFTS:
            if target >= 0:
                tl.store(pending_outputs + (target * PENDING + ts)[:, None] * C + cs[None, :],
                         y.to(pending_outputs.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _store_conv_state_kernel(x, states, query_start, seq_lens, slots, commits, sources, targets, pending_inputs,
                                 stride_x, C, PENDING: tl.constexpr, WIDTH: tl.constexpr, HAS_DRAFTS: tl.constexpr,
                                 ROWS: tl.constexpr, PENDING_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        """Grid: (num_seqs, cdiv(C, BLOCK_C)); ROWS: next_power_of_2(WIDTH - 1). The state's rows
        are the last WIDTH - 1 of [old state rows, commit pending inputs, new inputs]; a sequence of
        drafts takes in no new input and records them in block `target`."""
        seq = tl.program_id(0)
        start = tl.load(query_start + seq)
        n = tl.load(query_start + seq + 1) - start
        seq_len = tl.load(seq_lens + seq)
        slot = tl.load(slots + seq).to(tl.int64)
        if n == 0 or seq_len == 0 or slot < 0:
            return
        commit, source, target = _draft_rows(commits, sources, targets, seq, HAS_DRAFTS)
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        rows = tl.arange(0, ROWS)  # [ROWS]: the new state's rows
        has_initial = (rows * 0 + seq_len > n + commit)[:, None]  # (a tensor, as in _causal_conv1d_kernel)
        ok = (rows < WIDTH - 1)[:, None] & (cs < C)[None, :]
        taken = commit + n  # inputs after the old state that the state takes in (drafts: none of theirs)
        if HAS_DRAFTS:
            taken = tl.where(target >= 0, commit, taken)
        index = taken + rows  # [ROWS]: where each comes from in [old state (WIDTH - 1 rows), commit, new inputs]
        from_x = (index >= WIDTH - 1 + commit)[:, None]
        from_old = (index < WIDTH - 1)[:, None]
        base = states + slot * (WIDTH - 1) * C
        xv = tl.load(x + (start + index - (WIDTH - 1) - commit).to(tl.int64)[:, None] * stride_x + cs[None, :],
                     mask=ok & from_x, other=0.0).to(states.dtype.element_ty)
        hv = tl.load(base + index[:, None] * C + cs[None, :], mask=ok & from_old & has_initial, other=0.0)
        if HAS_DRAFTS:
            pv = tl.load(pending_inputs + (source * PENDING + index - (WIDTH - 1))[:, None] * C + cs[None, :],
                         mask=ok & ~from_old & ~from_x, other=0.0).to(states.dtype.element_ty)
            hv = tl.where(from_old, hv, pv)
            if target >= 0:  # the drafts' inputs, for the next step's commit
                prow = tl.arange(0, PENDING_ROWS)  # [PENDING_ROWS]
                p_ok = (prow < n)[:, None] & (cs < C)[None, :]
                inputs = tl.load(x + (start + prow).to(tl.int64)[:, None] * stride_x + cs[None, :], mask=p_ok)
                tl.store(pending_inputs + (target * PENDING + prow)[:, None] * C + cs[None, :],
                         inputs.to(pending_inputs.dtype.element_ty), mask=p_ok)
        new_rows = tl.where(from_x, xv, hv)  # [ROWS, BLOCK_C]
        tl.debug_barrier()  # every old row is read before any moves up in place
        tl.store(base + rows[:, None] * C + cs[None, :], new_rows, mask=ok)

    @triton.jit
    def _gated_delta_rule_kernel(qkv, a, b, a_log, dt_bias, states, out, query_start, seq_lens, slots,
                                 commits, sources, targets, pending_qkv, pending_ba,
                                 stride_qkv, stride_a, stride_b, stride_out, scale, eps,
                                 NUM_V_HEADS: tl.constexpr, GROUP: tl.constexpr, KEY_DIM: tl.constexpr,
                                 DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                                 PENDING: tl.constexpr, HAS_DRAFTS: tl.constexpr):
        """Grid: (num_seqs, NUM_V_HEADS, cdiv(DV, BLOCK_V)). With drafts: the `commit` pending
        tokens of block `source` first (the state only); a sequence of drafts stores the state
        before them and records their b, a in block `target`."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        start = tl.load(query_start + seq)
        end = tl.load(query_start + seq + 1)
        seq_len = tl.load(seq_lens + seq)
        if end == start or seq_len == 0:
            return
        slot = tl.load(slots + seq).to(tl.int64)
        commit, source, target = _draft_rows(commits, sources, targets, seq, HAS_DRAFTS)
        dk = tl.arange(0, DK)  # [DK]
        dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        v_ok = dv < DV
        # [DK] (a tensor: see _causal_conv1d_kernel)
        has_initial = (dk * 0 + slot >= 0) & (dk * 0 + seq_len > end - start + commit)
        state_at = states + ((slot * NUM_V_HEADS + head) * DK + dk[:, None]) * DV + dv[None, :]  # [DK, BLOCK_V]
        state = tl.load(state_at, mask=has_initial[:, None] & v_ok[None, :], other=0.0)
        decay_rate = -tl.exp(tl.load(a_log + head).to(tl.float32))
        bias = tl.load(dt_bias + head).to(tl.float32)
        q_at = qkv + (head // GROUP) * DK + dk
        k_at = q_at + KEY_DIM
        v_at = qkv + 2 * KEY_DIM + head * DV + dv
        if HAS_DRAFTS:
            width = 2 * KEY_DIM + NUM_V_HEADS * DV  # a pending row: the convolution's outputs
            j = 0
            while j < commit:  # the last verification's accepted tokens: the state only
                row = source * PENDING + j
                k = tl.load(pending_qkv + row * width + KEY_DIM + (head // GROUP) * DK + dk).to(tl.float32)
                v = tl.load(pending_qkv + row * width + 2 * KEY_DIM + head * DV + dv, mask=v_ok,
                            other=0.0).to(tl.float32)
                k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
                x = tl.load(pending_ba + row * 2 * NUM_V_HEADS + NUM_V_HEADS + head).to(tl.float32) + bias
                softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
                beta = tl.sigmoid(tl.load(pending_ba + row * 2 * NUM_V_HEADS + head).to(tl.float32))
                state = state * tl.exp(decay_rate * softplus)
                delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
                state = state + k[:, None] * delta[None, :]
                j += 1
            if target >= 0:
                if slot >= 0:
                    tl.store(state_at, state, mask=v_ok[None, :])
                if tl.program_id(2) == 0:  # b and a of the drafts, for the next step's commit
                    t = start
                    while t < end:
                        row = target * PENDING + t - start
                        tl.store(pending_ba + row * 2 * NUM_V_HEADS + head,
                                 tl.load(b + t.to(tl.int64) * stride_b + head).to(pending_ba.dtype.element_ty))
                        tl.store(pending_ba + row * 2 * NUM_V_HEADS + NUM_V_HEADS + head,
                                 tl.load(a + t.to(tl.int64) * stride_a + head).to(pending_ba.dtype.element_ty))
                        t += 1
        t = start
        while t < end:
            row = t.to(tl.int64)
            q = tl.load(q_at + row * stride_qkv).to(tl.float32)
            k = tl.load(k_at + row * stride_qkv).to(tl.float32)
            v = tl.load(v_at + row * stride_qkv, mask=v_ok, other=0.0).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
            x = tl.load(a + row * stride_a + head).to(tl.float32) + bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            beta = tl.sigmoid(tl.load(b + row * stride_b + head).to(tl.float32))
            state = state * tl.exp(decay_rate * softplus)
            remembered = tl.sum(state * k[:, None], axis=0)  # [BLOCK_V]
            delta = (v - remembered) * beta
            state = state + k[:, None] * delta[None, :]
            o = tl.sum(state * q[:, None], axis=0)
            tl.store(out + row * stride_out + head * DV + dv, o.to(out.dtype.element_ty), mask=v_ok)
            t += 1
        if slot >= 0 and target < 0:
            tl.store(state_at, state, mask=v_ok[None, :])

    @triton.jit
    def _gated_rms_norm_kernel(x, gate, weight, out, rows, heads, stride_xt, stride_xh, stride_gt, stride_gh, eps,
                               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
        row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]: (token, head) rows
        cols = tl.arange(0, BLOCK_D)
        mask = (row < rows)[:, None] & (cols < D)[None, :]
        token, head = (row // heads).to(tl.int64), row % heads
        x_rows = x + token[:, None] * stride_xt + head[:, None] * stride_xh + cols[None, :]
        values = tl.load(x_rows, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_D]
        inv_rms = tl.rsqrt(tl.sum(values * values, axis=1) / D + eps)
        dtype = out.dtype.element_ty
        normed = (values * inv_rms[:, None]).to(dtype).to(tl.float32)
        w = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
        weighted = (normed * w[None, :]).to(dtype).to(tl.float32)  # a product of two 16-bit values: exact in float32
        g = tl.load(gate + token[:, None] * stride_gt + head[:, None] * stride_gh + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        result = weighted * (g / (1.0 + tl.exp(-g)))
        tl.store(out + row.to(tl.int64)[:, None] * D + cols[None, :], result.to(dtype), mask=mask)


class TritonGatedRMSNorm(TritonKernel):
    family = "gated_rms_norm"

    @staticmethod
    def forward(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """As TorchGatedRMSNorm.forward (x's and gate's last dimension contiguous)."""
        tokens, heads, dim = x.shape
        out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)  # [T, H, D]
        rows = tokens * heads
        if rows == 0:
            return out
        block_d = next_power_of_2(dim)
        block_r = max(1, min(16, 4096 // block_d))
        _gated_rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            x, gate, weight, out, rows, heads, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), eps,
            D=dim, BLOCK_D=block_d, BLOCK_R=block_r)
        return out


class TritonCausalConv1d(TritonKernel):
    family = "causal_conv1d"
    cuda_graph_safe = True

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                query_start: torch.Tensor, seq_lens: torch.Tensor, state_slots: torch.Tensor,
                max_query_len: int, drafts: DraftRows | None = None, pending_inputs: torch.Tensor | None = None,
                pending_outputs: torch.Tensor | None = None) -> torch.Tensor:
        """As TorchCausalConv1d.forward."""
        tokens, channels = x.shape
        width = weight.shape[1]
        out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)  # [T, C]
        num_seqs = seq_lens.shape[0]
        if tokens == 0 or num_seqs == 0:
            return out
        channel_blocks = triton.cdiv(channels, CONV_BLOCK_C)
        rows = (drafts.commit, drafts.source, drafts.target) if drafts is not None else (seq_lens,) * 3
        pending = (pending_inputs, pending_outputs) if drafts is not None else (x, x)
        _causal_conv1d_kernel[(num_seqs, triton.cdiv(max(max_query_len, 1), CONV_BLOCK_T), channel_blocks)](
            x, weight, bias if bias is not None else weight, conv_states, out, query_start, seq_lens, state_slots,
            *rows, *pending, x.stride(0), out.stride(0), channels, PENDING=pending[0].shape[1] if drafts else 1,
            WIDTH=width, HAS_BIAS=bias is not None, HAS_DRAFTS=drafts is not None,
            BLOCK_T=CONV_BLOCK_T, BLOCK_C=CONV_BLOCK_C)
        _store_conv_state_kernel[(num_seqs, channel_blocks)](
            x, conv_states, query_start, seq_lens, state_slots, *rows, pending[0], x.stride(0), channels,
            PENDING=pending[0].shape[1] if drafts else 1, WIDTH=width, HAS_DRAFTS=drafts is not None,
            ROWS=next_power_of_2(width - 1), PENDING_ROWS=next_power_of_2(pending[0].shape[1]) if drafts else 1,
            BLOCK_C=CONV_BLOCK_C)
        return out


class TritonGatedDeltaRule(TritonKernel):
    family = "gated_delta_rule"
    cuda_graph_safe = True

    @classmethod
    def cannot_implement_reason(cls, head_k_dim: int = 128, **config) -> str | None:
        if head_k_dim != next_power_of_2(head_k_dim):
            return f"head_k_dim {head_k_dim} is not a power of two"
        return None

    @staticmethod
    def forward(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                recurrent_states: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                state_slots: torch.Tensor, num_k_heads: int, head_k_dim: int, max_query_len: int,
                drafts: DraftRows | None = None, pending_qkv: torch.Tensor | None = None,
                pending_ba: torch.Tensor | None = None) -> torch.Tensor:
        """As TorchGatedDeltaRule.forward: in chunks (delta_rule_chunked_triton.py) where
        `uses_chunked_rule`, else token by token; in a step that does both, the sequences that
        commit or record drafts walk (a prompt beside verifications still goes in chunks)."""
        _, num_v_heads, _, head_v_dim = recurrent_states.shape
        tokens = qkv.shape[0]
        out = torch.empty(tokens, num_v_heads, head_v_dim, dtype=qkv.dtype, device=qkv.device)  # [T, Hv, Dv]
        num_seqs = seq_lens.shape[0]
        if tokens == 0 or num_seqs == 0:
            return out
        if uses_chunked_rule(num_seqs, num_v_heads, head_k_dim, max_query_len):
            speculative = None if drafts is None or not drafts.active else \
                (drafts.commit > 0) | (drafts.target >= 0)  # [S]: the sequences that walk
            # (a sequence of length 0 is padding to either form)
            chunked_delta_rule(qkv, a, b, a_log, dt_bias, recurrent_states, query_start,
                               seq_lens if speculative is None else seq_lens.masked_fill(speculative, 0),
                               state_slots, num_k_heads, head_k_dim, max_query_len, out)
            if speculative is None:
                return out
            seq_lens = seq_lens.masked_fill(~speculative, 0)
        block_v, warps = delta_rule_tiles(num_seqs, num_v_heads, head_v_dim)
        rows = (drafts.commit, drafts.source, drafts.target) if drafts is not None else (seq_lens,) * 3
        pending = (pending_qkv, pending_ba) if drafts is not None else (qkv, a)
        _gated_delta_rule_kernel[(num_seqs, num_v_heads, triton.cdiv(head_v_dim, block_v))](
            qkv, a, b, a_log, dt_bias, recurrent_states, out, query_start, seq_lens, state_slots, *rows, *pending,
            qkv.stride(0), a.stride(0), b.stride(0), out.stride(0), head_k_dim ** -0.5, L2_NORM_EPS,
            NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // num_k_heads, KEY_DIM=num_k_heads * head_k_dim,
            DK=head_k_dim, DV=head_v_dim, BLOCK_V=block_v, PENDING=pending[0].shape[1] if drafts else 1,
            HAS_DRAFTS=drafts is not None, num_warps=warps)
        return out
