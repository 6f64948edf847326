"""Vocabulary-parallel input embedding and the LM head (logits only for the tokens sampled)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baryon.distributed.parallel_state import tp_all_gather, tp_all_reduce, tp_rank, tp_world_size
from baryon.layers.linear import copy_checked
from baryon.quantization.base import DENSE, LinearMethod


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary rows (padded to equal size), stored as
    `self.method` says (dense floats unless a quantization scheme swaps it)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = tp_world_size()
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = tp_rank() * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        # The last rank's rows past the vocabulary stay zero (their logits are cut off).
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.expected_shards = frozenset([None])
        self.method: LinearMethod = DENSE

    def use_method(self, method: LinearMethod, shared_weight: nn.Parameter | None = None) -> None:
        """Store the rows as `method` does (before the weights load); a tied LM head passes the
        embedding's already converted parameter as `shared_weight`."""
        if shared_weight is not None:
            del self.weight
            self.weight = shared_weight
        else:
            method.create_weights(self)
        self.method = method

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected "
                             f"({self.vocab_size}, {param.shape[1]})")
        rows = self.vocab_end - self.vocab_start
        copy_checked(param.data[:rows], loaded[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> [num_tokens, hidden]."""
        if self.method is not DENSE:  # one rank (create_weights refuses more)
            return self.method.dequantize_rows(self.weight.index_select(0, input_ids))
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        embedded = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(embedded)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits. Tied models share the embedding's weight."""

    ARGMAX_MAX_VOCAB = 1 << 24  # `argmax` sends an id as three base-256 digits

    def logits_into(self, hidden_states: torch.Tensor, out: torch.Tensor) -> None:
        """The dense LM head into a preallocated buffer (CUDA graphs): hidden_states [n, hidden]
        -> out [n, vocab_size] in the model dtype (every rank's vocabulary slice, gathered)."""
        if self.tp_size == 1:
            torch.mm(hidden_states, self.weight.t(), out=out)
            return
        out.copy_(self._gathered(torch.mm(hidden_states, self.weight.t())))

    def local_logits_into(self, hidden_states: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's vocabulary slice of the logits into a preallocated buffer (the target's decode
        graphs): hidden_states [n, hidden] -> out [n, rows_per_rank] in the model dtype (the last
        rank's columns past the vocabulary are padding). `gather_logits` or `argmax` takes it on."""
        torch.mm(hidden_states, self.weight.t(), out=out)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `local_logits_into` slice of n rows -> [n, vocab_size] float32."""
        return self._gathered(local).float()

    def _gathered(self, local: torch.Tensor) -> torch.Tensor:
        """[n, rows_per_rank] slices of every rank -> [n, vocab_size] (padding cut), their dtype."""
        return local if self.tp_size == 1 else tp_all_gather(local, dim=-1)[:, : self.vocab_size]

    def argmax(self, local: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row, the same on every rank: `local_logits_into`'s slice [n,
        rows_per_rank] -> [n] int64, the first id of the row's largest logit, as an argmax over
        `gather_logits` picks it. Under tensor parallelism each rank takes its slice's best and the
        ranks exchange [n, 4] rows (the logit and the id in three base-256 digits, exact in the
        model's float dtype: vocabularies below ARGMAX_MAX_VOCAB) instead of n x vocab logits; the
        lowest rank wins a tie (its ids are lower)."""
        local = local[:, : self.vocab_end - self.vocab_start]  # [n, ids of this rank]
        if self.tp_size == 1:
            return local.argmax(dim=-1)
        value, best = local.max(dim=-1, keepdim=True)  # [n, 1] each: the first largest of the slice
        places = self._digit_places(best.device)
        digits = ((best + self.vocab_start) // places % 256).to(local.dtype)  # [n, 3]
        # Through the process group's all-gather. Session 32 sent these rows through the fused
        # all-reduce's exchange kernel, and TP=2 engines on two H200s hung in their first steps:
        # at 4 columns every warp of the kernel held the whole row and ended its wait on its own,
        # so a slower warp could read the sentinel a faster one had put back (fixed since in
        # `_receive`, with the slot claim's race; BENCHMARKS.md, 2026-11-27, session 33). The
        # kernel returns here once the fix has run on GPUs.
        every = tp_all_gather(torch.cat((value, digits), dim=1), dim=0).view(self.tp_size, -1, 4)  # [tp, n, 4]
        winner = every[:, :, 0].argmax(dim=0)  # [n]: the first rank holding the row's largest logit
        chosen = every.gather(0, winner.view(1, -1, 1).expand(1, -1, 4))[0, :, 1:]  # [n, 3]
        return (chosen.long() * places).sum(dim=1)

    def local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [n, hidden] -> this rank's vocabulary slice of the logits [n, rows_per_rank]
        (as local_logits_into, through the weight's method: eager steps)."""
        return self.method.apply(self, hidden_states, None)

    def _digit_places(self, device: torch.device) -> torch.Tensor:
        """[1, 256, 65536] on `device`, made once: the places of an id's three base-256 digits."""
        places = self.__dict__.get("_places")
        if places is None or places.device != device:
            places = self._places = torch.tensor([1, 256, 65536], device=device)
        return places

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_sampled, hidden] (only the rows that are sampled) ->
        [num_sampled, vocab_size] float32 logits."""
        return self.gather_logits(self.local_logits(hidden_states))

