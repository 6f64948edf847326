"""A conversation holding tool calls rendered by chat templates of the families that write them
differently: arguments as objects (templates that apply `tojson`), as text (DeepSeek's join them
with `+`), an assistant turn with calls and no content, and Mistral's nine-character call ids."""

from __future__ import annotations

import json

import pytest

from baryon.server.errors import APIError
from baryon.server.inputs import InputProcessor
from baryon.server.protocol import ChatCompletionRequest
from baryon.server.tool_parsers import TOOL_PARSERS

CALL_ID = "call_0123456789abcdef01234567"
ARGUMENTS = '{"city": "Paris", "days": 3}'
MESSAGES = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
            {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny"}]

# Qwen / Llama style: the arguments object through tojson
TOJSON = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }} "
          "{{ c.function.arguments | tojson }}]{% endfor %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
          "{% endfor %}")
# DeepSeek style: content and arguments joined as text
JOINED = ("{% for m in messages %}{% if m['tool_calls'] %}{% for t in m['tool_calls'] %}"
          "{{ m['content'] + '<call>' + t['function']['name'] + '|' + t['function']['arguments'] + '</call>' }}"
          "{% endfor %}{% else %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}")
# Mistral style: call ids of exactly nine characters
NINE = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{% if c.id | length != 9 %}"
        "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
        "[{{ c.id }}]{% endfor %}{% if m.tool_call_id is defined and m.tool_call_id %}"
        "{% if m.tool_call_id | length != 9 %}{{ raise_exception('bad tool_call_id') }}{% endif %}"
        "<{{ m.tool_call_id }}>{% endif %}{{ m.content or '' }}\n{% endfor %}")


def _render(stories_path, template: str, **kwargs) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stories_path)
    inputs = InputProcessor(None, tokenizer, template)
    messages = ChatCompletionRequest.model_validate({"messages": MESSAGES}).messages
    return tokenizer.decode(inputs.chat_prompt(messages, check=False, **kwargs))


def test_arguments_reach_tojson_templates_as_an_object(stories_path):
    text = _render(stories_path, TOJSON)
    rendered = text[text.index("[get_weather ") + len("[get_weather "):text.index("]")]
    assert json.loads(rendered) == json.loads(ARGUMENTS)


def test_templates_joining_arguments_as_text_get_the_text(stories_path):
    """DeepSeek's templates concatenate the arguments (and content) with `+`: an object there is a
    TypeError, so the conversation is rendered again with the arguments as the client sent them;
    the call's missing content is ""."""
    text = _render(stories_path, JOINED)
    assert f"<call>get_weather|{ARGUMENTS}</call>" in text and "tool: sunny" in text


def test_call_ids_cut_to_what_mistral_templates_accept(stories_path):
    with pytest.raises(APIError, match="length 9"):
        _render(stories_path, NINE)
    text = _render(stories_path, NINE, call_id_chars=9)
    assert f"[{CALL_ID[-9:]}]" in text and f"<{CALL_ID[-9:]}>" in text
    # and the ids the mistral parser gives its calls are nine letters and digits already
    reply = TOOL_PARSERS["mistral"]().parse('[TOOL_CALLS][{"name": "f", "arguments": {}}, '
                                            '{"name": "g", "arguments": {}}]')
    assert [len(call.id) for call in reply.tool_calls] == [9, 9]
    assert all(call.id.isalnum() for call in reply.tool_calls) and reply.tool_calls[0].id != reply.tool_calls[1].id
