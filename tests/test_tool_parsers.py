"""Tool-call parsers: each format's replies (content and calls, several calls, plain text, malformed
calls left as text, unicode arguments) parsed whole, and streamed in random pieces whose deltas add
up to the whole reply's parse; plus random replies built from valid and broken calls."""

from __future__ import annotations

import json
import random

import pytest

from baryon.server.tool_parsers import (
    TOOL_PARSERS,
    ParsedReply,
    ToolParser,
    default_tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
UNICODE = {"text": "Grüße aus Zürich 🌧", "to": "日本語", "quote": "\"¿qué?\""}
UNICODE_PLAIN = {k: v for k, v in UNICODE.items() if k != "quote"}


def hermes_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def coder_call(name: str, arguments: dict) -> str:
    """Qwen3-Coder's call (hermes tags, an XML body): strings as text, other values as JSON."""
    parameters = "".join(f"<parameter={key}>\n"
                         f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}\n</parameter>\n"
                         for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def deepseek_call(name: str, arguments: dict) -> str:
    return ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + name + "\n```json\n"
            + json.dumps(arguments, ensure_ascii=False) + "\n```<｜tool▁call▁end｜>")


DSML_BEGIN, DSML_END = "<｜DSML｜function_calls>\n", "</｜DSML｜function_calls>"


def dsml_call(name: str, arguments: dict) -> str:
    """DeepSeek-V3.2's call: strings as text (string="true"), other values as JSON."""
    parameters = "".join(
        f'<｜DSML｜parameter name="{key}" string="true">{value}</｜DSML｜parameter>\n' if isinstance(value, str)
        else f'<｜DSML｜parameter name="{key}" string="false">{json.dumps(value, ensure_ascii=False)}</｜DSML｜parameter>\n'
        for key, value in arguments.items())
    return f'<｜DSML｜invoke name="{name}">\n{parameters}</｜DSML｜invoke>\n'


KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def kimi_call(name: str, arguments: dict, index: int = 0) -> str:
    return (f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"
            + json.dumps(arguments, ensure_ascii=False) + "<|tool_call_end|>")


def glm_call(name: str, arguments: dict) -> str:
    """GLM-4.5's call: strings as text, other values as JSON."""
    pairs = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>"
                    f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}</arg_value>\n"
                    for key, value in arguments.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def harmony_call(name: str, arguments: dict, recipient_first: bool = False) -> str:
    body = json.dumps(arguments, ensure_ascii=False)
    if recipient_first:
        return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{body}<|call|>"
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{body}<|call|>"


def harmony_message(channel: str, body: str) -> str:
    return f"<|start|>assistant<|channel|>{channel}<|message|>{body}<|end|>"


THINK = "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"

# (parser, reply, content, [(name, arguments)])
CASES = [
    # hermes
    ("hermes", "Let me check the weather.\n\n" + hermes_call("get_weather", WEATHER),
     "Let me check the weather.", [("get_weather", WEATHER)]),
    ("hermes", hermes_call("get_weather", WEATHER) + "\n" + hermes_call("get_time", {"tz": "CET"}),
     None, [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    ("hermes", "The answer: 4 < 5, <b>bold</b> and </tool_call> stay.\n",
     "The answer: 4 < 5, <b>bold</b> and </tool_call> stay.\n", []),
    ("hermes", '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
     '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>', []),
    ("hermes", "First: <tool_call>{oops}</tool_call>\n" + hermes_call("f", {"x": [1, 2.5, None]}),
     "First: <tool_call>{oops}</tool_call>", [("f", {"x": [1, 2.5, None]})]),
    ("hermes", hermes_call("f", {}) + "\n\nDone, see above.", "Done, see above.", [("f", {})]),
    ("hermes", "\n\n" + hermes_call("f", {}) + "\n\nDone.", "Done.", [("f", {})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, [("f", {"a": 1})]),  # unclosed
    ("hermes", 'Hmm <tool_call>\n{"name": "f", "argum', 'Hmm <tool_call>\n{"name": "f", "argum', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
    ("hermes", "Übersetze: " + hermes_call("translate", UNICODE), "Übersetze:", [("translate", UNICODE)]),
    ("hermes", "ends with <tool_", "ends with <tool_", []),
    # hermes: Qwen3-Coder's XML bodies
    ("hermes", "Let me check.\n" + coder_call("get_weather", WEATHER), "Let me check.", [("get_weather", WEATHER)]),
    ("hermes", coder_call("a", {"x": 1, "y": [1, {"z": None}], "s": "two\nlines"}) + "\n" + hermes_call("b", {}), None,
     [("a", {"x": 1, "y": [1, {"z": None}], "s": "two\nlines"}), ("b", {})]),
    ("hermes", coder_call("translate", UNICODE_PLAIN), None, [("translate", UNICODE_PLAIN)]),
    ("hermes", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nstray\n</function>\n</tool_call>",
     "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nstray\n</function>\n</tool_call>", []),
    ("hermes", "ok <tool_call>\n<function=f>\n<parameter=a>\n1", "ok <tool_call>\n<function=f>\n<parameter=a>\n1",
     []),  # cut off: content
    # llama3_json
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    ("llama3_json", ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
                     "\n\nThe tool will answer."), "The tool will answer.", [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z"}}',
     None, [("a", {"x": 1}), ("b", {"y": "z"})]),
    ("llama3_json", "The weather in Paris is {usually} mild.", "The weather in Paris is {usually} mild.", []),
    ("llama3_json", '  Sure: {"name": "x", "parameters": {}}', '  Sure: {"name": "x", "parameters": {}}', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}',
     '{"name": "get_weather", "parameters": {"city": "Paris"}', []),
    ("llama3_json", '{"city": "Paris"} is JSON', '{"city": "Paris"} is JSON', []),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": oops}', '; {"name": oops}', [("a", {})]),
    ("llama3_json", json.dumps({"name": "translate", "parameters": UNICODE}, ensure_ascii=False),
     None, [("translate", UNICODE)]),
    # mistral
    ("mistral", 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     "Let me look.", [("get_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
     None, [("a", {"x": 1}), ("b", {})]),
    ("mistral", ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                 '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}'), "Sure.",
     [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "celsius"}',
     None, [("get_weather", WEATHER)]),
    ("mistral", "Arrays look like [1, 2] and tags like [INST] or [TOOL_CALL.",
     "Arrays look like [1, 2] and tags like [INST] or [TOOL_CALL.", []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {]', '[TOOL_CALLS][{"name": "a", "arguments": {]', []),
    ("mistral", '[TOOL_CALLS][{"name": "a"}, {"arguments": {}}]', '[TOOL_CALLS][{"name": "a"}, {"arguments": {}}]', []),
    ("mistral", '[TOOL_CALLS]bad name[ARGS]{"x": 1}[TOOL_CALLS]f[ARGS]{}',
     '[TOOL_CALLS]bad name[ARGS]{"x": 1}', [("f", {})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": }[TOOL_CALLS]g[ARGS]{"y": 2}', '[TOOL_CALLS]f[ARGS]{"x": }', [("g", {"y": 2})]),
    ("mistral", "[TOOL_CALLS]translate[ARGS]" + json.dumps(UNICODE, ensure_ascii=False), None, [("translate", UNICODE)]),
    # deepseek_v3
    ("deepseek_v3", "Let me check.\n\n" + DS_BEGIN + deepseek_call("get_weather", WEATHER) + DS_END,
     "Let me check.", [("get_weather", WEATHER)]),
    ("deepseek_v3", DS_BEGIN + deepseek_call("a", {"x": 1}) + "\n" + deepseek_call("b", {}) + DS_END,
     None, [("a", {"x": 1}), ("b", {})]),
    ("deepseek_v3", DS_BEGIN + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "unit": "celsius"}'
     "<｜tool▁call▁end｜>" + DS_END, None, [("get_weather", WEATHER)]),  # V3.1
    ("deepseek_v3", "No tools needed｜ here ▁ <｜tool", "No tools needed｜ here ▁ <｜tool", []),
    ("deepseek_v3", DS_BEGIN + '<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"x": \n```<｜tool▁call▁end｜>' + DS_END,
     '<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"x": \n```<｜tool▁call▁end｜>', []),
    ("deepseek_v3", "ok" + DS_BEGIN + deepseek_call("f", {"a": 1})[:-len("<｜tool▁call▁end｜>")], "ok", [("f", {"a": 1})]),
    ("deepseek_v3", DS_BEGIN + deepseek_call("translate", UNICODE) + DS_END, None, [("translate", UNICODE)]),
    # deepseek_v32 (DSML; V3.2-Exp writes V3.1's calls, read too)
    ("deepseek_v32", "Let me check.\n\n" + DSML_BEGIN + dsml_call("get_weather", WEATHER) + DSML_END,
     "Let me check.", [("get_weather", WEATHER)]),
    ("deepseek_v32", DSML_BEGIN + dsml_call("a", {"x": 1, "y": [1, {"z": None}], "s": "two\nlines"})
     + dsml_call("b", {}) + DSML_END, None, [("a", {"x": 1, "y": [1, {"z": None}], "s": "two\nlines"}), ("b", {})]),
    ("deepseek_v32", DSML_BEGIN + dsml_call("translate", UNICODE) + DSML_END, None, [("translate", UNICODE)]),
    ("deepseek_v32", DSML_BEGIN + '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">not json'
     '</｜DSML｜parameter>\n<｜DSML｜parameter name="q" string="true"> "quoted" </｜DSML｜parameter>\n</｜DSML｜invoke>'
     + DSML_END, None, [("f", {"n": "not json", "q": ' "quoted" '})]),  # text kept as text
    ("deepseek_v32", DSML_BEGIN + '<｜DSML｜invoke name="f">\nstray words\n</｜DSML｜invoke>' + DSML_END,
     '\n<｜DSML｜invoke name="f">\nstray words\n</｜DSML｜invoke>', []),  # not parameters: content
    ("deepseek_v32", "ok" + DSML_BEGIN + '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="false">1',
     'ok\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="false">1', []),  # cut off: content
    ("deepseek_v32", "Plain ｜DSML｜ talk, < and <｜", "Plain ｜DSML｜ talk, < and <｜", []),
    ("deepseek_v32", DS_BEGIN + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "unit": "celsius"}'
     "<｜tool▁call▁end｜>" + DS_END, None, [("get_weather", WEATHER)]),  # V3.2-Exp (V3.1's format)
    ("deepseek_v32", "<｜DSML｜tool_calls>" + dsml_call("a", {"x": 2}) + "</｜DSML｜tool_calls>", None, [("a", {"x": 2})]),
    # kimi_k2 (Kimi-K2)
    ("kimi_k2", "Let me check.\n\n" + KIMI_BEGIN + kimi_call("get_weather", WEATHER) + KIMI_END, "Let me check.",
     [("get_weather", WEATHER)]),
    ("kimi_k2", KIMI_BEGIN + kimi_call("a", {"x": 1}) + kimi_call("search.web", {"q": "k2"}, 1) + KIMI_END, None,
     [("a", {"x": 1}), ("search.web", {"q": "k2"})]),
    ("kimi_k2", "<|tool_call_section_begin|>" + kimi_call("f", {}) + "<|tool_call_section_end|>", None, [("f", {})]),
    ("kimi_k2", KIMI_BEGIN + '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": <|tool_call_end|>'
     + KIMI_END, '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": <|tool_call_end|>', []),
    ("kimi_k2", "ok" + KIMI_BEGIN + kimi_call("f", {"a": 1})[:-len("<|tool_call_end|>")], "ok", [("f", {"a": 1})]),
    ("kimi_k2", "No tools <|tool", "No tools <|tool", []),
    ("kimi_k2", KIMI_BEGIN + "<|tool_call_begin|>functions.:0<|tool_call_argument_begin|>{}<|tool_call_end|>" + KIMI_END,
     "<|tool_call_begin|>functions.:0<|tool_call_argument_begin|>{}<|tool_call_end|>", []),  # no name: no call
    ("kimi_k2", KIMI_BEGIN + kimi_call("translate", UNICODE) + KIMI_END, None, [("translate", UNICODE)]),
    # glm45 (GLM-4.5 / 4.6)
    ("glm45", "Let me check.\n" + glm_call("get_weather", WEATHER), "Let me check.", [("get_weather", WEATHER)]),
    ("glm45", glm_call("a", {"x": 1, "y": [1, {"z": None}]}) + "\n" + glm_call("b", {}), None,
     [("a", {"x": 1, "y": [1, {"z": None}]}), ("b", {})]),
    # (without the tool's schema a text that reads as JSON, UNICODE's '"¿qué?"', is read as JSON)
    ("glm45", glm_call("translate", UNICODE_PLAIN), None, [("translate", UNICODE_PLAIN)]),
    ("glm45", "<tool_call>f\nstray\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
     "<tool_call>f\nstray\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", []),  # a name with a space
    ("glm45", "ok <tool_call>f\n<arg_key>a</arg_key><arg_value>1", "ok <tool_call>f\n<arg_key>a</arg_key><arg_value>1",
     []),  # cut off: content
    # openai (harmony)
    ("openai", THINK + harmony_message("commentary", "Checking the weather.")
     + harmony_call("get_weather", WEATHER, recipient_first=True), "Checking the weather.", [("get_weather", WEATHER)]),
    ("openai", THINK + harmony_call("get_weather", WEATHER) + THINK.replace("<|channel|>", "<|start|>assistant<|channel|>")
     + harmony_call("get_time", {"tz": "CET"}, recipient_first=True), None,
     [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    ("openai", THINK + "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>", "Hello there!", []),
    ("openai", "Just text, no markers.", "Just text, no markers.", []),
    ("openai", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": Paris}<|call|>',
     '{"city": Paris}', []),
    ("openai", "<|channel|>analysis to=python code<|message|>print(1)<|call|>", None, []),  # a built-in tool
    ("openai", "<|channel|>final<|message|>Cut off mid-sentence", "Cut off mid-sentence", []),
    ("openai", harmony_call("translate", UNICODE), None, [("translate", UNICODE)]),
]
CASE_IDS = [f"{parser}-{i}" for i, (parser, *_) in enumerate(CASES)]


def call_pairs(reply: ParsedReply) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in reply.tool_calls]


def stream_in_pieces(parser: ToolParser, text: str, rng: random.Random) -> list[dict]:
    """Feed the reply growing by random steps (inside markers too); the last call is finished."""
    deltas, end = [], 0
    while end < len(text):
        end = min(len(text), end + rng.choice([1, 1, 2, 3, 5, 8, 13, 40]))
        deltas.append(parser.stream(text[:end], finished=end == len(text) and rng.random() < 0.5))
    deltas.append(parser.stream(text, finished=True))
    return deltas


def reassemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Concatenated content and, per index, id / name / concatenated arguments, checking the
    deltas' shape on the way."""
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) <= {"content", "tool_calls"}
        if "content" in delta:
            assert delta["content"]
            content += delta["content"]
        for piece in delta.get("tool_calls", []):
            index = piece["index"]
            if index not in calls:
                assert piece["type"] == "function" and piece["id"] and piece["function"]["name"]
                calls[index] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
            else:
                assert "id" not in piece and set(piece["function"]) == {"arguments"}
            calls[index]["arguments"] += piece["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    assert len({call["id"] for call in calls.values()}) == len(calls)
    return content, [calls[i] for i in range(len(calls))]


@pytest.mark.parametrize("parser_name,reply,content,calls", CASES, ids=CASE_IDS)
def test_parse_a_whole_reply(parser_name, reply, content, calls):
    parsed = TOOL_PARSERS[parser_name]().parse(reply)
    assert parsed.content == content
    assert call_pairs(parsed) == calls
    assert len({call.id for call in parsed.tool_calls}) == len(calls)
    for call in parsed.tool_calls:
        # ids: OpenAI's call_ prefix, nine letters and digits for Mistral (its templates' check), the
        # call's own header for Kimi-K2 (what its template writes back)
        if parser_name == "mistral":
            assert call.id.isalnum() and len(call.id) == 9
        elif parser_name == "kimi_k2":
            assert call.id.startswith(f"functions.{call.name}:")
        else:
            assert call.id.startswith("call_")
        assert "\\u" not in call.arguments  # unicode written as is


@pytest.mark.parametrize("parser_name,reply,content,calls", CASES, ids=CASE_IDS)
def test_streamed_pieces_add_up_to_the_whole(seed, parser_name, reply, content, calls):
    rng = random.Random(seed)
    for _ in range(6):
        parser = TOOL_PARSERS[parser_name]()
        streamed_content, streamed_calls = reassemble(stream_in_pieces(parser, reply, rng))
        parsed = parser.parse(reply)
        assert streamed_content == (parsed.content or "") == (content or "")
        assert [(call["name"], call["arguments"]) for call in streamed_calls] == \
            [(call.name, call.arguments) for call in parsed.tool_calls]
        assert [(call["name"], json.loads(call["arguments"])) for call in streamed_calls] == calls


def test_qwen3_coder_values_are_typed_by_the_tools_schema():
    """Qwen3-Coder writes values untyped: a parameter the tool declares a string keeps its text
    (digits, true, JSON-looking text); others are read as JSON where they are JSON."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "flag": {"type": "string"}, "n": {"type": "integer"}, "obj": {"type": "object"}}}}}]
    reply = ("<tool_call>\n<function=f>\n<parameter=code>\n007\n</parameter>\n<parameter=flag>\ntrue\n"
             "</parameter>\n<parameter=n>\n42\n</parameter>\n<parameter=obj>\n{\"a\": [1]}\n</parameter>\n"
             "<parameter=other>\n3.5\n</parameter>\n</function>\n</tool_call>")
    parsed = TOOL_PARSERS["hermes"](tools).parse(reply)
    assert call_pairs(parsed) == [("f", {"code": "007", "flag": "true", "n": 42, "obj": {"a": [1]}, "other": 3.5})]
    # without the tools: JSON where the text is JSON ("007" is not), else the text
    assert call_pairs(TOOL_PARSERS["hermes"]().parse(reply)) == [
        ("f", {"code": "007", "flag": True, "n": 42, "obj": {"a": [1]}, "other": 3.5})]


def test_unicode_arguments_survive_as_written():
    parsed = TOOL_PARSERS["hermes"]().parse(hermes_call("translate", UNICODE))
    assert parsed.tool_calls[0].arguments == json.dumps(UNICODE, ensure_ascii=False)
    raw = '[TOOL_CALLS]translate[ARGS]{"text":  "Grüße 🌧"}'  # written as a JSON text: kept verbatim
    assert TOOL_PARSERS["mistral"]().parse(raw).tool_calls[0].arguments == '{"text":  "Grüße 🌧"}'


# Arguments as a model may write them, which decoding and re-encoding would change or break: a
# number past float64, NaN, digits beyond a double's, no spaces, a repeated key, and a JSON escape
# of a lone surrogate (which no UTF-8 response can carry once decoded).
RAW_ARGUMENTS = ['{"a": 1e400}', '{"a": NaN}', '{"a": 0.10000000000000000001}', '{"a":1,"b" :[ 2 ]}',
                 '{"a": 1, "a": 2}', '{"a": "\\ud800"}', '{"a": "\\u00e9", "b": "\\""}']


def _raw_replies(name: str, arguments: str) -> dict[str, str]:
    """One call of `name` with `arguments` (JSON text) in each JSON-object format."""
    call = '{"name": "%s", "arguments": %s}' % (name, arguments)
    return {"hermes": f"<tool_call>\n{call}\n</tool_call>", "llama3_json": call,
            "mistral": f"[TOOL_CALLS][{call}, {call}]"}


@pytest.mark.parametrize("arguments", RAW_ARGUMENTS)
def test_arguments_are_kept_as_the_model_wrote_them(seed, arguments):
    rng = random.Random(seed)
    for parser_name, reply in _raw_replies("f", arguments).items():
        parsed = TOOL_PARSERS[parser_name]().parse(reply)
        assert [call.arguments for call in parsed.tool_calls] in ([arguments], [arguments] * 2), parser_name
        for call in parsed.tool_calls:
            call.arguments.encode("utf-8")  # sendable
        _, streamed = reassemble(stream_in_pieces(TOOL_PARSERS[parser_name](), reply, rng))
        assert [call["arguments"] for call in streamed] == [call.arguments for call in parsed.tool_calls]
    # Arguments given as a string holding the object: that string, as before.
    reply = '<tool_call>{"name": "f", "parameters": "{\\"a\\": 1}"}</tool_call>'
    assert TOOL_PARSERS["hermes"]().parse(reply).tool_calls[0].arguments == '{"a": 1}'


@pytest.mark.parametrize("arguments", ['{"x": ' + "1" * 4301 + "}", '{"x": ' + "[" * 3000 + "]" * 3000 + "}",
                                       '"{\\"x\\": ' + "1" * 4301 + '}"'])
def test_json_python_cannot_read_stays_content(arguments):
    """An integer past Python's 4,300 digits or nesting past its recursion limit (a looping model
    can write either) is not a call: it stays content, streamed or not, and nothing raises."""
    for parser_name, reply in _raw_replies("f", arguments).items():
        parsed = TOOL_PARSERS[parser_name]().parse(reply)
        assert parsed.tool_calls == [] and parsed.content == reply, parser_name
        parser = TOOL_PARSERS[parser_name]()
        for end in (len(reply) // 2, len(reply)):
            parser.stream(reply[:end], end == len(reply))


def test_a_name_that_cannot_be_sent_leaves_the_call_as_content():
    for parser_name, reply in _raw_replies("f\\ud800", '{"a": 1}').items():
        parsed = TOOL_PARSERS[parser_name]().parse(reply)
        assert parsed.tool_calls == [] and parsed.content == reply, parser_name


def test_a_call_is_sent_once_it_is_closed():
    parser = TOOL_PARSERS["hermes"]()
    reply = "Checking.\n" + hermes_call("get_weather", WEATHER) + "\nMore."
    closing = reply.index("</tool_call>")
    assert parser.stream(reply[:closing + 5], finished=False) == {"content": "Checking."}
    assert parser.stream(reply[:closing + len("</tool_call>") - 1], finished=False) == {}
    delta = parser.stream(reply[:closing + len("</tool_call>")], finished=False)
    assert delta["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": json.dumps(WEATHER)}
    assert delta["tool_calls"][0]["index"] == 0 and "content" not in delta
    assert parser.stream(reply, finished=False) == {"content": "\nMore."}  # the space before the call, once
    assert parser.stream(reply, finished=True) == {}


def test_what_may_be_a_marker_is_held_back_until_decided():
    parser = TOOL_PARSERS["hermes"]()
    assert parser.stream("Hi <tool_", finished=False) == {"content": "Hi"}  # the space: a call may follow
    assert parser.stream("Hi <tool_", finished=True) == {"content": " <tool_"}
    parser = TOOL_PARSERS["mistral"]()
    assert parser.stream("a [TOOL_CAL", finished=False) == {"content": "a"}
    assert parser.stream("a [TOOL_CALX", finished=False) == {"content": " [TOOL_CALX"}
    parser = TOOL_PARSERS["openai"]()
    assert parser.stream("<|channel|>final<|message|>Hello<|en", finished=False) == {"content": "Hello"}
    assert parser.stream("<|channel|>final<|message|>Hello<|end|>", finished=False) == {}


PLAIN = {"hermes": "{}", "llama3_json": "{}", "mistral": "{}", "deepseek_v3": "{}", "deepseek_v32": "{}", "glm45": "{}",
         "kimi_k2": "{}",
         "openai": THINK + "<|start|>assistant<|channel|>final<|message|>{}<|return|>"}


@pytest.mark.parametrize("parser_name", sorted(PLAIN))
def test_plain_content_streams_as_it_comes(parser_name):
    """Content is sent while it is generated, short of a possible marker's length, not at the end."""
    text = "The quick brown fox jumps over the lazy dog. " * 20
    reply = PLAIN[parser_name].format(text)
    text_start, sent = reply.index(text), ""
    parser = TOOL_PARSERS[parser_name]()
    for end in range(1, text_start + len(text)):
        sent += parser.stream(reply[:end], finished=False).get("content", "")
        assert len(sent) >= end - text_start - 25
    sent += parser.stream(reply, finished=True).get("content", "")
    assert sent == text


def test_enable_auto_tool_choice_needs_a_parser():
    from baryon.server.tool_parsers import required_tool_parser

    assert required_tool_parser(None, "qwen3") == "hermes"
    assert required_tool_parser("mistral", "gemma3") == "mistral"
    with pytest.raises(ValueError, match=r"no tool-call parser for this model \(model_type 'gemma3' has no default\); "
                                         r"give --tool-call-parser, one of \["):
        required_tool_parser(None, "gemma3")


def test_registry_and_defaults():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "deepseek_v3", "deepseek_v32", "glm45",
                                 "openai", "harmony", "kimi_k2"}
    assert TOOL_PARSERS["harmony"] is TOOL_PARSERS["openai"]
    assert all(cls.name in TOOL_PARSERS for cls in TOOL_PARSERS.values())
    expected = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral", "deepseek_v2": "deepseek_v3",
                "deepseek_v3": "deepseek_v3",
                "deepseek_v32": "deepseek_v32", "gpt_oss": "openai", "glm4_moe": "glm45", "kimi_k2": "kimi_k2",
                "qwen2_5_vl_text": "hermes", "qwen3_vl_text": "hermes", "gemma3": None, None: None}
    assert {model_type: default_tool_parser(model_type) for model_type in expected} == expected


# Random replies: text (with marker-like characters), valid calls and broken ones, in any order.
WORDS = ["Sure", "the", "weather", " ", "\n", "<", "[", "{", "}", "|", "｜", "▁", "Zürich", "🌧", "naïve", "to=",
         "<b>", "[1]", "x;y", "\"q\"", "<|", "<tool", "[TOOL"]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))


def random_arguments(rng: random.Random) -> dict:
    return {rng.choice(["city", "q", "n", "ünï", "list"]): rng.choice(["Paris", "東京 🗼", 3, 2.5, [1, "a"], None,
                                                                      {"nested": True}, "a\"b\\c"])
            for _ in range(rng.randint(0, 3))}


def render(parser_name: str, rng: random.Random) -> tuple[str, list[tuple[str, dict]], str]:
    """A random reply, its calls, and the text that is not a call, as written."""
    parts: list[tuple[str, tuple[str, dict] | None]] = []  # (text of the part, the call it is)
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["text", "call", "call", "broken"])
        name, arguments = rng.choice(["get_weather", "f", "search.web", "x_1"]), random_arguments(rng)
        if parser_name == "hermes":
            written = {"text": random_text(rng), "call": hermes_call(name, arguments),
                       "broken": "<tool_call>{" + random_text(rng).replace("</tool_call>", "") + "</tool_call>"}[kind]
        elif parser_name == "mistral":
            written = {"text": random_text(rng).replace("[TOOL", "[TOOl"),
                       "call": "[TOOL_CALLS]" + name + "[ARGS]" + json.dumps(arguments, ensure_ascii=False),
                       "broken": "[TOOL_CALLS]" + name + "[ARGS]{\"unclosed\": [1, }"}[kind]
            if parts and parts[-1][0].startswith("[TOOL_CALLS]") and parts[-1][1] is None and kind == "text":
                kind = "broken"  # text after a broken call belongs to it
        elif parser_name == "deepseek_v3":
            written = {"text": random_text(rng), "call": DS_BEGIN + deepseek_call(name, arguments) + DS_END,
                       "broken": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{]\n```<｜tool▁call▁end｜>"}[kind]
        elif parser_name == "glm45":
            written = {"text": random_text(rng).replace("<tool", "<toOl"), "call": glm_call(name, arguments),
                       "broken": "<tool_call>f g\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"}[kind]
        elif parser_name == "kimi_k2":
            written = {"text": random_text(rng), "call": KIMI_BEGIN + kimi_call(name, arguments, len(parts)) + KIMI_END,
                       "broken": "<|tool_call_begin|>functions.f:9<|tool_call_argument_begin|>{]<|tool_call_end|>"}[kind]
        elif parser_name == "deepseek_v32":
            written = {"text": random_text(rng), "call": DSML_BEGIN + dsml_call(name, arguments) + DSML_END,
                       "broken": '<｜DSML｜invoke name="f">\n{]\n</｜DSML｜invoke>'}[kind]
        else:
            written = {"text": harmony_message(rng.choice(["final", "commentary"]), random_text(rng).replace("|", "")),
                       "call": harmony_call(name, arguments, recipient_first=rng.random() < 0.5),
                       "broken": harmony_call(name, {}).replace("{}", "{oops")}[kind]
            if rng.random() < 0.3:
                parts.append((THINK.replace("<|channel|>", "<|start|>assistant<|channel|>"), None))
        parts.append((written, (name, arguments) if kind == "call" else None))
    reply = "".join(text for text, _ in parts)
    calls = [call for _, call in parts if call is not None]
    if parser_name == "openai":  # content is the bodies of the content messages, as written
        reply = reply.removeprefix("<|start|>assistant")
        plain = "".join(text.split("<|message|>")[1].split("<|")[0] for text, call in parts
                        if call is None and "analysis" not in text)
    else:
        plain = "".join(text for text, call in parts if call is None)
        if parser_name == "deepseek_v3":
            plain = plain.replace(DS_BEGIN, "").replace(DS_END, "")
        if parser_name == "deepseek_v32":
            plain = plain.replace(DSML_BEGIN, "").replace(DSML_END, "")
        if parser_name == "kimi_k2":
            plain = plain.replace(KIMI_BEGIN, "").replace(KIMI_END, "")
    return reply, calls, plain


def without_space(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("parser_name", ["hermes", "mistral", "deepseek_v3", "deepseek_v32", "glm45", "openai",
                                         "kimi_k2"])
def test_random_replies(seed, parser_name):
    rng = random.Random(seed)
    for _ in range(60):
        reply, calls, plain = render(parser_name, rng)
        parsed = TOOL_PARSERS[parser_name]().parse(reply)
        assert call_pairs(parsed) == calls, reply
        assert without_space(parsed.content or "") == without_space(plain), reply
        parser = TOOL_PARSERS[parser_name]()
        content, streamed = reassemble(stream_in_pieces(parser, reply, rng))
        assert content == (parsed.content or ""), reply
        assert [(call["name"], call["arguments"]) for call in streamed] == \
            [(call.name, call.arguments) for call in parsed.tool_calls], reply


def test_random_llama3_replies(seed):
    rng = random.Random(seed)
    for _ in range(60):
        calls = [(rng.choice(["f", "get_weather"]), random_arguments(rng)) for _ in range(rng.randint(1, 3))]
        key = rng.choice(["parameters", "arguments"])
        reply = rng.choice(["", "<|python_tag|>", " "]) + "; ".join(
            json.dumps({"name": name, key: arguments}, ensure_ascii=False) for name, arguments in calls)
        tail = rng.choice(["", "\n\nDone.", "; {\"name\": broken"])
        reply += tail
        parsed = TOOL_PARSERS["llama3_json"]().parse(reply)
        assert call_pairs(parsed) == calls, reply
        assert (parsed.content or "") == tail.strip(), reply
        content, streamed = reassemble(stream_in_pieces(TOOL_PARSERS["llama3_json"](), reply, rng))
        assert content == (parsed.content or "")
        assert [(call["name"], json.loads(call["arguments"])) for call in streamed] == calls


def test_glm_values_are_typed_by_the_tools_schema():
    """GLM writes values without their type: a parameter the tool declares a string stays the text
    even where it reads as JSON ("123", "true"); others are JSON where they are, else text."""
    from baryon.server.tool_parsers import Glm45ToolParser

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "flag": {"type": "string"}, "count": {"type": "integer"}}}}}]
    reply = ("<tool_call>lookup\n<arg_key>zip</arg_key>\n<arg_value>01234</arg_value>\n<arg_key>flag</arg_key>\n"
             "<arg_value>true</arg_value>\n<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n<arg_key>note</arg_key>\n"
             "<arg_value>plain words</arg_value>\n</tool_call>")
    (typed,) = Glm45ToolParser(tools).parse(reply).tool_calls
    assert json.loads(typed.arguments) == {"zip": "01234", "flag": "true", "count": 3, "note": "plain words"}
    (untyped,) = Glm45ToolParser().parse(reply).tool_calls
    assert json.loads(untyped.arguments)["flag"] is True  # no schema: JSON where it reads as JSON
