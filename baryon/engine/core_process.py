"""The engine-core process: an EngineCore driven by messages from its parent (the server, or the
offline LLM: `engine/core_processes.py`) over ZMQ.

Started by `baryon.engine.core_client` as `python -m baryon.engine.core_process INPUT OUTPUT`,
before the server (or the offline LLM) has resolved the configuration: it imports the engine
and transformers meanwhile, then reads the pickled EngineConfig from stdin (nothing there: the
parent gave up, exit). It pulls
AddRequests / AbortRequests / Shutdown from INPUT and pushes EngineReady, then one
EngineOutputs per step that changed something, to OUTPUT. It speaks token ids only; the parent
tokenizes and detokenizes.

It runs in its own session, so a terminal's Ctrl-C reaches only the server, which stops it in
order; and it exits by itself when its parent is gone, so a killed server leaves no engine.

With DP attention the replicas' loops go round together: every round each replica takes its
messages, then steps (an agreement with the others, and a forward pass whenever any replica has
work). A replica without requests of its own goes straight to the next round while another has
work, and polls its input every DP_IDLE_POLL_MS once all are idle; a Shutdown stops all replicas
at the same round.
"""

from __future__ import annotations

import os
import pickle
import sys

import zmq

from baryon.config import EngineConfig
from baryon.engine.core import EngineCore
from baryon.engine.messages import (AbortRequests, AddRequests, EngineFailed, EngineOutputs, EngineReady,
                                    EngineStats, Shutdown, client_message_decoder, encoder)
from baryon.logger import dump_stacks_on_sigusr1, get_logger

logger = get_logger(__name__)

# How long an idle engine waits for a message before checking that its parent is alive (ms).
_IDLE_POLL_MS = 200
# DP attention: how long an idle replica waits for a message before its next round with the
# others (ms): at most this much is added to the first step after all replicas were idle.
DP_IDLE_POLL_MS = 5
# How long an unsent failure report may hold the process at exit (ms).
_LINGER_MS = 2000


def engine_stats(core: EngineCore) -> EngineStats:
    scheduler, blocks, spec = core.scheduler, core.block_manager, core.spec_stats
    return EngineStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                       num_kv_blocks_used=blocks.num_used_blocks, num_kv_blocks=blocks.num_blocks,
                       num_steps=core.num_steps,
                       spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                       spec_num_accepted_tokens=spec.num_accepted_tokens,
                       spec_accepted_per_position=list(spec.accepted_per_position))


class EngineCoreLoop:
    """Receive messages, step the core while it has work, send what each step produced."""

    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.rejected: dict[str, str] = {}

    def run(self) -> None:
        data_parallel = self.core.data_parallel
        idle_ms = DP_IDLE_POLL_MS if data_parallel else _IDLE_POLL_MS
        while True:
            # An idle replica waits for messages only while every replica is idle: a round it
            # joins late holds up the replicas that have work.
            busy = self.core.has_unfinished_requests() or (data_parallel and self.core.replicas_busy)
            changed = self._receive(timeout_ms=0 if busy else idle_ms)
            if os.getppid() != self.parent_pid:
                logger.warning("the process that started this engine (a server or an LLM) is gone; "
                               "the engine process exits")
                return
            if data_parallel:  # a round with the other replicas, work or not
                step_outputs = self.core.step(stopping=changed is None)
                if self.core.stopped:
                    return
            elif changed is None:
                return
            else:
                step_outputs = self.core.step() if self.core.has_unfinished_requests() else []
            if step_outputs or changed:
                self.outputs.send(encoder.encode(EngineOutputs(step_outputs, engine_stats(self.core), self.rejected)))
                self.rejected = {}

    def _receive(self, timeout_ms: int) -> bool | None:
        """Apply every waiting message. True if one changed the engine's state, None on Shutdown."""
        changed = False
        if not self.inputs.poll(timeout_ms):
            return changed
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed
            message = client_message_decoder.decode(frame.buffer)
            if isinstance(message, Shutdown):
                return None
            if isinstance(message, AddRequests):
                for request in message.requests:
                    self._add(request)
            elif isinstance(message, AbortRequests):
                self.core.abort_requests(message.request_ids)
            changed = True

    def _add(self, request) -> None:
        try:
            self.core.add_request(request.request_id, request.prompt_token_ids, request.sampling_params,
                                  request.eos_token_ids, request.multimodal)
        except ValueError as e:
            self.rejected[request.request_id] = str(e)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> int:
    parent_pid = os.getppid()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    failure, core = None, None
    try:
        try:
            core = EngineCore(config)
        except Exception as e:  # report any failure to start, then exit
            logger.exception("the engine failed to start")
            failure = f"the engine failed to start: {type(e).__name__}: {e}"
            return 1
        outputs.send(encoder.encode(EngineReady(engine_stats(core))))
        try:
            EngineCoreLoop(core, inputs, outputs, parent_pid).run()
        except Exception as e:  # a failed step ends the engine: tell the server why
            logger.exception("the engine failed")
            failure = f"the engine failed: {type(e).__name__}: {e}"
            return 1
        return 0
    finally:
        if failure is not None:
            outputs.send(encoder.encode(EngineFailed(failure)))
        if core is not None:
            core.shutdown()  # stop the tensor-parallel workers
        inputs.close(linger=0)
        outputs.close(linger=_LINGER_MS if failure is not None else 0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m baryon.engine.core_process INPUT_ADDRESS OUTPUT_ADDRESS "
              "(pickled EngineConfig on stdin)", file=sys.stderr)
        return 2
    # The configuration holds a transformers config, whose unpickling imports transformers' model
    # machinery (seconds on some hosts): import it while the parent is still resolving.
    import transformers.configuration_utils  # noqa: F401
    import transformers.modeling_rope_utils  # noqa: F401

    dump_stacks_on_sigusr1()
    pickled = sys.stdin.buffer.read()  # waits while the parent resolves the configuration
    if not pickled:
        return 0  # the server gave up before configuring the engine
    return run_engine_core(pickle.loads(pickled), argv[0], argv[1])


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the sockets are closed: skip the slow interpreter teardown (torch), exit now
