"""Prompts in the server: text and chat messages to token ids, checked against the engine's limits.

Text is tokenized as `LLM.generate` does (the tokenizer's special tokens, e.g. BOS, included);
chat messages are rendered with the chat template as `LLM.chat` does. Every refusal is an
APIError 400 that says why.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from baryon.config import EngineConfig
from baryon.engine.core import check_prompt
from baryon.server.errors import bad_request
from baryon.multimodal.inputs import ImageInput, MultiModalInputs
from baryon.multimodal.processor import ImageError, ImageProcessor, load_image
from baryon.server.protocol import ChatMessage, ImageContentPart
from baryon.tokenizer import unpaired_surrogate

# A prompt for the engine: its text (None when given as token ids) and its token ids.
Prompt = tuple[str | None, list[int]]
# transformers' apply_chat_template's own arguments: not template variables, so not settable by
# a request's chat_template_kwargs (the request's fields, or the server, decide them).
_APPLY_CHAT_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "chat_template", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


# chat_template_kwargs nested deeper than this are refused: the template walks nested values
# recursively, and ~600-900 levels exhaust Python's stack (a template variable has no use for such
# depth).
MAX_TEMPLATE_KWARGS_DEPTH = 64
# tools: their parameters schemas, two JSON levels a subschema level, at most 64 of those where
# they constrain a reply (structured_output.grammar.MAX_SCHEMA_DEPTH), and the tool's own wrapping.
MAX_TOOLS_DEPTH = 160


def _nesting_depth(value: Any) -> int:
    """How deep dicts and lists nest in a parsed JSON value (a scalar: 0)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in children)
    return deepest


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a template string too long to be a file name
        pass
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def check_unicode(value: Any, path: str = "") -> None:
    """A 400 naming the first string in a request (a parsed JSON value) that is not valid Unicode:
    JSON may escape one half of a UTF-16 surrogate pair ("\\ud800"), which no tokenizer or UTF-8
    encoder takes."""
    pending = [(value, path)]  # a walk without recursion: a request may nest ~1,000 levels deep
    while pending:
        value, path = pending.pop()
        if isinstance(value, str):
            if (at := unpaired_surrogate(value)) is not None:
                raise bad_request(f"{path or 'the request'}: the text holds an unpaired UTF-16 surrogate "
                                  f"(U+{ord(value[at]):04X}) at character {at}; send valid Unicode",
                                  param=path or None, code="invalid_unicode")
        elif isinstance(value, dict):
            items = list(value.items())
            for key, item in reversed(items):  # reversed: the first offending string is reported
                pending.append((item, f"{path}.{key}" if path else str(key)))
                pending.append((key, path))
        elif isinstance(value, list) and not (value and isinstance(value[0], int)):  # not token ids
            pending.extend((item, f"{path}[{i}]") for i, item in reversed(list(enumerate(value))))


@contextmanager
def _invalid_image() -> Iterator[None]:
    """An ImageError inside becomes the request's 400 `invalid_image`."""
    try:
        yield
    except ImageError as e:
        raise bad_request(str(e), param="messages", code="invalid_image") from None


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any | None, chat_template: str | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._image_processor: ImageProcessor | None = None  # loaded at the first image
        self._image_processor_lock = threading.Lock()  # images are read on several threads

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, and this server runs with --skip-tokenizer-init: "
                              f"give prompts as token ids")
        return self.tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._need_tokenizer("text").encode(text, add_special_tokens=add_special_tokens))

    def completion_prompts(self, prompt: str | list) -> list[Prompt]:
        """The prompts of a completion request: one text, a list of texts, token ids or a list of
        token-id lists."""
        if isinstance(prompt, str):
            prompts = [prompt]
        elif not prompt:
            raise bad_request("'prompt' is an empty list; give text or token ids", param="prompt")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = prompt
        limit = self.config.scheduler.max_num_seqs
        if len(prompts) > limit:  # before tokenizing a million of them
            raise bad_request(f"{len(prompts)} prompts are more than this server runs at once (--max-num-seqs "
                              f"{limit})", param="prompt")
        result = []
        for item in prompts:
            if isinstance(item, str):
                if not item:
                    raise bad_request("'prompt' is empty; give some text or token ids", param="prompt")
                result.append((item, self.tokenize(item)))
            else:
                result.append((None, list(item)))
        for _, ids in result:
            self.check(ids)
        return result

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True, check: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None,
                    call_id_chars: int | None = None) -> list[int]:
        """The token ids of a conversation rendered with the chat template (checked against the
        engine's limits unless check=False). tools: OpenAI tool definitions the template renders
        into the prompt; template_kwargs: more variables for it (e.g. enable_thinking);
        call_id_chars: tool call ids are given to the template cut to their last this many
        characters (Mistral's templates accept nine, as vLLM cuts them).

        Tool calls' arguments reach the template as objects (most templates apply `tojson`);
        a template that joins them to text with `+` (DeepSeek's) fails on an object with a
        TypeError, and the conversation is rendered again with the arguments as text."""
        tokenizer = self._need_tokenizer("chat")
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise bad_request("this model's tokenizer has no chat template; start the server with "
                              "--chat-template FILE (a Jinja template) or use /v1/completions",
                              code="no_chat_template")
        clash = sorted(_APPLY_CHAT_TEMPLATE_ARGUMENTS & set(template_kwargs or {}))
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {clash}: they are arguments of the tokenizer's "
                              f"apply_chat_template, which the server sets; chat_template_kwargs are the "
                              f"template's own variables (e.g. enable_thinking)", param="chat_template_kwargs")
        for value, name, limit in ((template_kwargs, "chat_template_kwargs", MAX_TEMPLATE_KWARGS_DEPTH),
                                   (tools, "tools", MAX_TOOLS_DEPTH)):
            if _nesting_depth(value) > limit:
                raise bad_request(f"{name} nests values more than {limit} levels deep (the chat template renders "
                                  f"them recursively); at most {limit} are accepted", param=name)
        def render(arguments_as_text: bool) -> list[int]:
            return tokenizer.apply_chat_template(
                [_template_message(m, arguments_as_text, call_id_chars) for m in messages], chat_template=template,
                tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False,
                **(template_kwargs or {}))

        try:
            try:
                ids = render(False)
            except TypeError:
                if not any(m.tool_calls for m in messages):
                    raise
                ids = render(True)
        except Exception as e:  # the template is user code: any failure is the request's
            raise bad_request(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                              param="messages") from None
        ids = list(ids)
        if check:
            self.check(ids, param="messages")
        return ids

    @staticmethod
    def image_urls(messages: list[ChatMessage]) -> list[str]:
        """The conversation's image URLs, in order."""
        return [part.image_url.url for m in messages if isinstance(m.content, list)
                for part in m.content if isinstance(part, ImageContentPart)]

    def image_processor(self) -> ImageProcessor:
        """The model's image processor (an APIError 400 for a model that reads no images)."""
        with self._image_processor_lock, _invalid_image():
            if self._image_processor is None:
                self._image_processor = ImageProcessor.for_model(self.config.model.model_path,
                                                                 self.config.model.hf_config)
            return self._image_processor

    @staticmethod
    def load_image(url: str) -> Any:
        """A chat message's image (data: or http(s) URL; never a file path) as a PIL image."""
        with _invalid_image():
            return load_image(url, allow_local_files=False)

    def process_images(self, images: list[Any]) -> list[ImageInput]:
        """Loaded images (PIL) cut into patches by the model's image processor."""
        processor = self.image_processor()
        with _invalid_image():
            return processor.process(images)

    def expand_images(self, prompt_token_ids: list[int], images: list[ImageInput] | None, check: bool = True
                      ) -> tuple[list[int], MultiModalInputs | None]:
        """The rendered conversation with its images' placeholders expanded (None: it has no
        images), checked against the engine's limits where `check`."""
        if not images:
            return prompt_token_ids, None
        processor = self.image_processor()
        with _invalid_image():
            ids, multimodal = processor.expand(prompt_token_ids, images)
        if check:
            self.check(ids, param="messages")
        return ids, multimodal

    def check(self, prompt_token_ids: list[int], param: str = "prompt") -> None:
        try:
            check_prompt(self.config, prompt_token_ids)
        except ValueError as e:
            code = "context_length_exceeded" if len(prompt_token_ids) >= self.max_model_len else None
            raise bad_request(str(e), param=param, code=code) from None

    def max_tokens(self, prompt_token_ids: list[int], requested: int | None, default: int | None,
                   param: str, min_tokens: int | None = None) -> int:
        """New tokens to allow: the requested number, which must fit in the context with the
        prompt, or else the default cut to what fits (None: all that fits); a min_tokens that
        the context cannot hold after the prompt is a 400 saying so."""
        room = self.max_model_len - len(prompt_token_ids)
        if requested is None:
            allowed = room if default is None else min(default, room)
            if isinstance(min_tokens, int) and min_tokens > allowed:
                limit = (f"the {room} tokens the context leaves" if allowed == room
                         else f"the default {param}={allowed}")
                raise bad_request(
                    f"min_tokens={min_tokens} asks for more than {limit} (this model's maximum context length is "
                    f"{self.max_model_len} tokens and the prompt has {len(prompt_token_ids)})"
                    + ("" if allowed == room else f"; set {param} too"), param="min_tokens")
            return allowed
        if requested > room:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_token_ids)} and {param}={requested} asks for {requested} more "
                f"({len(prompt_token_ids) + requested} in all); lower {param} to at most {room}",
                param=param, code="context_length_exceeded")
        return requested


def _template_message(message: ChatMessage, arguments_as_text: bool = False,
                      call_id_chars: int | None = None) -> dict[str, Any]:
    """A message as chat templates read it: content as text ("" for an assistant's tool calls
    without any: templates that join it to text need a string), and tool calls' arguments as an
    object where they parse as one (Llama's and others' templates apply `tojson` to them) unless
    arguments_as_text; call ids cut to their last call_id_chars characters if given."""
    content = message.content
    if isinstance(content, list) and any(isinstance(part, ImageContentPart) for part in content):
        content = [{"type": "image"} if isinstance(part, ImageContentPart) else {"type": "text", "text": part.text}
                   for part in content]  # (the template renders each image's placeholder)
    elif isinstance(content, list):
        content = "\n".join(part.text for part in content)
    if content is None and message.tool_calls:
        content = ""
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id[-call_id_chars:] if call_id_chars else message.tool_call_id
    if message.reasoning_content is not None:
        rendered["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            arguments = call.function.arguments
            if not arguments_as_text:
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
            calls.append({"id": call.id[-call_id_chars:] if call_id_chars else call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        rendered["tool_calls"] = calls
    return rendered
