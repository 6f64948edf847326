"""The server's asyncio handle on the engine-core process.

`EngineProcess()` launches `baryon.engine.core_process` at once (one per data-parallel replica) (it imports the engine while the
server resolves the configuration, and loads the model while the server loads its tokenizer)
and owns the two ZMQ sockets to it. `AsyncEngineClient` waits
until the engine is ready, then `generate()` sends a request's samples and yields its
RequestOutputs as steps come back: one task receives every engine message, turns token ids into
text with the OutputProcessor (detokenization and stop strings stay in this process) and hands
each request its latest output through its own asyncio queue.

If the engine process dies, every waiting request and every new one fails at once with
EngineDeadError; `shutdown()` does the same on purpose and asks the process to exit.
"""

from __future__ import annotations

import asyncio
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from baryon.config import EngineConfig
from baryon.engine.messages import (AbortRequests, AddRequests, EngineCoreRequest, EngineFailed, EngineMessage,
                                    EngineOutputs, EngineReady, EngineStats, Shutdown, encoder,
                                    engine_message_decoder, total_stats)
from baryon.engine.output_processor import OutputProcessor
from baryon.engine.replica_load import ReplicaLoad, request_tokens
from baryon.logger import get_logger
from baryon.multimodal.inputs import MultiModalInputs
from baryon.outputs import RequestOutput
from baryon.sampling_params import SamplingParams
from baryon.tokenizer import eos_token_ids

logger = get_logger(__name__)

# How often the client checks that the engine process is still running (seconds).
_WATCH_INTERVAL_S = 0.1
# After one replica fails, how long the others get to exit on a Shutdown before they are killed.
REPLICA_GRACE_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine process is gone or shutting down: no request can be served."""


class RequestRejectedError(ValueError):
    """The engine refused a request (a value the server-side checks did not catch)."""


class OutputProcessingError(RuntimeError):
    """Turning a request's tokens into its output failed (a bug; only that request fails)."""


class EngineProcess:
    """The engine-core process and the ZMQ sockets to it.

    The process starts on construction and imports the engine while the server resolves the
    configuration; `configure(config)` then lets it build the engine (load the model)."""

    def __init__(self, async_outputs: bool = True) -> None:
        """async_outputs: receive with asyncio (the server); False: blocking (core_processes.py)."""
        self._socket_dir = tempfile.mkdtemp(prefix="baryon-engine-")
        input_address, output_address = f"ipc://{self._socket_dir}/input", f"ipc://{self._socket_dir}/output"
        self._context = zmq.Context()
        self._to_engine = self._context.socket(zmq.PUSH)
        self._to_engine.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the engine drains every step
        self._to_engine.bind(input_address)
        context = zmq.asyncio.Context.shadow(self._context) if async_outputs else self._context
        self._from_engine = context.socket(zmq.PULL)
        self._from_engine.setsockopt(zmq.RCVHWM, 0)
        self._from_engine.bind(output_address)
        self.process = subprocess.Popen([sys.executable, "-m", "baryon.engine.core_process", input_address,
                                         output_address], stdin=subprocess.PIPE, start_new_session=True)

    def configure(self, config: EngineConfig) -> None:
        self.process.stdin.write(pickle.dumps(config))
        self.process.stdin.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.poll()

    def send(self, message: AddRequests | AbortRequests | Shutdown) -> None:
        """Raises zmq.ZMQError (zmq.Again) when no engine is connected."""
        self._to_engine.send(encoder.encode(message), zmq.NOBLOCK)

    @property
    def output_socket(self) -> zmq.Socket:
        return self._from_engine

    async def receive(self) -> EngineMessage:
        frame = await self._from_engine.recv(copy=False)
        return engine_message_decoder.decode(frame.buffer)

    def receive_now(self) -> EngineMessage | None:
        """The next message if one is waiting (blocking sockets only), else None."""
        try:
            frame = self._from_engine.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return engine_message_decoder.decode(frame.buffer)

    async def wait_ready(self) -> EngineStats:
        """Wait until the engine has loaded the model; RuntimeError if it failed to."""
        while not await self._from_engine.poll(timeout=int(_WATCH_INTERVAL_S * 1000)):
            if self.exit_code() is not None:
                raise RuntimeError(f"the engine process exited while starting (exit code {self.exit_code()})")
        message = await self.receive()
        if isinstance(message, EngineFailed):
            raise RuntimeError(message.message)
        if not isinstance(message, EngineReady):
            raise RuntimeError(f"unexpected first message from the engine: {type(message).__name__}")
        return message.stats

    async def close(self, timeout_s: float = 3.0) -> None:
        """Wait for the process to exit (after a Shutdown), terminate or kill it if it will not,
        and release the sockets."""
        await self._wait(timeout_s)
        if self.exit_code() is None:
            logger.warning("the engine process did not exit in %.0f s; terminating it", timeout_s)
            self.process.terminate()
            await self._wait(timeout_s)
        self.kill()

    def kill(self) -> None:
        """Stop the process now (if it runs) and release the sockets."""
        if self.exit_code() is None:
            self.process.kill()
            self.process.wait()
        if not self.process.stdin.closed:
            self.process.stdin.close()
        if not self._context.closed:
            self._to_engine.close(linger=0)
            self._from_engine.close(linger=0)
            self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    async def _wait(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.exit_code() is None and loop.time() < deadline:
            await asyncio.sleep(0.02)


class AsyncEngineClient:
    """The server's client of one engine process, or of data_parallel_size replicas: each new
    request goes to the replica with the least work outstanding, in tokens (ReplicaLoad); a
    replica that fails fails the whole engine (every request, and /health answers 503), and the
    other replicas are stopped."""

    def __init__(self, engines: list[EngineProcess], config: EngineConfig, tokenizer: Any | None) -> None:
        self.engines = engines
        self.config = config
        self.eos_token_ids = eos_token_ids(config.model.model_path, config.model.hf_config, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self.replica_stats = [EngineStats() for _ in engines]
        self.num_prompt_tokens = 0  # totals since start, for /metrics
        self.num_generation_tokens = 0
        self.dead_reason: str | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._load = ReplicaLoad(len(engines))  # the unfinished requests and their replicas
        self._closing = False
        self._tasks: list[asyncio.Task] = []

    @property
    def pids(self) -> list[int]:
        return [engine.pid for engine in self.engines]

    @property
    def stats(self) -> EngineStats:
        """The replicas' load, added up."""
        return total_stats(self.replica_stats)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Wait until every replica has loaded the model (RuntimeError if one failed to)."""
        self.replica_stats = list(await asyncio.gather(*(engine.wait_ready() for engine in self.engines)))
        self._tasks = [asyncio.create_task(coroutine) for index in range(len(self.engines))
                       for coroutine in (self._receive_loop(index), self._watch_process(index))]

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Fail every request, refuse new ones and ask the engine processes to exit."""
        if self._closing:
            return
        self._closing = True
        self._fail_all(reason)
        for engine in self.engines:
            try:
                engine.send(Shutdown())
            except zmq.ZMQError:
                pass  # not connected: the process is gone, or close() terminates it

    async def close(self) -> None:
        self.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(engine.close() for engine in self.engines))

    # -- requests -----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, multimodal: MultiModalInputs | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs (cumulative: each holds every token so far), the last one
        finished. Leaving early (break, cancellation, an error) aborts the request in the engine.
        multimodal: the prompt's images (their placeholders expanded in prompt_token_ids)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        queue: asyncio.Queue = asyncio.Queue()
        core_ids = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        self._queues[request_id] = queue
        replica = self._load.assign(request_id, request_tokens(len(prompt_token_ids), params,
                                                               self.config.model.max_model_len))
        try:
            samples = [params.for_sample(i) if params.n > 1 else params for i in range(params.n)]
            self._send(replica, AddRequests([EngineCoreRequest(core_id, prompt_token_ids, sample, self.eos_token_ids,
                                                               multimodal)
                                             for core_id, sample in zip(core_ids, samples)]))
            self.num_prompt_tokens += len(prompt_token_ids)
            while True:
                item = await queue.get()
                while not queue.empty() and not isinstance(item, BaseException):
                    item = queue.get_nowait()  # outputs are cumulative: the latest says it all
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self.abort(request_id)
            self._load.release(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; its engine-core requests free their KV blocks in the next step."""
        unfinished = self.output_processor.abort_request(request_id)
        if unfinished and self.dead_reason is None:
            try:
                self._send(self._load.replica_of(request_id) or 0, AbortRequests(unfinished))
            except EngineDeadError:
                pass

    def _send(self, replica: int, message: AddRequests | AbortRequests) -> None:
        engine = self.engines[replica]
        try:
            engine.send(message)
        except zmq.ZMQError as e:  # zmq.Again: no engine connected (often: it just died)
            code = engine.exit_code()
            self._fail_all(f"the engine process exited unexpectedly (exit code {code})" if code is not None
                           else f"the engine process is not reachable ({e})")
            raise EngineDeadError(self.dead_reason) from None

    # -- engine messages ----------------------------------------------------------------------

    async def _receive_loop(self, replica: int) -> None:
        while True:
            message = await self.engines[replica].receive()
            if isinstance(message, EngineFailed):
                self._fail_all(message.message)
                return
            if isinstance(message, EngineOutputs):
                try:
                    self._apply(replica, message)
                except Exception as e:  # a bug here would leave requests waiting forever
                    logger.exception("failed to process engine outputs")
                    self._fail_all(f"the server failed to process engine outputs: {type(e).__name__}: {e}")
                    return

    def _apply(self, replica: int, message: EngineOutputs) -> None:
        self.replica_stats[replica] = message.stats
        for core_id, reason in message.rejected.items():
            entry = self.output_processor.samples.get(core_id)
            if entry is not None:
                self._fail_request(entry[0].request_id, RequestRejectedError(reason))
        self.num_generation_tokens += sum(len(o.new_token_ids) for o in message.outputs)
        by_request: dict[str, list] = {}
        for core_output in message.outputs:
            entry = self.output_processor.samples.get(core_output.request_id)
            if entry is not None:  # else aborted meanwhile
                by_request.setdefault(entry[0].request_id, []).append(core_output)
        for request_id, core_outputs in by_request.items():
            try:  # one request at a time, so a failure stays with its request
                outputs, stopped_by_string = self.output_processor.process(core_outputs)
            except Exception as e:
                logger.exception("failed to process the outputs of request %s", request_id)
                self._fail_request(request_id, OutputProcessingError(
                    f"the server failed to process this request's output: {type(e).__name__}: {e}"))
                continue
            if stopped_by_string:
                self._send(replica, AbortRequests(stopped_by_string))
            for output in outputs:
                queue = self._queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(output)

    async def _watch_process(self, replica: int) -> None:
        engine = self.engines[replica]
        while engine.exit_code() is None:
            await asyncio.sleep(_WATCH_INTERVAL_S)
        if not self._closing and self.dead_reason is None:  # (else: shut down, or stopped after another failed)
            logger.error("the engine process exited unexpectedly (exit code %s)", engine.exit_code())
            self._fail_all(f"the engine process exited unexpectedly (exit code {engine.exit_code()})")

    def _fail_request(self, request_id: str, error: Exception) -> None:
        self.abort(request_id)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _fail_all(self, reason: str) -> None:
        first = self.dead_reason is None
        if first:
            self.dead_reason = reason
        for request_id in list(self.output_processor.requests):
            self.output_processor.abort_request(request_id)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(self.dead_reason))
        if first and not self._closing and len(self.engines) > 1:
            self._tasks.append(asyncio.get_running_loop().create_task(self._stop_replicas()))

    async def _stop_replicas(self) -> None:
        """The engine failed, so its replicas that still run serve nothing: each is asked to exit
        and, past REPLICA_GRACE_S, killed (a DP-attention replica may be waiting for the failed
        one inside a collective or a kernel, where no message reaches it). Their GPUs are free
        again; the server answers 503 until it is restarted."""
        running = [engine for engine in self.engines if engine.exit_code() is None]
        for engine in running:
            try:
                engine.send(Shutdown())
            except zmq.ZMQError:
                pass
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLICA_GRACE_S
        while any(engine.exit_code() is None for engine in running) and loop.time() < deadline:
            await asyncio.sleep(_WATCH_INTERVAL_S)
        for engine in running:
            if engine.exit_code() is None:
                logger.warning("engine replica (pid %d) did not exit within %.0f s of the engine's failure; killing it",
                               engine.pid, REPLICA_GRACE_S)
                engine.process.kill()
