"""A StructuredOutputsParams checked (its syntax, by the frontends) and compiled (by the engine).

Parsing needs no tokenizer and takes microseconds to milliseconds, so a frontend checks every
spec before submitting its request: an invalid schema, regex or grammar is the request's error
(a 400 from the server), never a failure inside the engine.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

from baryon.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# JSON between its tokens: at most this many whitespace characters in a row (pretty printing
# fits; a model cannot loop on newlines forever, which small models otherwise do).
JSON_MAX_WHITESPACE = 16
# xgrammar's errors start with a log prefix: "[08:04:30] /project/cpp/regex_converter.cc:83: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false:\s*)?")


def _json_schema(spec: StructuredOutputsParams) -> str:
    # json_object: an object, as OpenAI's (xgrammar's builtin JSON grammar allows any value)
    return '{"type": "object"}' if spec.json_object else spec.json


def _ebnf(spec: StructuredOutputsParams) -> str:
    if spec.choice is not None:  # one alternative per string (JSON's escapes are EBNF's)
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    return spec.grammar


# JSON schemas nested deeper than this are refused: xgrammar's conversion grows faster than
# their size (0.1 s at 128 levels, minutes at 900 on the 2-core VM), and real schemas stay far
# below it.
MAX_SCHEMA_DEPTH = 64
# Keywords xgrammar 0.2.8 accepts but does not enforce (its grammar is the same without them, or
# its output breaks them: two fuzzing passes of the server): refused, so that a schema is either
# followed or rejected, never followed in part. (`oneOf` is followed as `anyOf`, as elsewhere:
# the alternatives of the unions that schema generators write exclude each other anyway.)
_UNENFORCED_KEYWORDS = {"uniqueItems": "items that differ from each other",
                        "dependentRequired": "properties required by others",
                        "dependentSchemas": "schemas that apply when a property is present",
                        "not": "a schema the value must not match",
                        "contains": "an item the array must hold",
                        "minContains": "how many items must match `contains`",
                        "maxContains": "how many items may match `contains`",
                        "$dynamicRef": "a dynamic reference",
                        "if": "a condition choosing `then` or `else`"}
# What each JSON type admits, to find `enum` / `const` values that their node's `type` excludes
# (xgrammar follows the listed values and ignores the type).
_TYPE_ADMITS = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
                "null": lambda v: v is None, "object": lambda v: isinstance(v, dict),
                "array": lambda v: isinstance(v, list),
                "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)
                                      or isinstance(v, float) and v.is_integer())}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# String formats xgrammar 0.2.8 enforces (it ignores the others, and then enforces minLength /
# maxLength; beside these it ignores the lengths), and those of them that admit "".
_ENFORCED_FORMATS = {"date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
_FORMATS_ADMITTING_EMPTY = {"uri-reference", "uri-template", "json-pointer"}
# Keywords that only describe a value: what may stand beside a `$ref` or a union, whose other
# siblings xgrammar ignores.
_ANNOTATIONS = {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment",
                "$schema", "$id", "$anchor", "$defs", "definitions", "discriminator"}
# Where a schema holds subschemas: one, a list, or a dict of them.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_DICTS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_schema_support(schema: str) -> None:
    """Raise ValueError for a JSON schema (text) this engine would not follow exactly: one nested
    past MAX_SCHEMA_DEPTH, or using a keyword xgrammar does not enforce."""
    try:
        root = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"not a valid JSON schema: it does not parse as JSON ({e})") from None
    pending = [(root, "the schema", 1)]
    while pending:
        node, where, depth = pending.pop()
        if not isinstance(node, dict):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests subschemas more than {MAX_SCHEMA_DEPTH} levels deep; at most "
                             f"{MAX_SCHEMA_DEPTH} are accepted")
        for keyword, meaning in _UNENFORCED_KEYWORDS.items():
            if keyword in node and (node[keyword] not in (False, None) or keyword == "not"):
                raise ValueError(f"the JSON schema keyword {keyword!r} ({meaning}, at {where}) is not supported: "
                                 f"the structured-output backend (xgrammar) cannot enforce it; remove it")
        for union in ("anyOf", "oneOf"):  # xgrammar compiles an empty one to an empty output
            if node.get(union) == []:
                raise ValueError(f"'{union}' with no schema (at {where}) matches no value; give at least one")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:  # xgrammar then allows only null
            raise ValueError(f"'allOf' with more than one schema (at {where}) is not supported by the "
                             f"structured-output backend (xgrammar); merge them into one schema")
        problem = _node_problem(node, root)
        if problem is not None:
            raise ValueError(f"{problem} (at {where}) is not supported: the structured-output backend (xgrammar) "
                             f"would not enforce it")
        for key in _SUBSCHEMA:
            pending.append((node.get(key), f"{where}.{key}", depth + 1))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                pending.extend((item, f"{where}.{key}[{i}]", depth + 1) for i, item in enumerate(node[key]))
        for key in _SUBSCHEMA_DICTS:
            if isinstance(node.get(key), dict):
                pending.extend((item, f"{where}.{key}.{name}", depth + 1) for name, item in node[key].items())


def _node_problem(node: dict, root: Any) -> str | None:
    """What of one schema node (of the schema `root`) xgrammar 0.2.8 accepts but would not follow
    (found by comparing its grammar's verdicts with a JSON-schema validator's), else None."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "multipleOf" in node and (types != ["integer"] or any(bound in node for bound in _BOUNDS)):
        return "'multipleOf' other than on an integer without minimum / maximum"
    lengths = "minLength" in node or "maxLength" in node
    if lengths and "pattern" in node:
        return "'minLength' / 'maxLength' together with 'pattern'"
    if lengths and node.get("format") in _ENFORCED_FORMATS:
        # a minLength every value of the format meets anyway is fine (pydantic's AnyUrl writes 1)
        met = 0 if node["format"] in _FORMATS_ADMITTING_EMPTY else 1
        if "maxLength" in node or not isinstance(node["minLength"], int) or node["minLength"] > met:
            return f"'minLength' / 'maxLength' together with the format {node['format']!r}"
    enum = node.get("enum")
    if "const" in node and "enum" in node and (not isinstance(enum, list) or node["const"] not in enum):
        return "'const' together with an 'enum' that does not list it"
    listed = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else []
    known = [t for t in types if t in _TYPE_ADMITS]
    if known and any(not any(_TYPE_ADMITS[t](v) for t in known) for v in listed):
        return f"'enum' / 'const' values that 'type' {types} excludes"
    required = node.get("required")
    if isinstance(required, list) and required:
        declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in required if name not in declared]
        if missing:
            return f"'required' naming {missing[0]!r}, which 'properties' does not declare"
    for composite in ("$ref", "anyOf", "oneOf", "allOf"):
        if composite in node:
            beside = sorted(key for key in node if key != composite and key not in _ANNOTATIONS)
            if beside:
                return f"{beside[0]!r} beside {composite!r} (move it into the referenced or listed schemas)"
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"the reference {ref!r} (only JSON pointers inside the schema, '#/...', are followed)"
    if isinstance(ref, str) and not _resolves(root, ref):
        return f"the reference {ref!r}, which leads nowhere in the schema,"
    if isinstance(node.get("pattern"), str):
        construct = unsupported_regex_construct(node["pattern"]) or _unescaped_in_json(node["pattern"])
        if construct is not None:
            return f"'pattern' with {construct}"
    return None


_UNESCAPED = "a literal quote, backslash or control character (xgrammar writes it unescaped into the string)"


def _unescaped_in_json(pattern: str) -> str | None:
    """A pattern that writes a quote, a backslash or a control character as a literal, which
    xgrammar would put unescaped into the JSON string (an invalid reply); None otherwise."""
    position = 0
    while position < len(pattern):
        char = pattern[position]
        if char == "\\":
            escaped = pattern[position + 1:position + 2]
            code = None
            if escaped in ("x", "u"):
                digits = pattern[position + 2:position + (4 if escaped == "x" else 6)]
                code = int(digits, 16) if re.fullmatch(r"[0-9A-Fa-f]+", digits or "-") else None
            if escaped in ('"', "\\") or escaped in "nrtfv0" and escaped or code is not None and (
                    code < 0x20 or code in (0x22, 0x5C)):
                return _UNESCAPED
            position += 2
            continue
        if char == '"' or ord(char) < 0x20:
            return _UNESCAPED
        position += 1
    return None


def _resolves(root: Any, ref: str) -> bool:
    """Whether a local reference ("#" or a JSON pointer "#/a/b") leads to a schema in root."""
    node = root
    for token in ref[2:].split("/") if ref != "#" else []:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return False
    return isinstance(node, (dict, bool))


def unsupported_regex_construct(pattern: str) -> str | None:
    """The first construct of a regular expression that xgrammar ignores or cannot compile
    (lookaround, backreferences, word boundaries, Unicode properties), named, else None."""
    position, in_class = 0, False
    while position < len(pattern):
        char = pattern[position]
        if char == "\\":
            escaped = pattern[position + 1:position + 2]
            if escaped in ("p", "P"):
                return "a Unicode property escape (\\p, \\P)"
            if not in_class and escaped in ("b", "B"):
                return "a word boundary (\\b, \\B)"
            if not in_class and (escaped == "k" or escaped.isdigit() and escaped != "0"):
                return "a backreference"
            if not in_class and escaped in ("A", "Z", "z", "G"):
                return "an anchor escape (\\A, \\Z, \\z, \\G)"
            position += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            position += 2 if pattern[position + 1:position + 2] == "^" else 1
            position += 1 if pattern[position:position + 1] == "]" else 0  # a leading ']' is literal
            continue
        elif pattern.startswith(("(?=", "(?!"), position):
            return "a lookahead ((?=...), (?!...))"
        elif pattern.startswith(("(?<=", "(?<!"), position):
            return "a lookbehind ((?<=...), (?<!...))"
        elif char == "+" and position > 0 and pattern[position - 1] in "*+?}" \
                and pattern[position - 2:position] != "\\" + pattern[position - 1]:
            return "a possessive quantifier (*+, ++, ?+, {n}+)"
        position += 1
    return None


def check_spec(spec: StructuredOutputsParams) -> None:
    """Raise ValueError, naming the field and the problem, when the spec does not parse (or, for a
    JSON schema, would not be followed exactly: see check_schema_support)."""
    problem = _spec_problem(spec.key)
    if problem is not None:
        raise ValueError(problem)


@functools.lru_cache(maxsize=256)
def _spec_problem(key: tuple) -> str | None:
    """check_spec's verdict on the spec of this key (StructuredOutputsParams.key), kept: the server
    checks a request's spec twice (for its error message, then with the other parameters), and
    clients send the same specs again."""
    json_schema, regex, choice, grammar, json_object, _ = key
    spec = StructuredOutputsParams(json=json_schema, regex=regex, choice=None if choice is None else list(choice),
                                   grammar=grammar, json_object=json_object)
    try:
        _check(spec)
    except ValueError as e:
        return str(e)
    return None


def _check(spec: StructuredOutputsParams) -> None:
    import xgrammar as xgr

    if spec.json is not None:
        try:
            check_schema_support(spec.json)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if spec.json is not None or spec.json_object:
        field, parse = "json", lambda: xgr.Grammar.from_json_schema(_json_schema(spec), strict_mode=True)
    elif spec.regex is not None:
        construct = unsupported_regex_construct(spec.regex)
        if construct is not None:
            raise ValueError(f"structured_outputs.regex: {construct} is not supported: the structured-output "
                             f"backend (xgrammar) would not enforce it")
        field, parse = "regex", lambda: xgr.Grammar.from_regex(spec.regex)
    else:
        field, parse = ("choice" if spec.choice is not None else "grammar"), lambda: xgr.Grammar.from_ebnf(_ebnf(spec))
    what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
            "choice": "choice list"}[field]
    try:
        parse()
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"structured_outputs.{field}: not a valid {what}: {_xgrammar_message(e)}") from None
    try:
        empty = _matches_nothing(spec)
    except (RuntimeError, ValueError) as e:  # parsed, yet xgrammar cannot compile it
        raise ValueError(f"structured_outputs.{field}: the structured-output backend (xgrammar) cannot compile "
                         f"this {what}: {_xgrammar_message(e)}") from None
    if empty:
        raise ValueError(f"structured_outputs.{field}: the {what} matches no text (not even an empty "
                         f"output): no token could begin a reply under it")


def _xgrammar_message(error: Exception) -> str:
    """The first line of an xgrammar error, without its log prefix."""
    lines = _LOG_PREFIX.sub("", str(error).strip()).splitlines()
    return lines[0] if lines and lines[0] else "an internal check failed"


def _matches_nothing(spec: StructuredOutputsParams) -> bool:
    """Whether the spec allows neither a first byte nor an empty output, found by compiling it
    over a vocabulary of the 256 bytes and a stop token (~1 ms; xgrammar's own checks pass specs
    such as the regex `[^\\s\\S]`, under which the engine would have no token to sample).
    A spec that allows a start but no end past it is found only while generating: the engine stops
    the request where its grammar allows no token."""
    import xgrammar as xgr

    compiled = compile_spec(_byte_compiler(), spec)
    bitmask = xgr.allocate_token_bitmask(1, _BYTE_VOCAB_SIZE)  # int32 [1, 9]: bit t of word t // 32
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()
    return not any(words[:8]) and not words[8] & 1  # no byte (tokens 0-255) and no stop token (256)


_BYTE_VOCAB_SIZE = 257  # the 256 bytes, then a stop token


@functools.cache
def _byte_compiler() -> xgrammar.GrammarCompiler:
    import xgrammar as xgr

    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=_BYTE_VOCAB_SIZE,
                             stop_token_ids=[_BYTE_VOCAB_SIZE - 1])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # verdicts are kept by _spec_problem


def compile_spec(compiler: xgrammar.GrammarCompiler, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
    """The spec compiled from its text. Not from a parsed Grammar: xgrammar 0.2.8 caches those by
    their printed form and compiles the reprint, whose `\\x` escapes run into the next hex digit
    ("\\xef" + "c" becomes U+0EFC), so non-ASCII literals would match the wrong bytes."""
    if spec.json is not None or spec.json_object:
        return compiler.compile_json_schema(_json_schema(spec), any_whitespace=not spec.disable_any_whitespace,
                                            strict_mode=True, max_whitespace_cnt=JSON_MAX_WHITESPACE)
    if spec.regex is not None:
        return compiler.compile_regex(spec.regex)
    return compiler.compile_grammar(_ebnf(spec))
