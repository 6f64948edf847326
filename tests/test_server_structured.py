"""The server's structured outputs, tool calls and template kwargs, through the official openai
client against a real `baryon serve` of stories260K: constrained replies parse and validate,
tool calls come back with ids and finish_reason "tool_calls", streamed deltas reassemble to the
non-streamed reply, and bad specs are 400s that name the field."""

from __future__ import annotations

import json
import random
import re

import httpx
import jsonschema
import openai
import pytest

from tests.test_server import API_KEY, ServerProcess

MODEL = "stories"
# Renders reasoning_effort, the tools' names (stories260K's context is 512 tokens), tool calls, tool results, and a
# closed <think> when enable_thinking is false.
TEMPLATE = (
    "{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n{% endif %}"
    "{%- for m in messages %}{{ m.role }}: {% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
    " <think></think>{% endif %}{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
USER = [{"role": "user", "content": "Lily asked about the weather."}]


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "tools.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess(stories_path, "--api-key", API_KEY, "--served-model-name", MODEL, "--chat-template",
                         str(template), "--max-model-len", "512", "--tool-call-parser", "hermes",
                         "--enable-auto-tool-choice")  # vLLM's flag, accepted
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_format(client, temperature, seed):
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=temperature, seed=seed, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_structured_outputs_extension_on_completions(client, seed):
    regex = r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)"
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=1.0,
                                      seed=seed, n=3, extra_body={"structured_outputs": {"regex": regex}})
    for choice in reply.choices:
        assert re.fullmatch(regex, choice.text) and choice.finish_reason == "stop", choice.text
    reply = client.completions.create(model=MODEL, prompt="The dog", max_tokens=10, temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": {"choice": ["happy", "sad", "sleepy"]}})
    assert reply.choices[0].text in ("happy", "sad", "sleepy")


def test_a_refused_long_stop_list_is_not_sent_back(server):
    response = _post(server, "completions", {"prompt": "a", "stop": [f"{i:04d}" + "x" * 2000 for i in range(1025)]})
    assert response.status_code == 400 and "at most 1024" in response.text
    assert len(response.content) < 2000  # not the 2 MB list


def test_logprobs_of_tokens_a_grammar_rules_out_are_numbers(server, seed):
    """top_logprobs past the tokens a grammar allows list ruled-out tokens (logprob -inf) as -9999.0
    (vLLM's floor), never null, in both routes' shapes."""
    k = random.Random(seed).randint(6, 12)
    body = {"max_tokens": 4, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}}
    chat = _post(server, "chat/completions", {**body, "messages": USER, "logprobs": True, "top_logprobs": k})
    assert chat.status_code == 200, chat.text
    positions = chat.json()["choices"][0]["logprobs"]["content"]
    values = [p["logprob"] for p in positions] + [a["logprob"] for p in positions for a in p["top_logprobs"]]
    completion = _post(server, "completions", {**body, "prompt": "The dog", "logprobs": k})
    assert completion.status_code == 200, completion.text
    logprobs = completion.json()["choices"][0]["logprobs"]
    values += logprobs["token_logprobs"] + [v for top in logprobs["top_logprobs"] for v in top.values()]
    assert all(isinstance(v, float) and -9999.0 <= v <= 0.0 for v in values), values
    assert -9999.0 in values  # k is past the two choices' tokens: ruled-out ones are listed


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_valid_calls(client, stream, seed):
    # One call: stories260K, a tiny model, would go on appending calls to an open array.
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", temperature=0.8, seed=seed,
                  max_tokens=200, parallel_tool_calls=False)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)
    if stream:  # the same seed: the same reply, its calls as deltas
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta_call.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta_call.id or call["id"]
                call["name"] += delta_call.function.name or ""
                call["arguments"] += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert all(c["id"] for c in calls.values())


def test_required_calls_are_an_array_of_the_tools_calls():
    """The constraint of tool_choice=required (several calls allowed) and how its text is read."""
    from baryon.server.protocol import ChatCompletionRequest
    from baryon.server.tool_choice import constrained_calls, plan_tools

    request = ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice="required")
    plan = plan_tools(request, "hermes")
    schema = json.loads(plan.structure.json)
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": ' \
           '{"city": "Oslo", "days": 2}}]'
    jsonschema.validate(json.loads(text), schema)
    with pytest.raises(jsonschema.ValidationError):  # a call's parameters follow its own function's schema
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Oslo", "days": 2}}], schema)
    calls = constrained_calls(plan, text)
    assert [c.arguments for c in calls] == ['{"zone": "UTC"}', '{"city": "Oslo", "days": 2}']  # as written
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert len({c.id for c in calls}) == 2
    # Cut by max_tokens: the calls closed before the cut (a stream has sent them already).
    assert [(c.name, json.loads(c.arguments)) for c in constrained_calls(plan, text[:-5])] == [("get_time", {"zone": "UTC"})]
    assert constrained_calls(plan, text[:20]) == []


@pytest.mark.parametrize("parser", ["hermes", "mistral", "kimi_k2"])
def test_constrained_calls_take_ids_in_the_models_form(parser):
    """The calls the server writes for tool_choice required / a named function get ids of the form
    the model's own calls have (its template writes them back): OpenAI's call_ prefix, Mistral's
    nine letters and digits, Kimi-K2's functions.NAME:INDEX."""
    from baryon.server.protocol import ChatCompletionRequest
    from baryon.server.tool_choice import constrained_calls, plan_tools

    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    required = plan_tools(ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice="required"), parser)
    named = plan_tools(ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), parser)
    ids = [c.id for c in constrained_calls(required, text)] + [c.id for c in constrained_calls(named, '{"city": "Oslo"}')]
    if parser == "kimi_k2":
        assert ids == ["functions.get_time:0", "functions.get_weather:1", "functions.get_weather:0"]
    elif parser == "mistral":
        assert all(i.isalnum() and len(i) == 9 for i in ids) and len(set(ids)) == 3
    else:
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 3


def _streamed(plan, text: str, rng: random.Random) -> tuple[list[list[dict]], list[int]]:
    """ConstrainedCallStream fed `text` in random pieces: each step's delta entries, and where each step ended."""
    from baryon.server.tool_choice import ConstrainedCallStream

    stream, steps, ends, end = ConstrainedCallStream(plan), [], [], 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 6))
        steps.append(stream.advance(text[:end]))
        ends.append(end)
    return steps, ends


def _reassembled(steps: list[list[dict]]) -> dict[int, dict]:
    """OpenAI's client's reading of tool_calls deltas: fields by index, arguments appended."""
    calls: dict[int, dict] = {}
    for entries in steps:
        for entry in entries:
            call = calls.setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in entry:
                assert call["id"] is None and entry["type"] == "function"  # the id and name come once
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            assert call["id"] is not None  # an entry's first delta opens the call
            call["arguments"] += entry["function"]["arguments"]
    return calls


def test_constrained_calls_stream_as_they_are_written(seed):
    """A named call opens with the reply's first text and its arguments follow piece by piece; each
    call of a required array goes out once its object closes; both reassemble to the whole reply's calls."""
    from baryon.server.protocol import ChatCompletionRequest
    from baryon.server.tool_choice import constrained_calls, plan_tools

    rng = random.Random(seed)
    named = plan_tools(ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), "hermes")
    arguments = json.dumps({"city": rng.choice(["Paris", "Oslo", "Lima"]), "days": rng.randint(1, 7)},
                           separators=(",", ":"))
    steps, ends = _streamed(named, arguments, rng)
    assert all(steps), "every piece of the arguments is sent as it comes"
    (call,) = _reassembled(steps).values()
    assert (call["name"], call["arguments"]) == ("get_weather", arguments)
    (whole,) = constrained_calls(named, arguments)
    assert (whole.name, whole.arguments) == ("get_weather", arguments)
    cut = arguments[:rng.randint(1, len(arguments) - 1)]  # max_tokens: the arguments as far as written
    assert [(c.name, c.arguments) for c in constrained_calls(named, cut)] == [("get_weather", cut)]

    required = plan_tools(ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice="required"), "hermes")
    # parameters whose strings hold JSON's own brackets, quotes and escapes, and nested values
    tricky = ['{"a": [1, 2]}', 'x}]', '\\"]', "é ü 日本", "\n\t", "[[{", ""]
    values = [{"name": rng.choice(["get_time", "get_weather"]), "parameters": {
        "zone": "".join(rng.choices("ABCDEFGHIJ", k=3)), "note": rng.choice(tricky),
        "nested": {"list": [rng.choice(tricky), {"k": rng.randint(-9, 9)}], "flag": rng.random() < 0.5}}}
        for _ in range(rng.randint(2, 4))]
    ascii_only = rng.random() < 0.5
    text = json.dumps(values, separators=(",", ":"), ensure_ascii=ascii_only)
    steps, ends = _streamed(required, text, rng)
    closes, position = [], 1
    for value in values:  # where each call's object ends in the text
        position += len(json.dumps(value, separators=(",", ":"), ensure_ascii=ascii_only))
        closes.append(position)
        position += 1
    sent_at = {entry["index"]: end for entries, end in zip(steps, ends) for entry in entries}
    assert [sent_at[i] for i in range(len(values))] == [min(e for e in ends if e >= c) for c in closes]
    calls = _reassembled(steps)
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(v["name"], v["parameters"]) for v in values]
    assert [(c.name, c.arguments) for c in constrained_calls(required, text)] == \
        [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


# A parameters schema with $defs and references, as pydantic writes them (one into $defs, one to
# another property): the required array must keep them resolvable from its own root.
PLACE = {"type": "object", "properties": {"home": {"$ref": "#/$defs/City"}, "away": {"$ref": "#/properties/home"}},
         "required": ["home", "away"], "additionalProperties": False,
         "$defs": {"City": {"enum": ["Paris", "Oslo", "Lima"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "trip"}}])
def test_tool_parameters_with_defs_and_references(client, seed, tool_choice):
    tools = TOOLS + [{"type": "function", "function": {"name": "trip", "parameters": PLACE}}]
    reply = client.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice=tool_choice,
                                           temperature=0.8, seed=seed, max_tokens=120, parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls", reply
    jsonschema.validate(json.loads(call.function.arguments), {**SCHEMAS, "trip": PLACE}[call.function.name])


def test_named_tool_choice(client, seed):
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=80,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    reply = client.chat.completions.create(**kwargs)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and reply.choices[0].finish_reason == "tool_calls"
    _check_calls([call])
    # Streamed (the same seed, the same reply): the call opens with its first text, its arguments
    # follow in the chunks that bring more (how many tokens a chunk holds is the server's timing;
    # the piecewise sending itself: test_constrained_calls_stream_as_they_are_written).
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    entries = [entry for chunk in chunks for entry in chunk.choices[0].delta.tool_calls or []]
    assert entries[0].id and entries[0].function.name == "get_time"
    assert all(entry.index == 0 and entry.id is None and entry.function.arguments for entry in entries[1:])
    assert "".join(entry.function.arguments for entry in entries) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for chunk in chunks[1:-1]:  # after the role's chunk, none is empty
        assert chunk.choices[0].delta.tool_calls or chunk.choices[0].delta.content, chunk


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_keeps_one_call_when_parallel_calls_are_off(client, stream):
    """Two calls in the model's (Hermes) format: both come back by default, the first alone with
    parallel_tool_calls false (as vLLM), streamed or not."""
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=250,
                  extra_body={"structured_outputs": {"regex": call + call}})
    for parallel, count in ((None, 2), (False, 1)):
        options = {} if parallel is None else {"parallel_tool_calls": parallel}
        if not stream:
            choice = client.chat.completions.create(**kwargs, **options).choices[0]
            calls, finish = choice.message.tool_calls, choice.finish_reason
            names = [c.function.name for c in calls]
            arguments = [c.function.arguments for c in calls]
        else:
            entries, finish = [], None
            for chunk in client.chat.completions.create(**kwargs, **options, stream=True):
                entries += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
            names = [e.function.name for e in entries if e.function.name]
            arguments = ["".join(e.function.arguments or "" for e in entries if e.index == i) for i in range(len(names))]
            assert all(e.index < count for e in entries)
        assert finish == "tool_calls" and names == ["get_time"] * count
        for text in arguments:
            jsonschema.validate(json.loads(text), TIME)


def test_reasoning_effort_reaches_the_template(client):
    """OpenAI's reasoning_effort becomes the chat template's reasoning_effort (GPT-OSS's template
    reads it), as chat_template_kwargs would set it; conflicting values and unknown ones are 400s."""
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0)
    high = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0,
                                          reasoning_effort="high")
    by_kwargs = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0,
                                               extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens  # the template wrote "Reasoning: high"
    assert high.usage.prompt_tokens == by_kwargs.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="differ"):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, reasoning_effort="low",
                                       extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, reasoning_effort="extreme")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_format(client, stream):
    """A reply in Hermes' format (forced here by a regex, as a model would write it) becomes a call."""
    regex = r'Sure\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=120,
                  extra_body={"structured_outputs": {"regex": regex}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _check_calls([call])
        return
    content, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Sure." and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_tool_results_and_template_kwargs_reach_the_template(client):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    plain = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    no_thinking = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4,
                                                 temperature=0,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert no_thinking.usage.prompt_tokens > plain.usage.prompt_tokens  # the template added <think></think>


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


DEEP_SCHEMA = _nested_arrays(900)  # xgrammar would take minutes on it


@pytest.mark.parametrize("route, body, param, words", [
    ("chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format", "not a valid JSON schema"),
    ("chat/completions", {"messages": USER, "structured_outputs": {"regex": "a(b"}}, "structured_outputs",
     "not a valid regular expression"),
    ("completions", {"prompt": "a", "structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs",
     "not a valid EBNF grammar"),
    ("completions", {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ("completions", {"prompt": "a", "structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs",
     "matches no text"),
    ("chat/completions", {"messages": USER, "response_format": {"type": "json_object"},
                          "structured_outputs": {"regex": "a"}}, "structured_outputs", "not both"),
    ("chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "get_stock"}}}, "tool_choice", "get_stock"),
    ("chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("completions", {"prompt": "a", "structured_outputs": {"regex": ""}}, "structured_outputs",
     "structured_outputs.regex must be"),  # named as the request names it, not as the Python class
    ("completions", {"prompt": "a", "structured_outputs": {"regex": "(?=a)ab"}}, "structured_outputs",
     "a lookahead"),
    ("chat/completions", {"messages": USER, "min_tokens": 600}, "min_tokens", "the context leaves"),
    ("chat/completions", {"messages": USER, "min_tokens": 100, "max_completion_tokens": 50}, "min_tokens",
     "must not exceed max_completion_tokens=50"),  # the field as the request named it
    ("completions", {"prompt": "a", "min_tokens": 40}, "min_tokens", "set max_tokens too"),
    ("chat/completions", {"messages": [{"role": "assistant"}]}, None, "an assistant message needs content"),
    ("chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ("completions", {"prompt": "a", "tools": TOOLS}, None, "tools"),
    ("chat/completions", {"messages": USER, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ("chat/completions", {"messages": USER, "chat_template_kwargs": {"return_tensors": "np"}}, "chat_template_kwargs",
     "return_tensors"),
    ("chat/completions", {"messages": USER, "chat_template_kwargs": {"truncation": True, "max_length": 1}},
     "chat_template_kwargs", "truncation"),
    ("chat/completions", {"messages": USER, "tools": TOOLS + TOOLS[:1]}, "tools", "more than once"),
    ("chat/completions", {"messages": USER, "tool_choice": "required", "tools": TOOLS[:1] + [{"type": "function",
     "function": {"name": "f", "parameters": {"type": "objectx"}}}]}, "tools",
     "tools[1].function.parameters: not a valid JSON schema"),
    ("chat/completions", {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}},
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                              "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]},
     "tools", "tools[0].function.parameters: the JSON schema keyword 'uniqueItems'"),
    ("completions", {"prompt": "a", "structured_outputs": {"json": DEEP_SCHEMA}}, "structured_outputs", "levels deep"),
    ("chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}}}},
     "response_format", "'uniqueItems'"),
    # xgrammar 0.2.8 allows only null under allOf with two schemas, and ignores contains and not
    ("completions", {"prompt": "a", "structured_outputs": {"json": {"allOf": [{"type": "integer"}, {"minimum": 5}]}}},
     "structured_outputs", "'allOf'"),
    ("completions", {"prompt": "a", "structured_outputs": {"json": {"type": "array", "contains": {"const": 7}}}},
     "structured_outputs", "'contains'"),
    ("completions", {"prompt": "a", "structured_outputs": {"json": {"not": {}}}}, "structured_outputs", "'not'"),
    ("completions", {"prompt": "a", "structured_outputs": {"json": {"anyOf": []}}}, "structured_outputs",
     "matches no value"),
    ("chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": DEEP_SCHEMA}}}}]}, "tools", "levels deep"),
    ("completions", {"prompt": "a", "structured_outputs": {"choice": [f"c{i}" for i in range(1025)]}},
     "structured_outputs", "at most 1024"),
])
def test_bad_specs_are_400s(server, route, body, param, words):
    response = _post(server, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error


def test_a_slow_constraint_check_holds_only_its_own_request(monkeypatch):
    """A request's output constraint is checked on threads of its own before the request is
    prepared: while one check runs (here held until released; 1,024 long choices took 15 s), other
    requests are prepared (the fuzzing pass of session 33 saw a plain request wait 7.7 s)."""
    import asyncio
    import threading

    from baryon.server import serving
    from baryon.server.protocol import CompletionRequest

    release, started = threading.Event(), threading.Event()

    def held_check(spec):
        started.set()
        assert release.wait(30)

    monkeypatch.setattr(serving, "check_spec", held_check)
    ctx = serving.ServerContext(config=None, client=None, inputs=None, metrics=None, model_names=[MODEL])
    constrained = CompletionRequest(model=MODEL, prompt="x", structured_outputs={"choice": ["a", "b"]})
    plain = CompletionRequest(model=MODEL, prompt="y")

    async def scenario():
        checking = asyncio.ensure_future(ctx.check_constraints(constrained))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        await ctx.check_constraints(plain)  # nothing to check: returns at once
        prepared = await asyncio.wait_for(ctx.prepare(lambda: "prepared"), 10)
        assert not checking.done()  # the constrained request's check still holds
        release.set()
        await asyncio.wait_for(checking, 10)
        return prepared

    try:
        assert asyncio.run(scenario()) == "prepared"
    finally:
        release.set()
        ctx.preparer.shutdown()
        ctx.spec_checker.shutdown()


# A <think> template: the generation prompt opens the reasoning, or (enable_thinking false) closes it.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %} <think></think>{% else %} <think>{% endif %}")


def _serve_thinking(stories_path, tmp_path_factory, reasoning_parser: str):
    """A server of THINKING_TEMPLATE under `reasoning_parser` (a fixture's generator)."""
    template = tmp_path_factory.mktemp(f"thinking_{reasoning_parser}") / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    proc = ServerProcess(stories_path, "--served-model-name", MODEL, "--chat-template", str(template),
                         "--max-model-len", "512", "--reasoning-parser", reasoning_parser)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def thinking_server(stories_path, tmp_path_factory):
    yield from _serve_thinking(stories_path, tmp_path_factory, "qwen3")


def test_a_constrained_reply_of_a_reasoning_model_thinks_first(thinking_server):
    """With a <think> reasoning parser a response_format starts after `</think>`: the model's
    reasoning before it is its own (here it never closes it within max_tokens: all reasoning, no
    content); where the prompt has closed the reasoning (enable_thinking false) the reply is
    constrained from its first token and is all content."""
    body = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 12,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "integer", "minimum": 100, "maximum": 999}}}}
    thinking = httpx.post(f"{thinking_server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert thinking["finish_reason"] == "length" and not thinking["message"]["content"]
    assert re.search(r"[A-Za-z]", thinking["message"]["reasoning_content"])  # free text, not the integer
    closed = httpx.post(f"{thinking_server.url}/v1/chat/completions", timeout=60,
                        json={**body, "chat_template_kwargs": {"enable_thinking": False}}).json()["choices"][0]
    assert closed["finish_reason"] == "stop" and not closed["message"].get("reasoning_content")
    assert 100 <= json.loads(closed["message"]["content"]) <= 999


@pytest.fixture(scope="module")
def r1_thinking_server(stories_path, tmp_path_factory):
    yield from _serve_thinking(stories_path, tmp_path_factory, "deepseek_r1")


def test_a_prompt_that_closes_the_reasoning_gets_content(r1_thinking_server):
    """deepseek_r1 reads a reply as starting inside the reasoning, which the template opened in
    the prompt; where the prompt closed it instead (DeepSeek-V3.1's non-thinking mode,
    enable_thinking false here) the reply is all content, whole and streamed."""
    body = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 12}
    url = f"{r1_thinking_server.url}/v1/chat/completions"
    thinking = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
    assert thinking["reasoning_content"] and not thinking["content"]  # (stories260K never writes </think>)
    closed_body = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    closed = httpx.post(url, json=closed_body, timeout=60).json()["choices"][0]["message"]
    assert closed["content"] and not closed.get("reasoning_content")
    streamed = ""
    with httpx.stream("POST", url, json={**closed_body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                delta = choices[0]["delta"] if choices else {}
                assert not delta.get("reasoning_content")
                streamed += delta.get("content") or ""
    assert streamed == closed["content"]
