"""POST /v1/chat/completions: a conversation, rendered with the chat template -> n replies.

Without max_completion_tokens (or its old name max_tokens) a reply may fill the context.
Streams send, per choice, a first chunk with the assistant role, then one chunk whenever the
choice has new tokens, the last one carrying its finish_reason. With a reasoning parser
(`--reasoning-parser`, GPT-OSS by default) replies carry `reasoning_content` beside `content`,
and stream deltas carry either. With `tools`, replies carry `tool_calls` (tool_choice.py says
how they are found) and end with finish_reason "tool_calls"; streams send each call as a
`tool_calls` delta (a required / named tool choice's calls as tool_choice.py says). A reply
constrained by response_format, structured_outputs or a required / named tool choice has no
reasoning split: the constraint starts at its first token. A chunk that would carry nothing (an
empty delta, no logprobs, no finish) is not sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from baryon.multimodal.inputs import ImageInput, MultiModalInputs
from baryon.outputs import CompletionOutput, RequestOutput
from baryon.sampling_params import SamplingParams
from baryon.server.errors import bad_request
from baryon.server.inputs import check_unicode
from baryon.server.logprobs import chat_logprobs
from baryon.server.protocol import ChatCompletionRequest
from baryon.server.reasoning import reasoning_stream, split_reasoning
from baryon.server.sampling import build_sampling_params, requested_structure
from baryon.server.serving import (ChoiceCursor, ServerContext, generate_merged, json_response, new_id, now,
                                   stop_string_holdback, stream_chunk, streaming_response, unless_disconnected, usage)
from baryon.server.tool_choice import ConstrainedCallStream, ToolPlan, constrained_calls, plan_tools
from baryon.server.tool_parsers import ToolCall


@dataclass
class _Plan:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    top_logprobs: int | None  # None: no logprobs
    include_usage: bool
    tools: ToolPlan
    reasoning_parser: str | None  # None: no split (no parser, or a constrained reply)
    prompt_ends_in_reasoning: bool = False  # the template opened <think> in the prompt
    multimodal: MultiModalInputs | None = None  # the conversation's images


def _plan(ctx: ServerContext, request: ChatCompletionRequest, images: list[ImageInput] | None) -> _Plan:
    # (the model and the engine are checked by create_chat_completion, before any image is fetched)
    check_unicode(request.model_dump(exclude_none=True, by_alias=True))
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise bad_request("give max_completion_tokens or its deprecated name max_tokens, not both",
                          param="max_tokens")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    limit_name = "max_tokens" if request.max_tokens is not None else "max_completion_tokens"
    requested = request.max_tokens if request.max_tokens is not None else request.max_completion_tokens
    tools = plan_tools(request, ctx.tool_parser)
    structure = requested_structure(request)
    if tools.structure is not None:
        if structure[0] is not None:
            raise bad_request(f"tool_choice {tools.mode!r} constrains the reply itself; it cannot be combined "
                              f"with {structure[1]}", param="tool_choice")
        structure = (tools.structure, "tool_choice")
    ids = ctx.inputs.chat_prompt(request.messages, tools=tools.tools, template_kwargs=_template_kwargs(request),
                                 call_id_chars=ctx.call_id_chars)
    ids, multimodal = ctx.inputs.expand_images(ids, images)
    reasoning_parser = ctx.reasoning_parser
    # <think> parsers: how the generation prompt ends (a template may open or close the reasoning)
    tail = ctx.inputs.tokenizer.decode(ids[-8:], skip_special_tokens=False).rstrip() \
        if reasoning_parser in _THINK_PARSERS else ""
    if tail.endswith("</think>"):  # the template closed the reasoning (thinking off): the reply is all content
        reasoning_parser = None
    if structure[0] is not None:  # a reasoning model thinks first: the constraint starts after </think>
        end = _reasoning_end(ctx, reasoning_parser)
        if end is None:
            reasoning_parser = None  # constrained from the first token: nothing to split
        else:
            structure = (dataclasses.replace(structure[0], reasoning_end=end), structure[1])
    top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = build_sampling_params(
        request, ctx.config, ctx.inputs.tokenizer is not None,
        max_tokens=ctx.inputs.max_tokens(ids, requested, None, limit_name, request.min_tokens), logprobs=top_logprobs,
        renamed={"max_tokens": limit_name, "logprobs": "top_logprobs"}, structure=structure)
    if reasoning_parser is not None or tools.new_parser() is not None:
        # Their markers may be special tokens (harmony's, Mistral's [TOOL_CALLS]): keep them in the text.
        params = dataclasses.replace(params, skip_special_tokens=False)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    opens = reasoning_parser in _THINK_PARSERS and tail.endswith("<think>")  # the template opened it
    return _Plan(new_id("chatcmpl"), ids, params, top_logprobs, include_usage, tools, reasoning_parser, opens,
                 multimodal)


def _template_kwargs(request: ChatCompletionRequest) -> dict | None:
    """chat_template_kwargs, with reasoning_effort among them as the template variable of that name
    (GPT-OSS's template reads it; others ignore it)."""
    kwargs = request.chat_template_kwargs
    if request.reasoning_effort is None:
        return kwargs
    given = (kwargs or {}).get("reasoning_effort", request.reasoning_effort)
    if given != request.reasoning_effort:
        raise bad_request(f"reasoning_effort {request.reasoning_effort!r} and chat_template_kwargs.reasoning_effort "
                          f"{given!r} differ: give one", param="reasoning_effort")
    return {**(kwargs or {}), "reasoning_effort": request.reasoning_effort}


_THINK_PARSERS = ("qwen3", "deepseek_r1")  # reasoning between <think> and </think>


def _reasoning_end(ctx: ServerContext, parser: str | None) -> list[int] | None:
    """The token ids after which a constrained reply's constraint starts: `</think>`'s for a
    <think> reasoning parser (one whose prompt has not closed the reasoning: see _plan); None:
    the constraint applies from the first token. (GPT-OSS's harmony channels are not gated: its
    constrained replies are not split.)"""
    if parser not in _THINK_PARSERS:
        return None
    return ctx.inputs.tokenizer.encode("</think>", add_special_tokens=False)


async def create_chat_completion(ctx: ServerContext, request: ChatCompletionRequest, raw_request: Request) -> Response:
    ctx.check_model(request.model)  # before any image is fetched for it
    ctx.check_alive()
    await ctx.check_constraints(request)
    images = await ctx.read_images(request.messages)
    plan = await ctx.prepare(_plan, ctx, request, images)
    outputs = generate_merged(ctx, plan.request_id, [(None, plan.prompt_token_ids)], [plan.params], plan.multimodal)
    if request.stream:
        return streaming_response(_stream(ctx, plan, outputs))
    return await unless_disconnected(raw_request, lambda: _complete(ctx, plan, outputs))


def _logprobs(ctx: ServerContext, plan: _Plan, sample: CompletionOutput, start: int, end: int) -> dict | None:
    if plan.top_logprobs is None:
        return None
    return chat_logprobs(sample.token_ids[start:end], sample.logprobs[start:end], plan.top_logprobs,
                         ctx.inputs.tokenizer)


def _split(plan: _Plan, text: str, finished: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a reply."""
    if plan.reasoning_parser is None:
        return None, text
    return split_reasoning(plan.reasoning_parser, text, finished, plan.prompt_ends_in_reasoning)


def _calls(plan: _Plan, content: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content left, tool calls) of a finished reply (text) whose content the reasoning split left."""
    if plan.tools.structure is not None:
        calls = constrained_calls(plan.tools, content)
        return (None if calls else content), calls
    parser = plan.tools.new_parser()
    if parser is None:
        return content, []
    parsed = parser.parse(text if parser.reads_whole_reply else content)
    return parsed.content, parsed.tool_calls[:1] if plan.tools.one_call else parsed.tool_calls


def _tool_call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _finish_reason(sample: CompletionOutput, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and sample.finish_reason == "stop" else sample.finish_reason


def _message(plan: _Plan, sample: CompletionOutput) -> tuple[dict, str | None]:
    """(the reply's message, its finish_reason)."""
    reasoning, content = _split(plan, sample.text, finished=True)
    content, calls = _calls(plan, content, sample.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if plan.reasoning_parser is not None:
        message["reasoning_content"] = reasoning or None
    if plan.tools.tools is not None:
        message["tool_calls"] = [_tool_call_json(call) for call in calls]
    return message, _finish_reason(sample, bool(calls))


async def _complete(ctx: ServerContext, plan: _Plan, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> Response:
    final = None
    async for _, output in outputs:
        final = output
    choices = []
    for sample in final.outputs:
        message, finish_reason = _message(plan, sample)
        choices.append({"index": sample.index, "message": message,
                        "logprobs": _logprobs(ctx, plan, sample, 0, len(sample.token_ids)),
                        "finish_reason": finish_reason, "stop_reason": sample.stop_reason})
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

    streams: dict[int, _ChoiceStream] = {}
    async for _, output in outputs:
        for sample in output.outputs:
            cursor = cursors.setdefault(sample.index, ChoiceCursor())
            if not cursor.started:
                yield chunk([{"index": sample.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            delta = cursor.advance(sample, holdback)
            if delta is None:
                continue
            _, start, end = delta
            if cursor.finished:
                completion_tokens += len(sample.token_ids)
            stream = streams.setdefault(sample.index, _ChoiceStream(plan))
            fields = stream.advance(sample.text[:cursor.text_sent], cursor.finished)
            finish_reason = _finish_reason(sample, stream.num_calls > 0) if cursor.finished else None
            logprobs = _logprobs(ctx, plan, sample, start, end)
            if not fields and logprobs is None and finish_reason is None:
                continue  # text a parser holds back (a call not closed yet)
            yield chunk([{"index": sample.index, "delta": fields, "logprobs": logprobs,
                          "finish_reason": finish_reason, "stop_reason": sample.stop_reason}])
    if plan.include_usage:
        yield chunk([], usage=usage(len(plan.prompt_token_ids), completion_tokens))


class _ChoiceStream:
    """One streamed choice's delta fields: the text so far split into reasoning and content,
    the content read for tool calls (by the parser, or as a constrained reply's calls)."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.reasoning = reasoning_stream(plan.reasoning_parser, plan.prompt_ends_in_reasoning) \
            if plan.reasoning_parser is not None else None
        self.tool_parser = plan.tools.new_parser()
        self.constrained_calls = ConstrainedCallStream(plan.tools) if plan.tools.structure is not None else None
        self.content = ""  # the content so far (what the tool parser reads)
        self.num_calls = 0

    def advance(self, text: str, finished: bool) -> dict:
        if self.reasoning is None:
            fields = {"content": text[len(self.content):]} if len(text) > len(self.content) else {}
        else:
            fields = self.reasoning.advance(text, finished)
        self.content += fields.get("content", "")
        if self.constrained_calls is not None:
            fields.pop("content", None)
            entries = self.constrained_calls.advance(self.content)
            if entries:
                fields["tool_calls"] = entries
            self.num_calls = len(self.constrained_calls.calls)
            if finished and not self.num_calls and self.content:  # no call at all: the text, as _calls gives it
                fields["content"] = self.content
        elif self.tool_parser is not None:
            fields.pop("content", None)
            parsed = self.tool_parser.stream(text if self.tool_parser.reads_whole_reply else self.content, finished)
            if parsed.get("content"):
                fields["content"] = parsed["content"]
            calls = [c for c in parsed.get("tool_calls") or [] if c["index"] == 0 or not self.plan.tools.one_call]
            if calls:
                fields["tool_calls"] = calls
                self.num_calls = max(self.num_calls, 1 + max(call["index"] for call in calls))
        return fields
