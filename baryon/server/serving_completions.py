"""POST /v1/completions: prompts (text or token ids, one or a list) -> n choices each.

Choice i*n + j is sample j of prompt i. `echo` prepends the prompt (and, with `logprobs`, the
prompt's logprobs, the first position null). Streams send one chunk per choice whenever it has
new tokens; with stop strings, the text that could still turn into one is held back until it
cannot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from baryon.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from baryon.sampling_params import SamplingParams
from baryon.server.errors import bad_request
from baryon.server.inputs import Prompt, check_unicode
from baryon.server.logprobs import CompletionLogprobs
from baryon.server.protocol import CompletionRequest
from baryon.server.sampling import build_sampling_params
from baryon.server.serving import (ChoiceCursor, ServerContext, generate_merged, json_response, new_id, now,
                                   stop_string_holdback, stream_chunk, streaming_response, unless_disconnected, usage)

# OpenAI's default for /v1/completions.
DEFAULT_MAX_TOKENS = 16


@dataclass
class _Plan:
    """A validated completion request, ready for the engine."""

    request_id: str
    prompts: list[Prompt]
    params: list[SamplingParams]
    n: int
    echo: bool
    logprobs: int | None
    include_usage: bool

    def echo_text(self, ctx: ServerContext, index: int) -> str:
        text, ids = self.prompts[index]
        if text is not None:
            return text
        tokenizer = ctx.inputs.tokenizer
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def echo_logprobs(self, output: RequestOutput) -> list[PositionLogprobs | None]:
        return list(output.prompt_logprobs or [None] * len(output.prompt_token_ids))


def _plan(ctx: ServerContext, request: CompletionRequest) -> _Plan:
    ctx.check_model(request.model)
    ctx.check_alive()
    check_unicode(request.model_dump(exclude_none=True, by_alias=True))
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    prompts = ctx.inputs.completion_prompts(request.prompt)
    echo = bool(request.echo)
    params = [build_sampling_params(
        request, ctx.config, ctx.inputs.tokenizer is not None,
        max_tokens=ctx.inputs.max_tokens(ids, request.max_tokens, DEFAULT_MAX_TOKENS, "max_tokens",
                                         request.min_tokens),
        logprobs=request.logprobs, prompt_logprobs=request.logprobs if echo else None,
        renamed={"prompt_logprobs": "logprobs"}) for _, ids in prompts]
    n = params[0].n
    limit = ctx.config.scheduler.max_num_seqs
    if len(prompts) * n > limit:
        raise bad_request(f"{len(prompts)} prompts x n={n} make {len(prompts) * n} choices, more than this "
                          f"server runs at once (--max-num-seqs {limit})", param="prompt")
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return _Plan(new_id("cmpl"), prompts, params, n, echo, request.logprobs, include_usage)


async def create_completion(ctx: ServerContext, request: CompletionRequest, raw_request: Request) -> Response:
    await ctx.check_constraints(request)
    plan = await ctx.prepare(_plan, ctx, request)
    outputs = generate_merged(ctx, plan.request_id, plan.prompts, plan.params)
    if request.stream:
        return streaming_response(_stream(ctx, plan, outputs))
    return await unless_disconnected(raw_request, lambda: _complete(ctx, plan, outputs))


async def _complete(ctx: ServerContext, plan: _Plan, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> Response:
    finals: list[RequestOutput | None] = [None] * len(plan.prompts)
    async for index, output in outputs:
        finals[index] = output
    choices, completion_tokens = [], 0
    for index, output in enumerate(finals):
        for sample in output.outputs:
            completion_tokens += len(sample.token_ids)
            choices.append(_choice(ctx, plan, index, output, sample))
    prompt_tokens = sum(len(ids) for _, ids in plan.prompts)
    return json_response({"id": plan.request_id, "object": "text_completion", "created": now(),
                          "model": ctx.model_name, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})


def _choice(ctx: ServerContext, plan: _Plan, index: int, output: RequestOutput, sample: CompletionOutput) -> dict:
    text, logprobs = sample.text, None
    shown = plan.echo_text(ctx, index) if plan.echo else None  # the prompt as echoed
    if plan.logprobs is not None:
        builder = CompletionLogprobs(plan.logprobs, ctx.inputs.tokenizer)
        token_ids, entries = list(sample.token_ids), list(sample.logprobs[:len(sample.token_ids)])
        echoed = None
        if shown is not None:
            token_ids, entries = output.prompt_token_ids + token_ids, plan.echo_logprobs(output) + entries
            echoed = (shown, len(output.prompt_token_ids))
        logprobs = builder.build(token_ids, entries, echoed)
    if shown is not None:
        text = shown + text
    return {"index": index * plan.n + sample.index, "text": text, "logprobs": logprobs,
            "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}


async def _stream(ctx: ServerContext, plan: _Plan, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
    created = now()
    holdback = stop_string_holdback(plan.params[0])
    cursors: dict[int, ChoiceCursor] = {}
    builders: dict[int, CompletionLogprobs] = {}
    completion_tokens = 0

    def chunk(choices: list[dict], **extra: Any) -> bytes:
        return stream_chunk(plan.request_id, "text_completion", created, ctx.model_name, plan.include_usage, choices, **extra)

    async for index, output in outputs:
        for sample in output.outputs:
            choice_index = index * plan.n + sample.index
            cursor = cursors.setdefault(choice_index, ChoiceCursor())
            first = not cursor.started
            delta = cursor.advance(sample, holdback)
            if delta is None:
                continue
            text, start, end = delta
            token_ids = sample.token_ids[start:end]
            entries = list(sample.logprobs[start:end]) if sample.logprobs is not None else []
            echoed = None
            if plan.echo and first:
                echoed = (plan.echo_text(ctx, index), len(output.prompt_token_ids))
                text = echoed[0] + text
                token_ids, entries = output.prompt_token_ids + token_ids, plan.echo_logprobs(output) + entries
            logprobs = None
            if plan.logprobs is not None:
                builder = builders.setdefault(choice_index, CompletionLogprobs(plan.logprobs, ctx.inputs.tokenizer))
                logprobs = builder.build(token_ids, entries, echoed)
            if cursor.finished:
                completion_tokens += len(sample.token_ids)
            yield chunk([{"index": choice_index, "text": text, "logprobs": logprobs,
                          "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}])
    if plan.include_usage:
        prompt_tokens = sum(len(ids) for _, ids in plan.prompts)
        yield chunk([], usage=usage(prompt_tokens, completion_tokens))
