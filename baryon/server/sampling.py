"""A request's sampling fields -> SamplingParams, with SamplingParams' own checks as 400s."""

from __future__ import annotations

import re

from baryon.config import EngineConfig
from baryon.engine.llm_engine import check_sampling_params
from baryon.sampling_params import SamplingParams
from baryon.server.errors import bad_request
from baryon.server.protocol import SamplingRequest

_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)=|^(\w+) ")


def build_sampling_params(request: SamplingRequest, config: EngineConfig, has_tokenizer: bool, *,
                          max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None,
                          renamed: dict[str, str] | None = None) -> SamplingParams:
    """`renamed` maps a SamplingParams field to the request field that set it (for messages)."""
    values = {
        "n": request.n, "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
        "min_p": request.min_p, "seed": request.seed, "stop": request.stop, "stop_token_ids": request.stop_token_ids,
        "presence_penalty": request.presence_penalty, "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty, "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos, "skip_special_tokens": request.skip_special_tokens,
    }
    values = {name: value for name, value in values.items() if value is not None}
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **values)
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
    return bad_request(message, param=param)
