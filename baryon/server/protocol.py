"""The request bodies the server accepts (pydantic, OpenAI's field names).

Every model forbids unknown fields, so a field we do not implement is a 400 that names it,
and validates strictly: a string where a number belongs is an error, never converted.
Non-finite numbers (NaN, Infinity) are refused. Values are checked further when they become
SamplingParams (a ValueError there is a 400 too).

Extensions beyond OpenAI's API, as vLLM names them: top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos, skip_special_tokens, structured_outputs (json, regex,
choice, grammar, json_object), and for chat chat_template_kwargs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Integers are bounded to int64 so no value can overflow a tensor in the engine.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenIds = list[Int64]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = Field(False, description="Send a last chunk with the usage and no choices")


class JsonSchemaFormat(StrictModel):
    name: str = Field(description="The schema's name (OpenAI requires one)")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON schema")
    strict: bool | None = Field(None, description="Follow the schema exactly (always so here)")


class ResponseFormat(StrictModel):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's extension: one of json (a schema), regex, choice, grammar (EBNF), json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class SamplingRequest(StrictModel):
    """The fields completions and chat completions share. None means the default."""

    model: str | None = Field(None, description="A served model name (default: the only model)")
    n: Int64 | None = Field(None, description="Choices per prompt (default 1)")
    temperature: float | None = Field(None, description="0 = greedy (default 1)")
    top_p: float | None = None
    top_k: Int64 | None = Field(None, description="Extension: 0 or -1 = all tokens")
    min_p: float | None = Field(None, description="Extension")
    seed: Int64 | None = None
    stop: str | list[str] | None = Field(None, description="Stop strings, not included in the text")
    stop_token_ids: TokenIds | None = Field(None, description="Extension: token ids that end a choice")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, description="Extension (1 = none)")
    min_tokens: Int64 | None = Field(None, description="Extension: no stop before this many tokens")
    ignore_eos: bool | None = Field(None, description="Extension: keep generating past EOS")
    skip_special_tokens: bool | None = Field(None, description="Extension (default true)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="Extension: constrain the output")


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="Text, a list of texts, token ids, or a list of token-id lists (one choice set each)")
    max_tokens: Int64 | None = Field(None, description="New tokens per choice (default 16)")
    logprobs: Int64 | None = Field(None, description="Top logprobs per token (0 = the chosen token only)")
    echo: bool | None = Field(None, description="Prepend the prompt to the text (and its logprobs)")


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageUrl(StrictModel):
    url: str = Field(description="data:image/<format>;base64,<data> or an http(s) URL")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="Accepted; images are read whole")


class ImageContentPart(StrictModel):
    """An image (image-and-text models): OpenAI's image_url part."""

    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCall(StrictModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text")


class ToolCallMessage(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    """A turn: system / developer / user text, an assistant reply (text and/or the tool calls it
    made), or a tool's result (`tool_call_id` names the call it answers)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart | ImageContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"{'an' if self.role[:1] in 'aeiou' else 'a'} {self.role} message needs content (only an assistant message with tool_calls "
                             "may leave it out)")
        return self


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object")
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = Field(None, description="New tokens per choice (default: until the context is full)")
    max_tokens: Int64 | None = Field(None, description="Deprecated name of max_completion_tokens")
    logprobs: bool | None = Field(None, description="Return the chosen tokens' logprobs")
    top_logprobs: Int64 | None = Field(None, description="Alternatives per token (needs logprobs: true)")
    tools: list[Tool] | None = Field(None, min_length=1, description="Functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (default with tools), required, or a named function")
    parallel_tool_calls: bool | None = Field(None, description="Allow several calls in one reply (default true)")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="How hard a reasoning model thinks: the chat template's reasoning_effort (GPT-OSS)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension: extra variables for the chat template (e.g. enable_thinking)")


class TokenizeRequest(StrictModel):
    """Give `prompt` (text) or `messages` (rendered with the chat template), not both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="For prompt: add BOS etc. (default true)")
    add_generation_prompt: bool | None = Field(None, description="For messages (default true)")


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: TokenIds
