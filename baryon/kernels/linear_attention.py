"""Gated DeltaNet's token mixing (the linear-attention layers of Qwen3-Next and Qwen3.5): a short
causal depthwise convolution and the gated delta rule, over a step's flat batch of sequences,
each carrying its recurrent state from step to step. Torch references; the Triton kernels are in
linear_attention_triton.py.

A step lays its tokens out flat, sequence after sequence (`query_start` [B + 1]); sequence i has
`seq_lens[i]` tokens after this step, the last query_start[i + 1] - query_start[i] of them new.
Its states live in slot `state_slots[i]` of the state pools:

- the convolution's: `conv_states` [slots, K - 1, C], the last K - 1 inputs of the sequence (K: the
  kernel width, C: the channels, q | k | v);
- the delta rule's: `recurrent_states` [slots, Hv, Dk, Dv] float32, one Dk x Dv matrix per value head.

A sequence whose new tokens are all it has (seq_lens == its query length) starts from zero
states; slot -1 keeps no state (it starts from zeros and stores nothing: profiling runs); a row of
sequence length 0 is padding (a CUDA graph's): nothing is computed or stored for it.

With speculative decoding (`drafts`: metadata.DraftRows) a sequence may first fold in `commit`
tokens recorded by its last verification (pending block `source`: the convolution's inputs in
`pending_inputs` [blocks, P, C], its outputs in `pending_outputs`, the gate inputs b | a in
`pending_ba` [blocks, P, 2 Hv]), and a sequence whose tokens are drafts (`target` >= 0) stores the
states as they stand before its tokens and records them in block `target` instead. The slot's
state then covers seq_lens - query length - commit tokens.

The block's output (`gated_rms_norm`): each value head's output normalised, times the weight, times
silu(z) of its gate.

The delta rule, per value head h (its key head: h // (Hv / Hk)), token by token:
    q, k = l2_normalize(q), l2_normalize(k);  q = q / sqrt(Dk)
    g = -exp(A_log[h]) * softplus(a + dt_bias[h]);  beta = sigmoid(b)
    S = exp(g) * S;  S = S + k (beta (v - k^T S))^T;  out = q^T S
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from baryon.kernels.attention.metadata import DraftRows
from baryon.kernels.selector import Kernel

L2_NORM_EPS = 1e-6  # inside the square root, as the published models' FLA kernels
CHUNK = 16  # the torch delta rule takes a prefill's tokens this many at a time (the chunked form)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_NORM_EPS)


def delta_rule_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [..., Hv] -> (g, the log of the state's decay; beta, the write strength), float32."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def _spans(query_start: torch.Tensor, seq_lens: torch.Tensor, state_slots: torch.Tensor,
           drafts: DraftRows | None = None):
    """(start, end, slot, has_initial_state, commit, source, target) of every sequence that is not
    padding (commit 0, source and target -1 without drafts)."""
    starts, lens, slots = query_start.tolist(), seq_lens.tolist(), state_slots.tolist()
    count = len(lens)
    commits, sources, targets = ([0] * count, [-1] * count, [-1] * count) if drafts is None else \
        (drafts.commit.tolist(), drafts.source.tolist(), drafts.target.tolist())
    for i, (seq_len, slot) in enumerate(zip(lens, slots)):
        start, end = starts[i], starts[i + 1]
        if end > start and seq_len > 0:
            yield (start, end, slot, slot >= 0 and seq_len > end - start + commits[i], commits[i], sources[i],
                   targets[i])


class TorchCausalConv1d(Kernel):
    name = "torch"
    cuda_graph_safe = False  # reads the step's layout on the host

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                query_start: torch.Tensor, seq_lens: torch.Tensor, state_slots: torch.Tensor,
                max_query_len: int, drafts: DraftRows | None = None, pending_inputs: torch.Tensor | None = None,
                pending_outputs: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, C] (rows may be strided); weight: [C, K]; bias: [C] or None; conv_states:
        [slots, K - 1, C] (updated in place); max_query_len: the most new tokens of a sequence (the
        Triton kernel's grid; this walks the host's layout); drafts, pending_*: speculative
        decoding's (the module docstring). Returns silu(causal_conv(x)) [T, C] in x's dtype."""
        width = weight.shape[1]
        out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)  # [T, C]
        for start, end, slot, has_initial, commit, source, target in _spans(query_start, seq_lens, state_slots,
                                                                            drafts):
            history = conv_states[slot] if has_initial else x.new_zeros(width - 1, x.shape[1])
            if commit:  # the last verification's accepted inputs
                history = torch.cat((history.to(x.dtype), pending_inputs[source, :commit].to(x.dtype)))
            window = torch.cat((history.to(x.dtype), x[start:end]))  # [K - 1 + commit + n, C]
            n = end - start
            y = sum(window[-n - width + 1 + j:len(window) - width + 1 + j].float() * weight[:, j].float()
                    for j in range(width))  # [n, C]
            if bias is not None:
                y = y + bias.float()
            out[start:end] = F.silu(y).to(x.dtype)
            if target >= 0:  # drafts: the state stays before them; they are recorded
                pending_inputs[target, :n] = x[start:end].to(pending_inputs.dtype)
                pending_outputs[target, :n] = out[start:end].to(pending_outputs.dtype)
                window = history
            if slot >= 0:
                conv_states[slot] = window[len(window) - width + 1:].to(conv_states.dtype)
        return out


class TorchGatedDeltaRule(Kernel):
    name = "torch"
    cuda_graph_safe = False

    @staticmethod
    def forward(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                recurrent_states: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                state_slots: torch.Tensor, num_k_heads: int, head_k_dim: int, max_query_len: int,
                drafts: DraftRows | None = None, pending_qkv: torch.Tensor | None = None,
                pending_ba: torch.Tensor | None = None) -> torch.Tensor:
        """qkv: [T, 2 Hk Dk + Hv Dv] (queries, keys, values; rows may be strided); a, b: [T, Hv];
        a_log, dt_bias: [Hv]; recurrent_states: [slots, Hv, Dk, Dv] float32 (updated in place);
        max_query_len: the most new tokens of a sequence (the Triton kernels' choice of form; this
        walks the host's layout); drafts, pending_qkv (the convolution's pending outputs),
        pending_ba: speculative decoding's (the module docstring). Returns [T, Hv, Dv] in qkv's dtype.

        Each sequence's state is updated in place in its slot (2 MB at Qwen3-Next's widths: cache-
        sized): a prefill's whole chunks of CHUNK tokens as matrix products (`_rule_chunk`), the
        other tokens one at a time (`_walk`)."""
        _, num_v_heads, _, head_v_dim = recurrent_states.shape
        rule_inputs = functools.partial(_rule_inputs, a_log=a_log, dt_bias=dt_bias, num_k_heads=num_k_heads,
                                        head_k_dim=head_k_dim, num_v_heads=num_v_heads, head_v_dim=head_v_dim)
        q, k, v, g, beta = rule_inputs(qkv, a, b)
        tokens = qkv.shape[0]
        out = torch.zeros(tokens, num_v_heads, head_v_dim, dtype=qkv.dtype, device=qkv.device)
        for start, end, slot, has_initial, commit, source, target in _spans(query_start, seq_lens, state_slots,
                                                                            drafts):
            if slot >= 0:
                state = recurrent_states[slot]  # [Hv, Dk, Dv], a view: updated in place
                if not has_initial:
                    state.zero_()
            else:
                state = torch.zeros(num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=qkv.device)
            if commit:  # the last verification's accepted tokens: the state only
                rows = pending_ba[source, :commit]  # [commit, 2 Hv]: b | a
                _walk(state, *rule_inputs(pending_qkv[source, :commit], rows[:, num_v_heads:], rows[:, :num_v_heads]))
            if target >= 0:  # drafts: the slot keeps the state before them; they are recorded
                state = state.clone()
                pending_ba[target, :end - start] = torch.cat((b[start:end], a[start:end]), dim=1).to(pending_ba.dtype)
            t = start
            while t + CHUNK <= end:  # a prefill's whole chunks as matrix products
                rows = slice(t, t + CHUNK)
                out[rows] = _rule_chunk(state, q[rows], k[rows], v[rows], g[rows], beta[rows]).to(qkv.dtype)
                t += CHUNK
            # a decode's token, a prefill's last ones
            out[t:end] = _walk(state, q[t:end], k[t:end], v[t:end], g[t:end], beta[t:end]).to(qkv.dtype)
        return out


def _rule_inputs(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                 num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int):
    """Rows of [2 Hk Dk + Hv Dv] and their a, b [n, Hv] -> the rule's q, k [n, Hv, Dk] (normalised, q
    scaled), v [n, Hv, Dv], g, beta [n, Hv], float32."""
    key_dim = num_k_heads * head_k_dim
    group = num_v_heads // num_k_heads
    tokens = qkv.shape[0]
    q = qkv[:, :key_dim].float().reshape(tokens, num_k_heads, head_k_dim).repeat_interleave(group, dim=1)
    k = qkv[:, key_dim:2 * key_dim].float().reshape(tokens, num_k_heads, head_k_dim).repeat_interleave(group, dim=1)
    v = qkv[:, 2 * key_dim:].float().reshape(tokens, num_v_heads, head_v_dim)
    g, beta = delta_rule_gates(a, b, a_log, dt_bias)
    return l2_normalize(q) * head_k_dim ** -0.5, l2_normalize(k), v, g, beta


def _walk(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
          beta: torch.Tensor) -> torch.Tensor:
    """The delta rule token by token (as _rule_chunk's arguments), rewritten so that the old state
    is read once a token: with qS, kS = q^T S, k^T S and d = exp(g),
        delta = beta (v - d kS);  out = d qS + (q . k) delta;  S = d S + k delta^T.
    Returns [n, Hv, Dv] float32."""
    out = torch.empty(q.shape[0], *state.shape[::2], dtype=torch.float32, device=state.device)
    decay, beta = g.exp()[:, :, None], beta[:, :, None]  # [n, Hv, 1]
    q_dot_k = (q * k).sum(dim=-1, keepdim=True)  # [n, Hv, 1]
    for t in range(q.shape[0]):
        q_state, k_state = torch.bmm(torch.stack((q[t], k[t]), dim=1), state).unbind(dim=1)  # [Hv, Dv] each
        delta = beta[t] * (v[t] - decay[t] * k_state)
        out[t] = decay[t] * q_state + q_dot_k[t] * delta
        state.mul_(decay[t][:, :, None]).baddbmm_(k[t][:, :, None], delta[:, None, :])
    return out


def _rule_chunk(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """The delta rule over C tokens at once (the chunked form; every head in one batch): q, k [C, Hv,
    Dk] (normalised, q scaled), v [C, Hv, Dv], g, beta [C, Hv]; state [Hv, Dk, Dv] (updated in
    place: the state after the chunk). Returns [C, Hv, Dv] float32. With G the running sum of g over
    the chunk and S the state before it:
        A[t, i] = beta_t exp(G_t - G_i) k_t . k_i  (i < t);  (I + A) W = beta exp(G) k;  (I + A) U = beta v
        delta = U - W S   (each token's write, as the token walk computes it)
        out = exp(G) q S + [i <= t] exp(G_t - G_i) (q_t . k_i) delta
        S' = exp(G_last) S + (exp(G_last - G) k)^T delta"""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [Hv, C, D]
    big_g, beta = g.t().cumsum(dim=-1), beta.t()  # [Hv, C]
    chunk = big_g.shape[-1]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    gaps = (big_g[:, :, None] - big_g[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [Hv, C, C]
    strict = (beta[:, :, None] * gaps * (k @ k.transpose(-1, -2))).tril(diagonal=-1)  # A
    unit = strict + torch.eye(chunk, device=q.device)  # I + A, unit lower-triangular
    u = torch.linalg.solve_triangular(unit, beta[:, :, None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(unit, (beta * big_g.exp())[:, :, None] * k, upper=False,
                                      unitriangular=True)
    delta = u - w @ state  # [Hv, C, Dv]
    out = big_g.exp()[:, :, None] * (q @ state) + (gaps * (q @ k.transpose(-1, -2))) @ delta
    last = big_g[:, -1:]  # [Hv, 1]
    state.mul_(last.exp()[:, :, None]).add_((k * (last - big_g).exp()[:, :, None]).transpose(-1, -2) @ delta)
    return out.transpose(0, 1)


class TorchGatedRMSNorm(Kernel):
    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x, gate: [T, H, D] (rows may be strided); weight: [D] in x's dtype -> rms_norm(x) * weight
        * silu(gate) [T, H, D], as transformers computes it: the normalised values rounded to x's
        dtype before the weight, the weighted values rounded again, the gate's product in float32."""
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return ((weight * normed).float() * F.silu(gate.float())).to(x.dtype)
