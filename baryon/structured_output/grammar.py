"""A StructuredOutputsParams as an xgrammar Grammar, and the syntax check the frontends run.

Parsing needs no tokenizer and takes microseconds to milliseconds, so a frontend checks every
spec before submitting its request: an invalid schema, regex or grammar is the request's error
(a 400 from the server), never a failure inside the engine.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from baryon.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# JSON between its tokens: at most this many whitespace characters in a row (pretty printing
# fits; a model cannot loop on newlines forever, which small models otherwise do).
JSON_MAX_WHITESPACE = 16
# xgrammar's errors start with a log prefix: "[08:04:30] /project/cpp/regex_converter.cc:83: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def grammar_of(spec: StructuredOutputsParams) -> xgrammar.Grammar:
    """The grammar of the spec's one constraint; ValueError naming the field when it does not parse."""
    import xgrammar as xgr

    if spec.json_object:  # an object, as OpenAI's json_object (the builtin JSON grammar allows any value)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace,
                                            max_whitespace_cnt=JSON_MAX_WHITESPACE)
    if spec.choice is not None:  # one EBNF alternative per string (JSON escapes are EBNF escapes)
        field, build = "choice", lambda: xgr.Grammar.from_ebnf(
            "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    elif spec.json is not None:
        field, build = "json", lambda: xgr.Grammar.from_json_schema(
            spec.json, any_whitespace=not spec.disable_any_whitespace, strict_mode=True,
            max_whitespace_cnt=JSON_MAX_WHITESPACE)
    elif spec.regex is not None:
        field, build = "regex", lambda: xgr.Grammar.from_regex(spec.regex)
    else:
        field, build = "grammar", lambda: xgr.Grammar.from_ebnf(spec.grammar)
    try:
        return build()
    except (RuntimeError, ValueError) as e:
        message = _LOG_PREFIX.sub("", str(e).strip()).splitlines()[0]
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
                "choice": "choice list"}[field]
        raise ValueError(f"structured_outputs.{field}: not a valid {what}: {message}") from None


def check_spec(spec: StructuredOutputsParams) -> None:
    """Raise ValueError, naming the field and the problem, when the spec does not parse."""
    grammar_of(spec)
