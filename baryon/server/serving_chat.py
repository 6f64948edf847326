"""POST /v1/chat/completions: a conversation, rendered with the chat template -> n replies.

Without max_completion_tokens (or its old name max_tokens) a reply may fill the context.
Streams send, per choice, a first chunk with the assistant role, then one chunk whenever the
choice has new tokens, the last one carrying its finish_reason. With a reasoning parser
(`--reasoning-parser`, GPT-OSS by default) replies carry `reasoning_content` beside `content`,
and stream deltas carry either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from baryon.outputs import CompletionOutput, RequestOutput
from baryon.sampling_params import SamplingParams
from baryon.server.errors import bad_request
from baryon.server.logprobs import chat_logprobs
from baryon.server.protocol import ChatCompletionRequest
from baryon.server.reasoning import ReasoningCursor, split_harmony
from baryon.server.sampling import build_sampling_params
from baryon.server.serving import (ChoiceCursor, ServerContext, generate_merged, json_response, new_id, now,
                                   stop_string_holdback, stream_chunk, streaming_response, unless_disconnected, usage)


@dataclass
class _Plan:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    top_logprobs: int | None  # None: no logprobs
    include_usage: bool


def _plan(ctx: ServerContext, request: ChatCompletionRequest) -> _Plan:
    ctx.check_model(request.model)
    ctx.check_alive()
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise bad_request("give max_completion_tokens or its deprecated name max_tokens, not both",
                          param="max_tokens")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    limit_name = "max_tokens" if request.max_tokens is not None else "max_completion_tokens"
    requested = request.max_tokens if request.max_tokens is not None else request.max_completion_tokens
    ids = ctx.inputs.chat_prompt(request.messages)
    top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = build_sampling_params(
        request, ctx.config, ctx.inputs.tokenizer is not None,
        max_tokens=ctx.inputs.max_tokens(ids, requested, None, limit_name), logprobs=top_logprobs,
        renamed={"max_tokens": limit_name, "logprobs": "top_logprobs"})
    if ctx.reasoning_parser is not None:  # its markers are special tokens: keep them in the text
        params = dataclasses.replace(params, skip_special_tokens=False)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return _Plan(new_id("chatcmpl"), ids, params, top_logprobs, include_usage)


async def create_chat_completion(ctx: ServerContext, request: ChatCompletionRequest, raw_request: Request) -> Response:
    plan = _plan(ctx, request)
    outputs = generate_merged(ctx, plan.request_id, [(None, plan.prompt_token_ids)], [plan.params])
    if request.stream:
        return streaming_response(_stream(ctx, plan, outputs))
    return await unless_disconnected(raw_request, lambda: _complete(ctx, plan, outputs))


def _logprobs(ctx: ServerContext, plan: _Plan, sample: CompletionOutput, start: int, end: int) -> dict | None:
    if plan.top_logprobs is None:
        return None
    return chat_logprobs(sample.token_ids[start:end], sample.logprobs[start:end], plan.top_logprobs,
                         ctx.inputs.tokenizer)


def _message(ctx: ServerContext, text: str) -> dict:
    if ctx.reasoning_parser is None:
        return {"role": "assistant", "content": text}
    reasoning, content = split_harmony(text, finished=True)
    return {"role": "assistant", "content": content, "reasoning_content": reasoning or None}


async def _complete(ctx: ServerContext, plan: _Plan, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> Response:
    final = None
    async for _, output in outputs:
        final = output
    choices = [{"index": sample.index, "message": _message(ctx, sample.text),
                "logprobs": _logprobs(ctx, plan, sample, 0, len(sample.token_ids)),
                "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}
               for sample in final.outputs]
    completion_tokens = sum(len(sample.token_ids) for sample in final.outputs)
    return json_response({"id": plan.request_id, "object": "chat.completion", "created": now(),
                          "model": ctx.model_name, "choices": choices,
                          "usage": usage(len(plan.prompt_token_ids), completion_tokens)})


async def _stream(ctx: ServerContext, plan: _Plan, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
    created = now()
    holdback = stop_string_holdback(plan.params)
    cursors: dict[int, ChoiceCursor] = {}
    completion_tokens = 0

    def chunk(choices: list[dict], **extra: Any) -> bytes:
        return stream_chunk(plan.request_id, "chat.completion.chunk", created, ctx.model_name, plan.include_usage, choices, **extra)

    reasoning: dict[int, ReasoningCursor] = {}
    async for _, output in outputs:
        for sample in output.outputs:
            cursor = cursors.setdefault(sample.index, ChoiceCursor())
            if not cursor.started:
                yield chunk([{"index": sample.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            delta = cursor.advance(sample, holdback)
            if delta is None:
                continue
            text, start, end = delta
            if cursor.finished:
                completion_tokens += len(sample.token_ids)
            if ctx.reasoning_parser is None:
                fields = {"content": text} if text else {}
            else:  # the parts of the reply sent so far, split again
                fields = reasoning.setdefault(sample.index, ReasoningCursor()).advance(
                    sample.text[:cursor.text_sent], cursor.finished)
            yield chunk([{"index": sample.index, "delta": fields,
                          "logprobs": _logprobs(ctx, plan, sample, start, end),
                          "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}])
    if plan.include_usage:
        yield chunk([], usage=usage(len(plan.prompt_token_ids), completion_tokens))
