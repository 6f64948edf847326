"""Data parallelism for the offline API: `data_parallel_size` engine replicas behind the
EngineCore interface that LLMEngine drives.

Each replica is an engine-core process (`baryon.engine.core_process`, the server's too) on its
own GPUs (`EngineConfig.replicas`), with its own scheduler, KV cache and, with tensor parallelism,
its own workers (with DP attention the replicas also step together and share a MoE model's
experts: `engine/core_process.py`). A new request goes to the replica with the least work
outstanding, in tokens (`engine/replica_load.py`); `step()` waits until some replica has produced
outputs and returns everything that has arrived. A replica that fails or exits fails the engine
with its reason.
"""

from __future__ import annotations

import time

import zmq

from baryon.config import EngineConfig
from baryon.engine.core import EngineCoreOutput, check_prompt
from baryon.engine.core_client import EngineProcess
from baryon.engine.messages import (AbortRequests, AddRequests, EngineCoreRequest, EngineFailed, EngineOutputs,
                                    EngineReady, Shutdown)
from baryon.engine.replica_load import ReplicaLoad, request_tokens
from baryon.sampling_params import SamplingParams

_POLL_MS = 100  # how often a wait for outputs checks that the replicas are alive


class ReplicaFailedError(RuntimeError):
    """An engine replica failed or exited; the engine cannot continue."""


class DataParallelEngineCores:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.replicas = [EngineProcess(async_outputs=False) for _ in range(config.parallel.data_parallel_size)]
        self.load = ReplicaLoad(len(self.replicas))  # the unfinished core requests and their replicas
        self.num_kv_blocks = 0  # the replicas' KV-cache blocks, added up
        self._poller = zmq.Poller()
        try:
            for replica, replica_config in zip(self.replicas, config.replicas()):
                replica.configure(replica_config)
                self._poller.register(replica.output_socket, zmq.POLLIN)
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

    # -- the EngineCore interface -------------------------------------------------------------

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        check_prompt(self.config, prompt_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: frozenset[int]) -> None:
        if request_id in self.load:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids)
        index = self.load.assign(request_id, request_tokens(len(prompt_token_ids), params,
                                                            self.config.model.max_model_len))
        self.replicas[index].send(AddRequests([EngineCoreRequest(request_id, list(prompt_token_ids), params,
                                                                 eos_token_ids)]))

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self.load.release(request_id)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            self.replicas[index].send(AbortRequests(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.load)

    def step(self) -> list[EngineCoreOutput]:
        """Every output the replicas have sent, waiting for at least one message."""
        if not self.load:
            return []
        while not self._poller.poll(_POLL_MS):
            self._check_alive()
        outputs = []
        for index, replica in enumerate(self.replicas):
            while (message := replica.receive_now()) is not None:
                if isinstance(message, EngineFailed):
                    raise ReplicaFailedError(f"engine replica {index}: {message.message}")
                if isinstance(message, EngineOutputs):
                    if message.rejected:  # the prompt was checked here: a bug if it happens
                        raise ReplicaFailedError(f"engine replica {index} refused requests: {message.rejected}")
                    outputs.extend(self._finished(o) for o in message.outputs if o.request_id in self.load)
        return outputs

    def _finished(self, output: EngineCoreOutput) -> EngineCoreOutput:
        if output.finish_reason is not None:
            self.load.release(output.request_id)
        return output

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
