"""`baryon serve` flags (argparse only: building the parser imports nothing of the server).

The names follow `vllm serve`: a positional MODEL (or --model), --host, --port, --api-key,
--served-model-name, --chat-template, and every engine flag generated from EngineArgs
(--max-model-len, --gpu-memory-utilization, --max-num-seqs, --enable-prefix-caching /
--no-enable-prefix-caching, --dtype, --seed, ...).
"""

from __future__ import annotations

import argparse

from baryon.server.reasoning import REASONING_PARSERS  # plain data: no server imports
from baryon.server.tool_parsers import TOOL_PARSERS

UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from baryon.engine_flags import add_engine_args

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="Checkpoint folder or Hugging Face repo id (the same as --model)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on")
    server.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' on /v1 routes (default: $BARYON_API_KEY if set)")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="Model name(s) requests may use; responses use the first (default: the model argument)")
    server.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="Jinja chat template (a file or the template itself) for tokenizers without one, "
                             "or to replace theirs")
    server.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="Split chat replies into reasoning_content and content (default: harmony for "
                             "GPT-OSS, none otherwise)")
    server.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="The format of tool calls in chat replies (default: by the model family: hermes for "
                             "Qwen, llama3_json for Llama, mistral, deepseek_v3, openai for GPT-OSS)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag: tool_choice auto is on whenever a tool-call parser is known; with this "
                             "flag a model without one (no --tool-call-parser, no default for its family) is an "
                             "error at start instead of replies whose calls stay text")
    server.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                        help="Log level of the HTTP server (access log at info)")
    # A server's token budget (config.default_token_budget); its engine always runs in a process of its own.
    add_engine_args(parser, defaults={"max_num_batched_tokens": 8192}, omit=frozenset({"engine_process"}))
