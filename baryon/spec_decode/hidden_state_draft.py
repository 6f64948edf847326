"""Drafts that read the target's hidden states: EAGLE-3 heads and DeepSeek's MTP layers.

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
from baryon.spec_decode.draft_model import DraftModelProposer
from baryon.transfer import to_device


class HiddenStateProposer(DraftModelProposer):
    decode_graphs = False  # its forward also reads hidden states: it runs eagerly
    def __init__(self, config: EngineConfig, max_blocks_per_seq: int, target: torch.nn.Module) -> None:
        super().__init__(config, max_blocks_per_seq)
        self.method = config.speculative.method
        if self.method == "eagle3":
            num_layers = len(target.model.layers)
            target.model.aux_hidden_state_layers = self.model.aux_hidden_state_layer_ids(num_layers)
            self.model.share_embedding(target.model.embed_tokens)
        self.target = target
        self.features: torch.Tensor | None = None  # [num_tokens, hidden]: this step's, per flat token
        self.rows: dict[str, tuple[int, int]] = {}  # request id -> (its first flat token, computed before)
        self.hidden: torch.Tensor | None = None  # [drafting rows, hidden]: the last draft step's output
        self.num_mtp_layers = len(getattr(self.model, "only_layers", ()))
        self.features_dim = getattr(self.model.config, "hidden_size")  # of target_features' rows

    def target_features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The step's target output [num_tokens, hidden] -> what the draft reads per token."""
        if self.method == "eagle3":
            return self.model.combine_hidden_states(self.target.model.aux_hidden_states)
        return hidden_states

    def observe(self, scheduled: list[tuple[Request, int]], query_start: np.ndarray, features: torch.Tensor) -> None:
        """Keep a step's features and where each request's tokens sit in them."""
        self.features = features
        self.rows = {r.request_id: (int(query_start[i]), r.num_computed_tokens) for i, (r, _) in enumerate(scheduled)}

    def propose(self, requests: list[Request], max_drafts: list[int], sampling) -> list[list[int]]:
        """Only requests the last observed step advanced can draft: their features are fresh."""
        advanced = [r.request_id in self.rows and r.num_computed_tokens > self.rows[r.request_id][1] for r in requests]
        return super().propose(requests, [m if a else 0 for m, a in zip(max_drafts, advanced)], sampling)

    def _run(self, input_ids: torch.Tensor, positions: np.ndarray, hidden: torch.Tensor, tables: np.ndarray,
             computed: np.ndarray, num_new: np.ndarray, depth: int) -> torch.Tensor:
        layout = batch_layout(tables, computed, num_new, self.block_size)
        metadata = build_metadata(layout, tables, self.device)
        positions_device = to_device(torch.from_numpy(positions), self.device)
        with forward_context(metadata):
            if self.num_mtp_layers:
                return self.model(input_ids, positions_device, hidden, depth % self.num_mtp_layers)
            return self.model(input_ids, positions_device, hidden)

    def _logits(self, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        if self.num_mtp_layers:
            return self.model.compute_logits(hidden, depth % self.num_mtp_layers)
        return self.model.compute_logits(hidden)

    def _catch_up(self, all_requests: list[Request], drafting: list[int]) -> torch.Tensor | None:
        spans = []  # (request index, first flat token, first position, tokens kept)
        for i, request in enumerate(all_requests):
            start, computed = self.rows.get(request.request_id, (0, 0))
            kept = request.num_computed_tokens - computed
            if request.request_id in self.rows and kept > 0:
                spans.append((i, start, computed, kept))
        self.hidden = None
        if not spans:
            return None
        requests = [all_requests[i] for i, _, _, _ in spans]
        computed = np.array([c for _, _, c, _ in spans], dtype=np.int64)
        num_new = np.array([n for _, _, _, n in spans], dtype=np.int64)
        flat = np.concatenate([np.arange(s, s + n) for _, s, _, n in spans])
        positions = np.concatenate([np.arange(c, c + n) for _, _, c, n in spans])
        next_tokens = np.concatenate([r.all_token_ids[c + 1:c + n + 1] for r, (_, _, c, n) in zip(requests, spans)])
        hidden = self._run(to_device(torch.from_numpy(next_tokens.astype(np.int64)), self.device), positions,
                           self.features[to_device(torch.from_numpy(flat), self.device)],
                           self._block_tables(requests), computed, num_new, 0)
        last = np.cumsum(num_new) - 1
        drafting_row = {i: j for j, (i, _, _, _) in enumerate(spans)}
        rows = [last[drafting_row[i]] for i in drafting]  # every drafting request was advanced
        if not rows:
            return None
        self.hidden = hidden[to_device(torch.tensor(rows), self.device)]
        return self._logits(self.hidden, 0)

    def _narrow(self, index: torch.Tensor) -> None:
        self.hidden = self.hidden[index]

    def _decode(self, requests: list[Request], tokens: torch.Tensor, step: int) -> torch.Tensor:
        """One row per request: draft `step`'s input is the previous draft at the position after."""
        positions = np.fromiter((r.num_computed_tokens - 1 + step for r in requests), dtype=np.int64,
                                count=len(requests))
        self.hidden = self._run(tokens, positions, self.hidden, self._block_tables(requests), positions,
                                np.ones(len(requests), dtype=np.int64), step)
        return self._logits(self.hidden, step)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.rows.pop(request_id, None)
