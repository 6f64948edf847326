"""Shared pieces of the benchmarks: engine flags, building the engine, random token prompts."""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from baryon.bench.presets import PRESETS, resolve_model
from baryon.logger import dump_stacks_on_sigusr1


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    from baryon.engine_flags import add_engine_args

    add_engine_args(parser)
    parser.set_defaults(model="qwen3-0.6b", max_model_len=4096)
    parser.epilog = f"--model also takes a preset: {', '.join(PRESETS)} (dummy weights, no tokenizer)"


def build_llm(args: argparse.Namespace) -> tuple[Any, float]:
    """The engine and its construction time in seconds. Presets get dummy weights and no tokenizer."""
    from baryon.engine_flags import engine_kwargs
    from baryon.llm import LLM

    kwargs = engine_kwargs(args)
    if args.model in PRESETS:
        kwargs.update(model=resolve_model(args.model), load_format="dummy", skip_tokenizer_init=True)
    spec = kwargs.get("speculative_config")
    if spec is not None:  # a draft model may be a preset too
        spec = json.loads(spec) if isinstance(spec, str) else dict(spec)
        if spec.get("model") in PRESETS:
            spec["model"] = resolve_model(spec["model"])
        kwargs["speculative_config"] = spec
    dump_stacks_on_sigusr1()  # the suite's --stack-dump-after: where a slow start-up waits
    start = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - start


def random_token_prompts(rng: random.Random, lengths: list[int], high: int = 10000) -> list[dict]:
    """Token-id prompts drawn uniformly from [0, high)."""
    return [{"prompt_token_ids": [rng.randrange(high) for _ in range(n)]} for n in lengths]
