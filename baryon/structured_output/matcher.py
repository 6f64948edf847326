"""Per request: the grammar's matcher, advanced over the output tokens, and the batch's bitmask.

A matcher has accepted the request's first `num_accepted` output tokens. Before a step samples,
it catches up on the tokens sampled since (the one still pending on the device included: the
runner reads it from the previous step, which has finished by the time this step's forward
pass is queued), then fills its row of the bitmask: bit t of the row set = token t may follow.
A grammar that starts after the model's reasoning (`reasoning_end`: the token ids that end it)
passes the output's tokens up to and including them without its matcher, every bit of its row
set meanwhile.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from baryon.logger import get_logger

if TYPE_CHECKING:
    import xgrammar

logger = get_logger(__name__)


class RequestGrammar:
    def __init__(self, compiled: Future, stop_token_ids: Sequence[int],
                 reasoning_end: Sequence[int] | None = None) -> None:
        self._compiled = compiled
        self._reasoning_end = list(reasoning_end or ())
        self.started = not self._reasoning_end  # the output has passed reasoning_end: the grammar applies
        self._stop_token_ids = list(stop_token_ids)
        self._stop_token_set = frozenset(self._stop_token_ids)
        self.matcher: xgrammar.GrammarMatcher | None = None
        self.num_accepted = 0  # output tokens passed (before the start) or accepted by the matcher
        self._recent: list[int] = []  # before the start: the last tokens passed, to find reasoning_end
        self.rejected_token: int | None = None  # a token the grammar refused (the mask was not applied)
        self._ended = False  # the matcher accepted a stop token (read once per accepted token)

    def ready(self) -> bool:
        """Compiled without error (a failed compilation is never ready: the engine aborts the
        request on its next step, see `error`)."""
        return self._compiled.done() and self._compiled.exception() is None

    @property
    def error(self) -> str | None:
        if not self._compiled.done() or self._compiled.exception() is None:
            return None
        return str(self._compiled.exception())

    def get_matcher(self) -> xgrammar.GrammarMatcher:
        """The matcher (made on first use; the compilation must have finished)."""
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self._compiled.result(), override_stop_tokens=self._stop_token_ids)
        return self.matcher

    def advance(self, output_token_ids: Sequence[int], pending_token: int | None = None) -> None:
        """Accept the tokens not accepted yet: the request's output (its whole list), then the
        token still pending on the device, if given."""
        while not self.is_terminated():
            if self.num_accepted < len(output_token_ids):
                token = output_token_ids[self.num_accepted]
            elif self.num_accepted == len(output_token_ids) and pending_token is not None:
                token = pending_token
            else:
                return
            if not self.started:
                self.pass_token(token)
                continue
            self.note_accept(token, self.get_matcher().accept_token(token))

    def pass_token(self, token: int) -> None:
        """Before the start: the output's next token goes by, unconstrained (the start follows
        the token that completes reasoning_end)."""
        self.num_accepted += 1
        self._recent = (self._recent + [token])[-len(self._reasoning_end):]
        self.started = self._recent == self._reasoning_end

    def tokens_behind(self, output_token_ids: Sequence[int], pending_token: int | None) -> int:
        """How many tokens `advance` would accept (0 once terminated; a token after the end is one
        computed in vain while steps overlap, and the engine drops it)."""
        if self.is_terminated():
            return 0
        return len(output_token_ids) + (pending_token is not None) - self.num_accepted

    def note_accept(self, token: int, accepted: bool) -> None:
        """Record what the matcher answered to accept_token(token)."""
        if not accepted:
            self.rejected_token = token
            logger.warning("token %d does not follow the request's grammar (sampled where it allowed none): "
                           "the request stops before it", token)
            return
        self.num_accepted += 1
        # A matcher ends only on accepting a stop token (it is made without
        # terminate_without_stop_token), so the others need no call into xgrammar.
        self._ended = token in self._stop_token_set and self.matcher.is_terminated()

    def refused(self, index: int) -> bool:
        """The matcher refused the output's token at `index` (one sampled where the grammar
        allowed no token at all: a dead end of a grammar that matches no text past it)."""
        return self.rejected_token is not None and self.num_accepted == index

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted, or a token broke it."""
        return self._ended or self.rejected_token is not None


def advance_all(grammars: list[RequestGrammar], outputs: list[Sequence[int]], pending: list[int | None]) -> None:
    """grammars[i].advance(outputs[i], pending[i]) for every i; those one token behind (each
    decode step) accept it in one call into xgrammar."""
    one_behind, matchers, tokens = [], [], []
    for grammar, output, pending_token in zip(grammars, outputs, pending):
        behind = grammar.tokens_behind(output, pending_token)
        if behind == 1 and grammar.started:
            one_behind.append(grammar)
            matchers.append(grammar.get_matcher())
            tokens.append(pending_token if pending_token is not None else output[grammar.num_accepted])
        elif behind > 0:  # several tokens, or tokens before the grammar's start
            grammar.advance(output, pending_token)
    if one_behind:
        accepted = batch_accept_token(matchers, tokens)
        for grammar, token, ok in zip(one_behind, tokens, accepted):
            grammar.note_accept(token, ok)


def batch_accept_token(matchers: list[xgrammar.GrammarMatcher], tokens: list[int]) -> list[bool]:
    """xgr.BatchGrammarMatcher.batch_accept_token: whether each matcher accepted its token. Its
    wrapper reads the result back one element at a time through TVM's FFI (38 us for 64 matchers
    on the 2-core VM, of a 50 us call); the FFI array's slice copies it in one call (10 us). The
    public call where xgrammar's internals differ."""
    core_accept = _core_batch_accept()
    if core_accept is None or not hasattr(matchers[0], "_handle"):
        import xgrammar as xgr

        return xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
    return [bool(ok) for ok in core_accept([m._handle for m in matchers], tokens, False)[:]]


@functools.cache
def _core_batch_accept():
    """xgrammar's core batch accept (matcher handles, tokens, debug) -> an FFI array; None where
    this xgrammar has none."""
    import xgrammar as xgr

    core = getattr(getattr(xgr, "base", None), "_core", None)
    return getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)


def fill_bitmask(grammars: list[RequestGrammar], bitmask: torch.Tensor, threaded: bool = True) -> None:
    """bitmask: int32 [len(grammars), ceil(vocab_size / 32)] on the host; row i <- what may follow
    grammar i's accepted tokens (every token where its matcher has ended: that row's token is
    dropped; and before the grammar's start). threaded: several rows at once on xgrammar's threads
    (not where the engine's own kernels run on every core: a CPU device)."""
    ended = [g.is_terminated() or not g.started for g in grammars]  # every token may follow
    live = [i for i, e in enumerate(ended) if not e]
    if len(live) < len(grammars):
        bitmask[[i for i, e in enumerate(ended) if e]] = -1  # all bits set
    if len(live) > 1 and threaded:
        batch_matcher().batch_fill_next_token_bitmask([grammars[i].get_matcher() for i in live], bitmask, live)
    else:
        for i in live:
            grammars[i].get_matcher().fill_next_token_bitmask(bitmask, i)


@functools.cache
def batch_matcher() -> xgrammar.BatchGrammarMatcher:
    """Fills many rows at once on xgrammar's threads: at most 4 (64 rows of a JSON schema over a
    151,936-token vocabulary on the 16-core H100 host: 0.47-0.63 ms on 4 threads, 0.70-0.85 ms on
    xgrammar's default of half the cores, 1.1-1.3 ms on 16)."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads=max(1, min(4, len(os.sched_getaffinity(0)) // 2)))
