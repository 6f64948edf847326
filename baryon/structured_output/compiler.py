"""Grammar compilation off the engine's step loop: one compilation per distinct spec.

Compiling a grammar against the vocabulary (every token's bytes through the grammar's automaton)
takes milliseconds to a second. It runs in a small thread pool; a request whose compilation has
not finished is passed over by the scheduler (only it waits), and later requests with the same
spec share the finished result. The tokenizer's vocabulary is read on the first compilation,
in the pool too, so an engine that never sees a constrained request never pays for it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from baryon.sampling_params import StructuredOutputsParams
from baryon.structured_output.grammar import compile_spec

if TYPE_CHECKING:
    import xgrammar

CONCURRENT_COMPILATIONS = 2
# xgrammar's threads for one compilation: half the cores, 2 to 8 (a 20-field JSON schema over a
# 151,936-token vocabulary on the 16-core H100 host: 104 ms on 2 threads, 55 on 4, 30.5 on 8)
COMPILER_THREADS = max(2, min(8, len(os.sched_getaffinity(0)) // 2))
MAX_CACHED_SPECS = 512  # finished compilations kept (least recently used dropped first)
# xgrammar's own cache of compiled grammars stays off: unbounded by default, it kept every distinct
# spec a server ever saw (~45-60 KB each for small schemas over 32k-152k-token vocabularies on the
# VM, 2026-11-27); MAX_CACHED_SPECS above bounds what this engine keeps.


class GrammarCompiler:
    def __init__(self, tokenizer_path: str, trust_remote_code: bool, vocab_size: int) -> None:
        """vocab_size: the model's (logits') width, which may exceed the tokenizer's."""
        self._tokenizer_path, self._trust_remote_code = tokenizer_path, trust_remote_code
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(CONCURRENT_COMPILATIONS, thread_name_prefix="grammar")
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._futures: OrderedDict[tuple, Future] = OrderedDict()

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the spec's xgrammar.CompiledGrammar (shared by equal specs)."""
        future = self._futures.get(spec.key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._futures.move_to_end(spec.key)
            return future
        future = self._pool.submit(self._compile, spec)
        self._futures[spec.key] = future
        while len(self._futures) > MAX_CACHED_SPECS:
            self._futures.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        return compile_spec(self._xgrammar_compiler(), spec)

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                from baryon.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(self._tokenizer_path, self._trust_remote_code)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS, cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
