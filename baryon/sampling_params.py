"""SamplingParams: how to pick each new token and when to stop (vLLM's names and meanings)."""

from __future__ import annotations

import dataclasses
import json as json_module
from dataclasses import dataclass, field
from typing import Any

from baryon.tokenizer import unpaired_surrogate

# Temperatures below this are treated as greedy decoding (argmax).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a language (vLLM's names); give exactly one of:

    - ``json``: a JSON schema (a dict or its JSON text): the output is a JSON value it validates;
    - ``json_object=True``: any JSON object;
    - ``regex``: the output matches the regular expression (whole output);
    - ``choice``: the output is one of these strings;
    - ``grammar``: an EBNF grammar (xgrammar's dialect, GBNF-like: ``root ::= ...``).

    ``disable_any_whitespace`` makes JSON output compact (no free whitespace between tokens).
    ``reasoning_end``: token ids after which the constraint starts (a reasoning model's end of
    thinking, ``</think>``): the output is free until it holds them in a row, the language after.
    Syntax (a schema that is not JSON, an unclosed group in a regex) is checked when a request
    is submitted (`structured_output.grammar.check_spec`); here only the shape.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    reasoning_end: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if isinstance(self.json, dict):
            self.json = json_module.dumps(self.json)
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON schema (a dict or JSON text), "
                             f"not {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise ValueError(f"StructuredOutputsParams.choice has {len(self.choice)} strings; at most {MAX_CHOICES} "
                             f"are accepted (xgrammar's compilation grows with the square of the list: 20,000 took "
                             f"7.5 s); use a regex or grammar for larger sets")
        if self.json_object not in (None, True, False) or not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("StructuredOutputsParams.json_object and disable_any_whitespace must be true or false")
        if self.reasoning_end is not None:
            ids = self.reasoning_end
            if not isinstance(ids, (list, tuple)) or not ids or \
                    not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError("StructuredOutputsParams.reasoning_end must be a non-empty list of token ids")
            self.reasoning_end = list(ids)

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (equal keys share one compilation; reasoning_end
        only says where it starts)."""
        choice = tuple(self.choice) if self.choice is not None else None
        return (self.json, self.regex, choice, self.grammar, bool(self.json_object), self.disable_any_whitespace)


# Strings a choice constraint may list (xgrammar compiles 1,024 in tens of milliseconds).
MAX_CHOICES = 1024
# Stop strings a request may list: each is searched for in every new piece of text (100,000 of
# them held a server's output processing, /health included, for seconds; OpenAI takes 4).
MAX_STOP_STRINGS = 1024
# The sampler computes in float32: parameters it divides or multiplies by must stay finite and
# nonzero there.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32



@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters.

    Every field is validated on construction; a bad value raises ``ValueError`` that names the
    field, the value given and what is accepted.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: until the context (max_model_len) is full
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Derived: the stop strings as a list (empty when none).
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        else:
            raise self._invalid("stop", "it must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)):
            raise self._invalid("stop_token_ids", "it must be a list of non-negative integer token ids")
        if isinstance(self.structured_outputs, dict):
            known = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
            unknown = sorted(set(self.structured_outputs) - set(known))
            if unknown:
                raise self._invalid("structured_outputs", f"unknown field(s) {unknown}; its fields are {known}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()
        if self.top_k == -1:
            self.top_k = 0
        if self.is_greedy:
            # Greedy ignores the truncation parameters; normalise them so batching code can
            # skip masks nobody asked for.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def _invalid(self, name: str, accepted: str) -> ValueError:
        value = repr(getattr(self, name))
        if len(value) > 200:  # a long list (stop strings) is not sent back whole
            value = value[:200] + f"... ({len(value)} characters)"
        return ValueError(f"SamplingParams.{name}={value} is invalid: {accepted}.")

    def _validate(self) -> None:
        bad = self._invalid

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "it must be an integer >= 1")
        if not is_number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise bad("temperature", f"it must be a number >= 0 (0 means greedy) and at most {FLOAT32_MAX:.4g} "
                                     f"(the sampler divides in float32)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "it must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            raise bad("top_k", "it must be -1 or 0 (all tokens) or an integer >= 1")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "it must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed <= 2**63 - self.n):
            raise bad("seed", "it must be an integer in [-2**63, 2**63 - n] or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2 <= value <= 2:
                raise bad(name, "it must be in [-2, 2]")
        if not is_number(self.repetition_penalty) or not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise bad("repetition_penalty", f"it must be a number > 0 (1 means no penalty) that float32 holds: "
                                            f"between {FLOAT32_TINY:.4g} and {FLOAT32_MAX:.4g}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "it must be an integer >= 1, or unset (None offline: until the context is full)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "it must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"it must not exceed max_tokens={self.max_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise bad("stop", "it must be a non-empty string or a list of non-empty strings")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise bad("stop", f"it lists {len(self.stop_strings)} strings; at most {MAX_STOP_STRINGS} are accepted")
        if any(unpaired_surrogate(s) is not None for s in self.stop_strings):
            raise bad("stop", "its strings must be valid Unicode (an unpaired UTF-16 surrogate is not)")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "it must be a list of non-negative integer token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise bad(name, "it must be an integer >= 0 (number of top alternatives) or None")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "it must be True or False")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "it must be a StructuredOutputsParams (or a dict of its fields) or None")

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of the index-th of n parallel samples (each a separate sequence).

        A seeded request gives sample i the seed ``seed + i`` so the samples differ but the
        whole request stays reproducible.
        """
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)
