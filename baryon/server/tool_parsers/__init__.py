"""Tool-call parsers: a chat reply split into content and OpenAI-style tool calls, whole
(`ToolParser.parse`) or streamed as deltas (`ToolParser.stream`). One module per reply format;
names follow vLLM's `--tool-call-parser`."""

from __future__ import annotations

from baryon.server.tool_parsers.base import ParsedReply, ToolCall, ToolParser
from baryon.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from baryon.server.tool_parsers.deepseek_v32 import DeepSeekV32ToolParser
from baryon.server.tool_parsers.glm45 import Glm45ToolParser
from baryon.server.tool_parsers.harmony import HarmonyToolParser
from baryon.server.tool_parsers.hermes import HermesToolParser
from baryon.server.tool_parsers.kimi_k2 import KimiK2ToolParser
from baryon.server.tool_parsers.llama3_json import Llama3JsonToolParser
from baryon.server.tool_parsers.mistral import MistralToolParser

__all__ = ["TOOL_PARSERS", "ParsedReply", "ToolCall", "ToolParser", "default_tool_parser", "required_tool_parser"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                       DeepSeekV3ToolParser, DeepSeekV32ToolParser, Glm45ToolParser,
                                       HarmonyToolParser, KimiK2ToolParser)}
TOOL_PARSERS["harmony"] = HarmonyToolParser

_BY_MODEL_TYPE = {
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "qwen2_vl_text": "hermes", "qwen2_5_vl_text": "hermes", "qwen3_vl_text": "hermes",  # (their language models)
    "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral",
    # DeepSeek-V2.5 / V2-Chat write V3's tool-call markers
    "deepseek_v2": "deepseek_v3", "deepseek_v3": "deepseek_v3", "deepseek_v32": "deepseek_v32", "gpt_oss": "openai",
    "glm4_moe": "glm45", "kimi_k2": "kimi_k2",  # (Kimi-K2: DeepseekV3ForCausalLM checkpoints)
}


def default_tool_parser(model_type: str | None) -> str | None:
    """The parser a model's replies need, by its Hugging Face `model_type` (None: no default)."""
    return _BY_MODEL_TYPE.get(model_type) if model_type else None


def required_tool_parser(given: str | None, model_type: str | None) -> str:
    """The parser `--enable-auto-tool-choice` needs: the one given, else the family's default;
    a ValueError naming the way out where there is none."""
    parser = given or default_tool_parser(model_type)
    if parser is None:
        raise ValueError(f"--enable-auto-tool-choice: no tool-call parser for this model (model_type "
                         f"{model_type!r} has no default); give --tool-call-parser, one of {sorted(TOOL_PARSERS)}")
    return parser
