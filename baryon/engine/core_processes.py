"""The offline API's engine cores in processes of their own, behind the EngineCore interface
that LLMEngine drives: one engine core (the default on a GPU: `EngineConfig.engine_process`), or
`data_parallel_size` replicas.

Each is an engine-core process (`baryon.engine.core_process`, the server's too), on its own GPUs
when there are replicas (`EngineConfig.replicas`), with its own scheduler, KV cache and, with
tensor parallelism, its own workers (with DP attention the replicas also step together and share
a MoE model's experts: `engine/core_process.py`). It steps while it has work, whatever this
process does meanwhile, so the frontend's tokenizing, detokenizing and output building overlap
its steps instead of adding to them. A new request goes to the replica with the least work
outstanding, in tokens (`engine/replica_load.py`); `step()` waits until some replica has produced
outputs and returns everything that has arrived. A replica that fails or exits fails the engine
with its reason.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq

from baryon.config import EngineConfig
from baryon.engine.core import EngineCoreOutput, SpecDecodeStats, check_prompt
from baryon.engine.core_client import EngineProcess
from baryon.engine.messages import (AbortRequests, AddRequests, EngineCoreRequest, EngineFailed, EngineOutputs,
                                    EngineReady, EngineStats, Shutdown, total_stats)
from baryon.engine.replica_load import ReplicaLoad, request_tokens
from baryon.multimodal.inputs import MultiModalInputs
from baryon.sampling_params import SamplingParams

_POLL_MS = 100  # how often a wait for outputs checks that the replicas are alive
_PEER_EXIT_WAIT_S = 1.0  # a failed replica's report: how long to look for a peer that died first


class ReplicaFailedError(RuntimeError):
    """An engine replica failed or exited; the engine cannot continue."""


class EngineCoreProcesses:
    def __init__(self, config: EngineConfig, started: Sequence[EngineProcess] = ()) -> None:
        """Configure the engine processes (those `started` already, as `planned_engine_processes`
        counts them, or started here): they load the model meanwhile, until `wait_ready`."""
        self.config = config
        wanted = config.parallel.data_parallel_size
        self.replicas = list(started) + [EngineProcess(async_outputs=False) for _ in range(wanted - len(started))]
        self.load = ReplicaLoad(len(self.replicas))  # the unfinished core requests and their replicas
        self.num_kv_blocks = 0  # the replicas' KV-cache blocks, added up
        self.stats = [EngineStats() for _ in self.replicas]  # each replica's, as of its last message
        # Requests added since the last step, per replica: sent together at the next step or abort,
        # so that a batch given at once (LLM.generate) reaches an engine at once, as one message.
        self._outbox: dict[int, list[EngineCoreRequest]] = {}
        self._poller = zmq.Poller()
        try:
            for replica, replica_config in zip(self.replicas, config.replicas()):
                replica.configure(replica_config)
                self._poller.register(replica.output_socket, zmq.POLLIN)
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """Wait until every engine process has loaded the model; ReplicaFailedError if one failed."""
        try:
            for index, replica in enumerate(self.replicas):
                self._wait_ready(index, replica)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, index: int, replica: EngineProcess) -> None:
        while not replica.output_socket.poll(_POLL_MS):
            if replica.exit_code() is not None:
                raise ReplicaFailedError(f"engine replica {index} exited while starting (exit code "
                                         f"{replica.exit_code()}; its log above says why)")
        message = replica.receive_now()
        if isinstance(message, EngineFailed):
            raise ReplicaFailedError(f"engine replica {index}: {message.message}")
        if not isinstance(message, EngineReady):
            raise ReplicaFailedError(f"unexpected first message from engine replica {index}: {type(message).__name__}")
        self.num_kv_blocks += message.stats.num_kv_blocks
        self.stats[index] = message.stats

    # -- the EngineCore interface -------------------------------------------------------------

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        check_prompt(self.config, prompt_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: frozenset[int], multimodal: MultiModalInputs | None = None) -> None:
        if request_id in self.load:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids)
        index = self.load.assign(request_id, request_tokens(len(prompt_token_ids), params,
                                                            self.config.model.max_model_len))
        self._outbox.setdefault(index, []).append(
            EngineCoreRequest(request_id, list(prompt_token_ids), params, eos_token_ids, multimodal))

    def _send_added(self) -> None:
        for index, requests in self._outbox.items():
            self.replicas[index].send(AddRequests(requests))
        self._outbox.clear()

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send_added()  # an abort follows the request it aborts
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self.load.release(request_id)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            if self.replicas[index].exit_code() is None:  # a replica that died has nothing to abort
                self.replicas[index].send(AbortRequests(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.load)

    def step(self) -> list[EngineCoreOutput]:
        """Every output the replicas have sent, waiting for at least one message."""
        if not self.load:
            return []
        self._send_added()
        while not self._poller.poll(_POLL_MS):
            self._check_alive()
        outputs = []
        for index, replica in enumerate(self.replicas):
            while (message := replica.receive_now()) is not None:
                if isinstance(message, EngineFailed):
                    raise self._failure(index, message.message)
                if isinstance(message, EngineOutputs):
                    self.stats[index] = message.stats
                    if message.rejected:  # the prompt was checked here: a bug if it happens
                        raise ReplicaFailedError(f"engine replica {index} refused requests: {message.rejected}")
                    outputs.extend(self._finished(o) for o in message.outputs if o.request_id in self.load)
        return outputs

    @property
    def num_steps(self) -> int:
        """Steps the replicas have launched, added up (as of their last messages)."""
        return total_stats(self.stats).num_steps

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Speculative decoding totals of the replicas, added up (as of their last messages)."""
        k = self.config.speculative.num_speculative_tokens if self.config.speculative else 0
        stats, total = total_stats(self.stats), SpecDecodeStats(k)
        total.num_drafts, total.num_draft_tokens = stats.spec_num_drafts, stats.spec_num_draft_tokens
        total.num_accepted_tokens = stats.spec_num_accepted_tokens
        for position, accepted in enumerate(stats.spec_accepted_per_position[:k]):
            total.accepted_per_position[position] += accepted
        return total

    def _finished(self, output: EngineCoreOutput) -> EngineCoreOutput:
        if output.finish_reason is not None:
            self.load.release(output.request_id)
        return output

    def _failure(self, index: int, message: str) -> ReplicaFailedError:
        """Replica `index` reported `message`. A replica whose peer died fails too (DP attention's
        collectives with it break: "Connection reset"), so a replica that has exited, or exits
        within a short wait, is named as the cause."""
        deadline = time.monotonic() + _PEER_EXIT_WAIT_S
        while not (dead := [(i, r.exit_code()) for i, r in enumerate(self.replicas)
                            if i != index and r.exit_code() is not None]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead:
            peer, code = dead[0]
            return ReplicaFailedError(f"engine replica {peer} exited unexpectedly (exit code {code}); replica "
                                      f"{index} then failed: {message}")
        return ReplicaFailedError(f"engine replica {index}: {message}")

    def _check_alive(self) -> None:
        for index, replica in enumerate(self.replicas):
            if replica.exit_code() is not None:
                raise ReplicaFailedError(f"engine replica {index} exited unexpectedly (exit code "
                                         f"{replica.exit_code()})")

    def shutdown(self) -> None:
        for replica in self.replicas:
            if replica.exit_code() is None:
                try:
                    replica.send(Shutdown())
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 5.0
        for replica in self.replicas:
            while replica.exit_code() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            replica.kill()
