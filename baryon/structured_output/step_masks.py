"""A step's structured-output masks, from the requests' grammars to the logits.

Before a step samples, each constrained request's grammar catches up on the tokens sampled since
(the one still pending on the device read from the previous step) and fills its row of a host
bitmask; the rows go to the device, where one kernel sets every disallowed logit to -inf. Filling
is the costly part (64 rows of a JSON schema over a 151,936-token vocabulary: 0.5-1 ms on the
H100 host) and xgrammar releases the GIL while it fills, so `begin` can run it on a worker thread
and return: the runner then defers the step's sampling until the engine has processed the
previous step's outputs and scheduled the next one, and the fill runs meanwhile. `apply` waits for
the fill and masks the logits. One mask is in flight at a time (the runner applies a step's mask
before it begins the next one's), so the matchers are never touched by two threads at once: the
engine's own `RequestGrammar.advance` calls find nothing left to accept while a fill runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from baryon.kernels.selector import select
from baryon.request import Request
from baryon.structured_output.bitmask_staging import BitmaskStaging
from baryon.structured_output.matcher import advance_all, fill_bitmask


@dataclass
class PendingMask:
    """The bitmask rows of one step, being filled: `logit_rows[i]` is the logits row that host
    bitmask row i masks."""

    logit_rows: list[int]
    filled: Future | None  # None: filled already


class StepMasks:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.kernel = None  # token_bitmask, selected for the first constrained request
        self.staging: BitmaskStaging | None = None  # its host and device buffers, made with it
        self._filler: ThreadPoolExecutor | None = None

    def begin(self, requests: Sequence[Request], rows: Sequence[int],
              pending_tokens: Callable[[list[Request]], list[int | None]], in_background: bool) -> PendingMask | None:
        """The mask of requests[i] for logits row rows[i] (None when no request is constrained):
        the grammars accept the tokens not accepted yet (`pending_tokens(some_requests)`: for each,
        the token the previous step sampled for it that its output does not hold yet, or None),
        then the host rows are filled, on the worker thread if in_background."""
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not constrained:
            return None
        chosen = [requests[i] for i in constrained]
        grammars = [r.grammar for r in chosen]
        advance_all(grammars, [r.output_token_ids for r in chosen], pending_tokens(chosen))
        for grammar in grammars:  # made here, not on the worker thread
            if not grammar.is_terminated():
                grammar.get_matcher()
        if self.kernel is None:
            self.kernel = select("token_bitmask", self.device)
            self.staging = BitmaskStaging(self.vocab_size, self.device)
        host = self.staging.host_rows(len(constrained))
        # xgrammar's own threads fill many rows at once, except where the engine's kernels run on
        # every core (a CPU device)
        threaded = self.device.type != "cpu"
        logit_rows = [rows[i] for i in constrained]
        if not in_background:
            fill_bitmask(grammars, host, threaded=threaded)
            return PendingMask(logit_rows, None)
        if self._filler is None:
            self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baryon-bitmask")
        return PendingMask(logit_rows, self._filler.submit(_fill, grammars, host, threaded))

    def apply(self, mask: PendingMask, logits: torch.Tensor) -> None:
        """-inf on the logits of the tokens the mask's grammars do not allow next (waits for
        its fill; a fill's error is raised here)."""
        if mask.filled is not None:
            mask.filled.result()
        self.kernel.apply(logits, self.staging.upload(len(mask.logit_rows)),
                          self.staging.logits_rows(mask.logit_rows))

    def shutdown(self) -> None:
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None


def _fill(grammars, host: torch.Tensor, threaded: bool) -> None:
    with torch.inference_mode():  # the buffers are inference tensors; the mode is per thread
        fill_bitmask(grammars, host, threaded=threaded)
