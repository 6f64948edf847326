"""Vocabulary-parallel input embedding and the LM head (logits only for the tokens sampled)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baryon.distributed.parallel_state import tp_all_gather, tp_all_reduce, tp_rank, tp_world_size
from baryon.kernels.selector import Kernel, select
from baryon.kernels.soft_cap import soft_cap
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


class VocabLogits:
    """What an LM head does with its rank's vocabulary slice of the logits (`local_logits`):
    gather every rank's slices, or find the greedy token without gathering them. The head sets
    vocab_size, tp_size, rows_per_rank, vocab_start and vocab_end.

    The model may set what becomes of the gathered logits, in their dtype as transformers computes
    it: final_logit_multiplier (Cohere's logit_scale) multiplies them, final_logit_divisor
    (Granite's logits_scaling) divides them, then final_logit_softcap
    (Gemma 2's final_logit_softcapping) caps them to cap * tanh(logits / cap). The greedy argmax
    reads them so transformed too: in 16 bits these map neighbouring logits to one value, and
    the tie then goes to the lowest id, as transformers' argmax gives it."""

    final_logit_multiplier: float | None = None
    final_logit_divisor: float | None = None
    final_logit_softcap: float | None = None
    vocab_size: int
    tp_size: int
    rows_per_rank: int
    vocab_start: int
    vocab_end: int

    def local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `local_logits_into` slice of n rows -> [n, vocab_size] float32."""
        return self.finished_logits(self._gathered(local)).float()

    def finished_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [n, columns] multiplied, divided and soft-capped as the model asks (see above); unchanged
        where it asks for neither."""
        if self.final_logit_multiplier is not None:
            logits = logits * self.final_logit_multiplier
        if self.final_logit_divisor is not None:
            logits = logits / self.final_logit_divisor
        return soft_cap(logits, self.final_logit_softcap)

    def _gathered(self, local: torch.Tensor) -> torch.Tensor:
        """[n, rows_per_rank] slices of every rank -> [n, vocab_size] (padding cut), their dtype."""
        return local if self.tp_size == 1 else tp_all_gather(local, dim=-1)[:, : self.vocab_size]

    def argmax(self, local: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row, the same on every rank: `local_logits_into`'s slice [n,
        rows_per_rank] -> [n] int64, the first id of the row's largest logit, as an argmax over
        `gather_logits` picks it. Under tensor parallelism the ranks exchange their slices'
        candidates (`vocab_argmax`: a few [4]-rows per row, the logit and its id) instead of n x
        vocab logits; the lowest id wins a tie."""
        kernel = self.__dict__.get("_argmax_kernel") or self._select_argmax(local.device)
        local = self.finished_logits(local)  # (elementwise: the same on a rank's slice)
        if self.tp_size == 1:
            return kernel.argmax(local, self.vocab_size)
        candidates = kernel.candidates(local, self.vocab_end - self.vocab_start, self.vocab_start)  # [n, C, 4]
        every = tp_all_gather(candidates, dim=0)  # [tp * n, C, 4], rank order
        return kernel.pick(every.view(self.tp_size, -1, *candidates.shape[1:]))

    def _select_argmax(self, device: torch.device) -> type[Kernel]:
        self._argmax_kernel = select("vocab_argmax", device)
        return self._argmax_kernel

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_sampled, hidden] (only the rows that are sampled) ->
        [num_sampled, vocab_size] float32 logits."""
        return self.gather_logits(self.local_logits(hidden_states))


class ParallelLMHead(VocabLogits, VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits. Tied models share the embedding's weight."""

    def logits_into(self, hidden_states: torch.Tensor, out: torch.Tensor) -> None:
        """The dense LM head into a preallocated buffer (CUDA graphs): hidden_states [n, hidden]
        -> out [n, vocab_size] in the model dtype (every rank's vocabulary slice, gathered)."""
        if self.tp_size == 1:
            torch.mm(hidden_states, self.weight.t(), out=out)
        else:
            out.copy_(self._gathered(torch.mm(hidden_states, self.weight.t())))
        if (self.final_logit_multiplier, self.final_logit_divisor, self.final_logit_softcap) != (None, None, None):
            out.copy_(self.finished_logits(out))

    def local_logits_into(self, hidden_states: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's vocabulary slice of the logits into a preallocated buffer (the target's decode
        graphs): hidden_states [n, hidden] -> out [n, rows_per_rank] in the model dtype (the last
        rank's columns past the vocabulary are padding). `gather_logits` or `argmax` takes it on."""
        torch.mm(hidden_states, self.weight.t(), out=out)

    def local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [n, hidden] -> this rank's vocabulary slice of the logits [n, rows_per_rank]
        (as local_logits_into, through the weight's method: eager steps)."""
        return self.method.apply(self, hidden_states, None)
