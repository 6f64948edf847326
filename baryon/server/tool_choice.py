"""What a chat request's `tools` and `tool_choice` ask of the reply, and how its text becomes
tool calls.

- `none` (or no tools): the reply is text; the tools still reach the template, as in vLLM.
- `auto` (the default with tools): the model decides; the server's tool-call parser (by the
  model family, or `--tool-call-parser`) finds the calls in the model's own format (the first
  only when `parallel_tool_calls` is false).
- `required`: the reply is constrained to a JSON array of calls `[{"name": ..., "parameters":
  {...}}]` to the given tools (one call when `parallel_tool_calls` is false), each call's
  parameters to its function's schema.
- a named function: the reply is constrained to that function's arguments object.

Constrained replies are JSON without free whitespace (xgrammar's separators `, ` and `: ` only:
a call needs no more, and small models otherwise spend their tokens on it), read as JSON whatever
the model's own tool-call format; a call's arguments are its parameters as the reply wrote them.
Under `required` each function's parameters schema sits in the array schema's `$defs`, its local
`$ref`s rebased there (xgrammar resolves references from the root), so schemas with `$defs` (as
pydantic writes them) are followed as they are under a named choice.
Streamed as OpenAI streams calls: a named function's call opens with the reply's first text (its
id and name) and its arguments follow as they are written; each call of a `required` array goes
out whole once its object closes. A reply cut short (max_tokens) keeps what was sent: the named
call's arguments as written so far, the array's closed calls.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from baryon.sampling_params import StructuredOutputsParams
from baryon.server.errors import bad_request
from baryon.server.protocol import ChatCompletionRequest
from baryon.server.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser
from baryon.server.tool_parsers.base import decode_json, member_spans
from baryon.structured_output.grammar import check_spec

# The arguments of a function that declares no parameters: any object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    tools: list[dict] | None  # rendered into the prompt by the chat template
    mode: str  # "none", "auto", "required" or "named"
    function: str | None = None  # the named function
    structure: StructuredOutputsParams | None = None  # the constraint of "required" / "named"
    parser: str | None = None  # the tool-call parser ("auto": reads the reply; the others: names calls)
    one_call: bool = False  # "auto" with parallel_tool_calls false: the first parsed call only

    def new_parser(self) -> ToolParser | None:
        return TOOL_PARSERS[self.parser](self.tools) if self.mode == "auto" and self.parser else None

    def call_id(self, function: str, index: int) -> str:
        """The id of a call of a constrained reply, in the form the model's format uses."""
        return (TOOL_PARSERS[self.parser] if self.parser else ToolParser).call_id(function, index)


def plan_tools(request: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """400 for a tool_choice without tools or naming an unknown function, and for tools that
    share a name."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, "none")
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    schemas = {tool.function.name: tool.function.parameters or _ANY_OBJECT for tool in request.tools}
    if len(schemas) < len(request.tools):
        counts = Counter(tool.function.name for tool in request.tools)
        twice = sorted(name for name, count in counts.items() if count > 1)
        raise bad_request(f"tools name the function(s) {twice} more than once; each function needs a name of its own",
                          param="tools")
    if choice == "none":
        return ToolPlan(tools, "none")
    if choice is None or choice == "auto":
        return ToolPlan(tools, "auto", parser=parser, one_call=request.parallel_tool_calls is False)
    if choice == "required":
        array = _calls_schema(schemas, max_items=1 if request.parallel_tool_calls is False else None)
        try:
            check_spec(StructuredOutputsParams(json=array, disable_any_whitespace=True))
        except ValueError as e:  # name the tool whose schema fails alone, else all of them
            for i, (name, schema) in enumerate(schemas.items()):
                _check_parameters(i, _calls_schema({name: schema}))
            raise bad_request(f"tools: {str(e).split(': ', 1)[-1]}", param="tools") from None
        return ToolPlan(tools, "required", structure=StructuredOutputsParams(json=array, disable_any_whitespace=True),
                        parser=parser)
    name = choice.function.name
    if name not in schemas:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"({', '.join(map(repr, schemas))})", param="tool_choice")
    _check_parameters(list(schemas).index(name), schemas[name])
    return ToolPlan(tools, "named", function=name, parser=parser,
                    structure=StructuredOutputsParams(json=schemas[name], disable_any_whitespace=True))


def _calls_schema(schemas: dict[str, Any], max_items: int | None = None) -> dict:
    """The JSON array of calls `required` constrains a reply to: each element one function's name
    and its parameters, whose schema is the root's `$defs/tool_i` (its own `#...` references
    rebased there)."""
    defs = {f"tool_{i}": _rebased(schema, f"#/$defs/tool_{i}") for i, schema in enumerate(schemas.values())}
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/tool_{i}"}},
              "required": ["name", "parameters"]} for i, name in enumerate(schemas)]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "$defs": defs}
    if max_items is not None:
        array["maxItems"] = max_items
    return array


def _rebased(value: Any, base: str) -> Any:
    """A schema with every local reference ("#", "#/...") made relative to `base` instead of its root."""
    if isinstance(value, dict):
        return {key: base + item[1:] if key == "$ref" and isinstance(item, str) and item.startswith("#")
                else _rebased(item, base) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebased(item, base) for item in value]
    return value


def _check_parameters(index: int, schema: Any) -> None:
    """400 naming tools[index] when its parameters schema (as the constraint holds it) is one the
    structured-output backend would not follow."""
    try:
        check_spec(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    except ValueError as e:  # "structured_outputs.json: <the problem>"
        problem = str(e).split(": ", 1)[-1]
        raise bad_request(f"tools[{index}].function.parameters: {problem}", param="tools") from None


def constrained_calls(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The calls of a whole reply constrained by `required` or a named function (the same the
    stream of it sends)."""
    calls = ConstrainedCallStream(plan)
    calls.advance(text)
    return calls.calls


class ConstrainedCallStream:
    """The tool_calls delta entries of a reply constrained by `required` or a named function, as
    its text grows (one instance per streamed choice)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[ToolCall] = []  # every call so far (a named call's arguments as sent)
        self._position = 0  # required: where the array's next call may start

    def advance(self, text: str) -> list[dict]:
        """`text`: the reply so far -> the delta entries new since the last call."""
        return self._named(text) if self.plan.mode == "named" else self._array(text)

    def _named(self, text: str) -> list[dict]:
        if not self.calls:
            if not text:
                return []
            self.calls.append(ToolCall(self.plan.function, text, self.plan.call_id(self.plan.function, 0)))
            call = self.calls[0]
            return [{"index": 0, "id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": text}}]
        call = self.calls[0]
        new = text[len(call.arguments):]
        if not new:
            return []
        call.arguments = text
        return [{"index": 0, "function": {"arguments": new}}]

    def _array(self, text: str) -> list[dict]:
        entries = []
        position = self._position
        while True:
            while position < len(text) and text[position] in "[, \t\r\n":
                position += 1
            decoded = decode_json(text, position) if text[position:position + 1] == "{" else None
            if decoded is None:  # the next call is not closed yet (or the array is)
                break
            value, end = decoded
            if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                    or "parameters" not in value:
                break  # not a call (the grammar allows none; nothing is guessed)
            call = ToolCall(value["name"], text[slice(*member_spans(text, position)["parameters"])],  # as written
                            self.plan.call_id(value["name"], len(self.calls)))
            entries.append({"index": len(self.calls), "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
            self.calls.append(call)
            position = end
        self._position = position
        return entries
