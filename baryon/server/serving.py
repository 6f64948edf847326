"""What the completions and chat endpoints share: the server's context, the model check, the
engine streams of a request's prompts (merged, timed for /metrics), SSE framing, usage, and
turning engine failures and client disconnects into the right outcome."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from baryon.config import EngineConfig
from baryon.engine.core_client import AsyncEngineClient, EngineDeadError, OutputProcessingError, RequestRejectedError
from baryon.logger import get_logger
from baryon.multimodal.inputs import ImageInput, MultiModalInputs
from baryon.outputs import CompletionOutput, RequestOutput
from baryon.sampling_params import SamplingParams
from baryon.server.errors import APIError, error_body
from baryon.server.inputs import InputProcessor, Prompt
from baryon.server.metrics import ServerMetrics
from baryon.server.sampling import requested_structure
from baryon.server.tool_choice import plan_tools
from baryon.structured_output.grammar import check_spec

logger = get_logger(__name__)
_json = msgspec.json.Encoder()
# How a request can fail once in the engine (see failure()).
_REQUEST_FAILURES = (EngineDeadError, RequestRejectedError, OutputProcessingError)
SSE_DONE = b"data: [DONE]\n\n"
_T = TypeVar("_T")


@dataclass
class ServerContext:
    config: EngineConfig
    client: AsyncEngineClient
    inputs: InputProcessor
    metrics: ServerMetrics
    model_names: list[str]  # the first is the one responses name
    reasoning_parser: str | None = None  # chat replies split into reasoning and content (reasoning/)
    tool_parser: str | None = None  # tool calls found in chat replies (tool_parsers/)
    # Requests are prepared (tokenized, chat templates rendered, output constraints checked) on
    # this thread, not the event loop: a 10 MB prompt or a slow schema must not stall /health and
    # every stream. One thread: a fast tokenizer is not to be called from two threads at once.
    preparer: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="baryon-inputs"))
    # A request's output constraints are checked (their grammars compiled, each verdict kept: see
    # structured_output/grammar.check_spec) on these threads before it is prepared, so that a slow
    # spec (1,024 long choices: 15 s) holds only its own request, not the preparing thread.
    spec_checker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="baryon-specs"))
    # Images are fetched (http: up to FETCH_TIMEOUT_S), decoded and cut into patches on these
    # threads, each image of a request at once, before the request is prepared: a slow image
    # server holds only the requests that point at it.
    image_reader: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=8, thread_name_prefix="baryon-images"))

    @property
    def call_id_chars(self) -> int | None:
        """How many of a tool call id's last characters the chat template is given: Mistral's
        templates accept ids of nine characters only (vLLM cuts them the same way)."""
        return 9 if self.tool_parser == "mistral" else None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in self.model_names:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.model_names))}", param="model", code="model_not_found")

    def check_alive(self) -> None:
        if self.client.dead_reason is not None:
            raise engine_unavailable(self.client.dead_reason)

    async def prepare(self, work: Callable[..., _T], *args: Any) -> _T:
        """work(*args) on the preparing thread (its APIError is raised here)."""
        return await asyncio.get_running_loop().run_in_executor(self.preparer, work, *args)

    async def read_images(self, messages: list[Any] | None) -> list[ImageInput] | None:
        """The conversation's images, fetched and decoded on the image threads, then processed
        (None: it has none); an unreadable image or a model that reads none is a 400."""
        urls = self.inputs.image_urls(messages or [])
        if not urls:
            return None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.image_reader, self.inputs.image_processor)  # refuses a text-only model
        loaded = await asyncio.gather(*(loop.run_in_executor(self.image_reader, self.inputs.load_image, url)
                                        for url in urls))
        return await loop.run_in_executor(self.image_reader, self.inputs.process_images, loaded)

    async def check_constraints(self, request: Any) -> None:
        """Check a chat or completion request's output constraints (response_format,
        structured_outputs, a required or named tool choice) on the spec-checking threads, so
        that preparing it finds their verdicts kept. Its errors are left to the preparation,
        which meets the same checks again."""
        if request.response_format is None and request.structured_outputs is None \
                and not getattr(request, "tools", None):
            return
        await asyncio.get_running_loop().run_in_executor(self.spec_checker, _check_constraints, request,
                                                         self.tool_parser)


def _check_constraints(request: Any, tool_parser: str | None) -> None:
    try:
        if getattr(request, "tools", None):
            plan_tools(request, tool_parser)  # checks the tools' schemas
        structure, _ = requested_structure(request)
        if structure is not None:
            check_spec(structure)
    except (APIError, ValueError):
        pass  # raised again, with the request's other problems, where it is prepared


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is not available: {reason}", code="engine_unavailable")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def stream_chunk(request_id: str, object_name: str, created: int, model: str, include_usage: bool,
                 choices: list[dict], **extra: Any) -> bytes:
    """One SSE chunk of a streamed completion; with include_usage every chunk but the last
    carries "usage": null, as OpenAI's do."""
    payload = {"id": request_id, "object": object_name, "created": created, "model": model, "choices": choices}
    if include_usage:
        payload["usage"] = None
    payload.update(extra)
    return sse(payload)


def json_response(payload: dict[str, Any]) -> Response:
    return Response(_json.encode(payload), media_type="application/json")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _timed(ctx: ServerContext, request_id: str, prompt: Prompt, params: SamplingParams,
                 multimodal: MultiModalInputs | None = None) -> AsyncIterator[RequestOutput]:
    timer = ctx.metrics.request_timer()
    async for output in ctx.client.generate(request_id, prompt[0], prompt[1], params, multimodal):
        timer.observe(output)
        yield output


async def generate_merged(ctx: ServerContext, request_id: str, prompts: list[Prompt], params: list[SamplingParams],
                          multimodal: MultiModalInputs | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, latest output) as the engine advances any of the prompts, until all are
    finished. Leaving early aborts every unfinished prompt. multimodal: the images of a single
    prompt (a chat's)."""
    if len(prompts) == 1:
        async for output in _timed(ctx, request_id, prompts[0], params[0], multimodal):
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(index: int) -> None:
        try:
            async for output in _timed(ctx, f"{request_id}-{index}", prompts[index], params[index]):
                queue.put_nowait((index, output))
        except Exception as e:
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, finished))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is finished:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def error_event(error: Exception) -> bytes:
    status, message, code = failure(error)
    body = error_body(status, message, code=code)
    body["error"]["status"] = status
    return sse(body)


def failure(error: Exception) -> tuple[int, str, str | None]:
    """(status, message, code) of one of the _REQUEST_FAILURES."""
    if isinstance(error, EngineDeadError):
        return 503, f"the engine is not available: {error}", "engine_unavailable"
    if isinstance(error, RequestRejectedError):
        return 400, str(error), None
    return 500, str(error), "output_processing_failed"


def streaming_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    """An SSE response ending with `data: [DONE]`; an engine failure mid-stream becomes an
    error event. A client that disconnects cancels the stream, which aborts its requests."""
    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except _REQUEST_FAILURES as e:
            yield error_event(e)
        except Exception as e:  # a bug of ours: the client still gets an error and the stream's end
            logger.exception("unexpected error while streaming a response")
            body = error_body(500, f"internal server error: {type(e).__name__}: {e}")
            body["error"]["status"] = 500
            yield sse(body)
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def unless_disconnected(raw_request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
    """Run a non-streaming request, abandoning it (and aborting it in the engine) if the client
    disconnects first; engine failures become 503 / 400 responses."""
    task = asyncio.create_task(work())
    watcher = asyncio.create_task(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():  # the client left: cancelling the work aborts its requests
        task.cancel()
        return Response(status_code=499)  # nobody is listening
    try:
        return task.result()
    except _REQUEST_FAILURES as e:
        status, message, code = failure(e)
        return JSONResponse(error_body(status, message, code=code), status_code=status)


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def stop_string_holdback(params: SamplingParams) -> int:
    """Characters a stream holds back so it never sends the start of a stop string."""
    return max(map(len, params.stop_strings), default=1) - 1


@dataclass
class ChoiceCursor:
    """What a streamed choice has sent so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    started: bool = False
    finished: bool = False

    def advance(self, sample: CompletionOutput, holdback: int) -> tuple[str, int, int] | None:
        """(new text, first new token, end of new tokens) for the next chunk, or None when the
        choice has nothing new to send."""
        if self.finished:
            return None
        finished = sample.finish_reason is not None
        num_tokens = len(sample.token_ids)
        text_end = len(sample.text) if finished else max(self.text_sent, len(sample.text) - holdback)
        if text_end == self.text_sent and num_tokens == self.tokens_sent and not finished and self.started:
            return None
        delta = (sample.text[self.text_sent:text_end], self.tokens_sent, num_tokens)
        self.text_sent, self.tokens_sent, self.started, self.finished = text_end, num_tokens, True, finished
        return delta
