"""The request bodies the server accepts (pydantic, OpenAI's field names).

Every model forbids unknown fields, so a field we do not implement is a 400 that names it,
and validates strictly: a string where a number belongs is an error, never converted.
Non-finite numbers (NaN, Infinity) are refused. Values are checked further when they become
SamplingParams (a ValueError there is a 400 too).

Extensions beyond OpenAI's API, as vLLM names them: top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos, skip_special_tokens.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# Integers are bounded to int64 so no value can overflow a tensor in the engine.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenIds = list[Int64]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = Field(False, description="Send a last chunk with the usage and no choices")


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


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="Text, a list of texts, token ids, or a list of token-id lists (one choice set each)")
    max_tokens: Int64 | None = Field(None, description="New tokens per choice (default 16)")
    logprobs: Int64 | None = Field(None, description="Top logprobs per token (0 = the chosen token only)")
    echo: bool | None = Field(None, description="Prepend the prompt to the text (and its logprobs)")


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextContentPart]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = Field(None, description="New tokens per choice (default: until the context is full)")
    max_tokens: Int64 | None = Field(None, description="Deprecated name of max_completion_tokens")
    logprobs: bool | None = Field(None, description="Return the chosen tokens' logprobs")
    top_logprobs: Int64 | None = Field(None, description="Alternatives per token (needs logprobs: true)")


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
