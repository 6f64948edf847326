"""Drafts that read the target's hidden states: EAGLE-3 heads and MTP layers (DeepSeek's, Qwen3-Next's).

Such a draft predicts token t + 2 from the target's features at position t and the embedding of
token t + 1, at position t (vLLM's layout). The features are what the target computed this step
(EAGLE-3: `fc` over three of its layers' hidden states; MTP: its final hidden state), so the
draft runs every step, right after the target:

1. catch up: for every request the target advanced, one row per token the target computed and
   kept (a prompt chunk, or the last token plus the accepted drafts): token at t + 1, features
   at t, position t. Its cache rows stay right; the last row's logits give the first draft;
2. then one row per request and depth: the previous draft token, the draft's own output as the
   features (EAGLE-3's pre-norm state; MTP's), one position further. MTP layers are chained
   (the first one again when the checkpoint has fewer than k).

The draft's cache shares the target's block ids; its lookahead rows land in the slots the
scheduler reserved past the verified tokens. Positions the target served from the prefix cache
have no features this step: the draft keeps what another request computed there.
"""

from __future__ import annotations

import numpy as np
import torch

from baryon.config import EngineConfig
from baryon.kernels.attention.metadata import batch_layout, build_metadata
from baryon.layers.forward_context import forward_context
from baryon.request import Request
from baryon.spec_decode.draft_model import CatchUp, DraftModelProposer
from baryon.transfer import to_device


class HiddenStateProposer(DraftModelProposer):
    def __init__(self, config: EngineConfig, max_blocks_per_seq: int, target: torch.nn.Module) -> None:
        super().__init__(config, max_blocks_per_seq)
        self.method = config.speculative.method
        if self.method == "eagle3":
            if not hasattr(target.model, "aux_hidden_state_layers"):
                raise ValueError(f"EAGLE-3 heads read a Llama-family target's hidden states; "
                                 f"{type(target).__name__} does not give them (use an n-gram or draft-model "
                                 f"proposer with it)")
            num_layers = len(target.model.layers)
            target.model.aux_hidden_state_layers = self.model.aux_hidden_state_layer_ids(num_layers)
            self.model.share_embedding(target.model.embed_tokens)
        if hasattr(self.model, "share_target"):  # Qwen3-Next's MTP: the target's embedding and LM head
            self.model.share_target(target)
        self.target = target
        self.features: torch.Tensor | None = None  # [num_tokens, hidden]: this step's, per flat token
        self.rows: dict[str, tuple[int, int]] = {}  # request id -> (its first flat token, computed before)
        self.hidden: torch.Tensor | None = None  # [drafting rows, hidden]: the last draft step's output
        self.num_mtp_layers = getattr(self.model, "num_mtp_layers", 0)
        self.features_dim = getattr(self.model.config, "hidden_size")  # of target_features' rows
        self.hidden_in: torch.Tensor | None = None  # [largest graph, hidden]: the graphs' hidden-state input
        self.graph_runners: dict[int, object] = {}  # MTP layer (0 for EAGLE-3) -> its CUDA graphs

    def capture_cuda_graphs(self, graph_runner_class, sizes: list[int]) -> None:
        """Per draft layer, graphs of its forward over a static hidden-state input, its logits and
        its output hidden states (the next depth's input) for these token counts."""
        self.hidden_in = torch.zeros(max(sizes), self.features_dim, dtype=self.dtype, device=self.device)
        self.graph_runners = {}
        for layer in range(max(self.num_mtp_layers, 1)):
            def forward(input_ids: torch.Tensor, positions: torch.Tensor, layer: int = layer) -> torch.Tensor:
                return self._layer_forward(input_ids, positions, self.hidden_in[:input_ids.shape[0]], layer)

            def logits_into(hidden: torch.Tensor, out: torch.Tensor, layer: int = layer) -> None:
                out.copy_(self._logits(hidden, layer))

            runner = graph_runner_class(forward, logits_into, self.model.config.vocab_size, self.dtype, sizes,
                                        self.max_blocks_per_seq, self.device, features=lambda h: h,
                                        features_dim=self.features_dim)
            runner.capture()
            self.graph_runners[layer] = runner

    def target_features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The step's target output [num_tokens, hidden] -> what the draft reads per token."""
        if self.method == "eagle3":
            return self.model.combine_hidden_states(self.target.model.aux_hidden_states)
        return hidden_states

    def observe(self, scheduled: list[tuple[Request, int]] | None, query_start: np.ndarray,
                features: torch.Tensor) -> None:
        """Keep a step's features and where each request's tokens sit in them (scheduled None: a
        rank > 0 of tensor parallelism, which gets the rows with rank 0's ProposePlan)."""
        self.features = features
        if scheduled is not None:
            self.rows = {r.request_id: (int(query_start[i]), r.num_computed_tokens)
                         for i, (r, _) in enumerate(scheduled)}

    def propose(self, requests: list[Request], max_drafts: list[int], sampling) -> list[list[int]]:
        """Only requests the last observed step advanced can draft: their features are fresh."""
        advanced = [r.request_id in self.rows and r.num_computed_tokens > self.rows[r.request_id][1] for r in requests]
        return super().propose(requests, [m if a else 0 for m, a in zip(max_drafts, advanced)], sampling)

    def _layer_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                       layer: int) -> torch.Tensor:
        if self.num_mtp_layers:
            return self.model(input_ids, positions, hidden, layer)
        return self.model(input_ids, positions, hidden)

    def _logits(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        if self.num_mtp_layers:
            return self.model.compute_logits(hidden, layer)
        return self.model.compute_logits(hidden)

    def _layer_of(self, depth: int) -> int:
        """The draft layer of this depth (MTP layers chained, the first again past the last)."""
        return depth % self.num_mtp_layers if self.num_mtp_layers else 0

    def _graph_runner(self, depth: int):
        return self.graph_runners.get(self._layer_of(depth))

    def _padding_forward(self, token: torch.Tensor, depth: int) -> None:
        hidden = torch.zeros(1, self.features_dim, dtype=self.dtype, device=self.device)
        self._layer_forward(token, token, hidden, self._layer_of(depth))

    def _run(self, input_ids: torch.Tensor, positions: np.ndarray, hidden: torch.Tensor, tables: np.ndarray,
             computed: np.ndarray, num_new: np.ndarray, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft layer of this depth over a batch: (output hidden states [rows, hidden], and
        from a CUDA graph the logits of every row [rows, vocab], else None). Up to the largest
        captured size the rows run as one decode each (build_metadata's per_token); with DP
        attention the agreed pass of this depth says whether, and its MoE rows."""
        layout = batch_layout(tables, computed, num_new, self.block_size)
        positions_device = to_device(torch.from_numpy(positions), self.device)
        rows = len(positions)
        agreed = self._agreed(depth)
        graph_size = self._graph_size(rows, depth) if agreed is None else agreed.graph_size
        if graph_size is not None:
            runner = self._graph_runner(depth)
            self.hidden_in[:rows].copy_(hidden)
            metadata = build_metadata(layout, tables, self.device, per_token=True)
            logits = runner.run(input_ids, positions_device, metadata, size=graph_size).float()
            return runner.features[:rows], logits
        padded_tokens = None if agreed is None else agreed.padded_tokens
        with forward_context(build_metadata(layout, tables, self.device), padded_tokens):
            return self._layer_forward(input_ids, positions_device, hidden, self._layer_of(depth)), None

    def _plan_catch_up(self, all_requests: list[Request], drafting: list[int]) -> CatchUp | None:
        """Every request the target advanced (drafting or not: the draft's cache rows stay right)."""
        spans = []  # (request index, first flat token, first position, tokens kept)
        for i, request in enumerate(all_requests):
            start, computed = self.rows.get(request.request_id, (0, 0))
            kept = request.num_computed_tokens - computed
            if request.request_id in self.rows and kept > 0:
                spans.append((i, start, computed, kept))
        self.hidden = None
        features, self.features, self.rows = self.features, None, {}  # consumed once
        if not spans:
            return None
        requests = [all_requests[i] for i, _, _, _ in spans]
        flat = np.concatenate([np.arange(s, s + n) for _, s, _, n in spans])
        next_tokens = np.concatenate([r.all_token_ids[c + 1:c + n + 1] for r, (_, _, c, n) in zip(requests, spans)])
        span_of = {i: j for j, (i, _, _, _) in enumerate(spans)}  # every drafting request was advanced
        return CatchUp(requests, np.array([c for _, _, c, _ in spans], dtype=np.int64),
                       np.array([n for _, _, _, n in spans], dtype=np.int64), next_tokens.astype(np.int64),
                       np.array([span_of[i] for i in drafting], dtype=np.int64), list(drafting),
                       features[to_device(torch.from_numpy(flat), self.device)])

    def _run_catch_up(self, plan: CatchUp) -> torch.Tensor:
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(plan.computed, plan.num_new)])
        hidden, logits = self._run(to_device(torch.from_numpy(plan.input_ids), self.device), positions, plan.features,
                                   self._block_tables(plan.requests), plan.computed, plan.num_new, 0)
        index = to_device(torch.from_numpy((np.cumsum(plan.num_new) - 1)[plan.last_rows]), self.device)
        self.hidden = hidden[index]
        return self._logits(self.hidden, 0) if logits is None else logits[index]

    def _narrow(self, index: torch.Tensor) -> None:
        self.hidden = self.hidden[index]

    def _decode(self, requests: list[Request], tokens: torch.Tensor, step: int) -> torch.Tensor:
        """One row per request: draft `step`'s input is the previous draft at the position after."""
        positions = np.fromiter((r.num_computed_tokens - 1 + step for r in requests), dtype=np.int64,
                                count=len(requests))
        self.hidden, logits = self._run(tokens, positions, self.hidden, self._block_tables(requests), positions,
                                        np.ones(len(requests), dtype=np.int64), step)
        return self._logits(self.hidden, self._layer_of(step)) if logits is None else logits

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.rows.pop(request_id, None)
