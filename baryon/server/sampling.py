"""A request's sampling fields -> SamplingParams, with SamplingParams' own checks as 400s."""

from __future__ import annotations

import re

from baryon.config import EngineConfig
from baryon.engine.llm_engine import check_sampling_params
from baryon.sampling_params import SamplingParams, StructuredOutputsParams
from baryon.server.errors import bad_request
from baryon.server.protocol import SamplingRequest
from baryon.structured_output.grammar import check_spec

_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)=|^(\w+) ")


def requested_structure(request: SamplingRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The output constraint a request asks for (response_format or the structured_outputs
    extension) and the field that asked; a 400 when both do, or when it is malformed."""
    if request.response_format is not None and request.structured_outputs is not None:
        raise bad_request("give response_format or structured_outputs, not both", param="structured_outputs")
    try:
        if request.structured_outputs is not None:
            fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            return StructuredOutputsParams(**fields), "structured_outputs"
        response_format = request.response_format
        if response_format is None or response_format.type == "text":
            return None, None
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=response_format.json_schema.schema_), "response_format"
    except ValueError as e:  # StructuredOutputsParams's own check, named as the request names it
        raise bad_request(str(e).replace("StructuredOutputsParams.", "structured_outputs."),
                          param="structured_outputs" if request.structured_outputs else "response_format") from None


def build_sampling_params(request: SamplingRequest, config: EngineConfig, has_tokenizer: bool, *,
                          max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None,
                          renamed: dict[str, str] | None = None,
                          structure: tuple[StructuredOutputsParams | None, str | None] | None = None) -> SamplingParams:
    """`renamed` maps a SamplingParams field to the request field that set it (for messages).
    structure: the output constraint and the request field it comes from (default: the
    request's response_format / structured_outputs)."""
    structured, structure_field = structure if structure is not None else requested_structure(request)
    if structured is not None:
        if not has_tokenizer:
            raise bad_request(f"{structure_field} needs a tokenizer; this server runs without one",
                              param=structure_field)
        try:
            check_spec(structured)
        except ValueError as e:  # "structured_outputs.json: not a valid JSON schema: ..."
            where, problem = str(e).split(": ", 1)
            if structure_field == "response_format":
                where = "response_format.json_schema.schema"
            raise bad_request(f"{where}: {problem}", param=structure_field) from None
    values = {
        "n": request.n, "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
        "min_p": request.min_p, "seed": request.seed, "stop": request.stop, "stop_token_ids": request.stop_token_ids,
        "presence_penalty": request.presence_penalty, "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty, "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos, "skip_special_tokens": request.skip_special_tokens,
    }
    values = {name: value for name, value in values.items() if value is not None}
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                structured_outputs=structured, **values)
        check_sampling_params(config, has_tokenizer, params)
    except ValueError as e:
        raise _as_bad_request(str(e), renamed or {}) from None
    if params.n > config.scheduler.max_num_seqs:
        raise bad_request(f"n={params.n} is more choices than this server runs at once "
                          f"(--max-num-seqs {config.scheduler.max_num_seqs}); ask for at most that many",
                          param="n")
    return params


def _as_bad_request(message: str, renamed: dict[str, str]):
    match = _FIELD_IN_MESSAGE.search(message)
    field = (match.group(1) or match.group(2)) if match else None
    param = renamed.get(field, field)
    if param is not None and param != field:
        message = message.replace(f"SamplingParams.{field}=", f"{param}=")
    else:
        message = message.replace("SamplingParams.", "")
    for name, request_name in renamed.items():  # another field the message names by its Python name
        message = re.sub(rf"\b{name}=", f"{request_name}=", message)
    return bad_request(message, param=param)
