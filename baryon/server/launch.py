"""`baryon serve`: resolve the engine configuration, start the engine process, serve HTTP.

Shutdown: SIGTERM or SIGINT stops accepting connections, fails every in-flight request with a
503 (streams get an error event and `data: [DONE]`), asks the engine process to exit and
terminates it if it does not within a few seconds. A signal during startup stops the engine
process too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from typing import Any

from baryon.config import EngineConfig
from baryon.logger import get_logger

logger = get_logger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds uvicorn waits for open connections once in-flight requests have been failed.
_GRACEFUL_SHUTDOWN_S = 3


def resolve_model(args: argparse.Namespace) -> str | None:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} (positional) and --model {args.model!r}; give one")
    return args.model_tag or args.model


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT; returns the exit code once the engine process is gone."""
    from baryon.engine_flags import engine_kwargs
    from baryon.engine.core_client import EngineProcess
    from baryon.server.inputs import load_chat_template

    kwargs = engine_kwargs(args)
    kwargs["model"] = resolve_model(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is invalid: it must be in [0, 65535]")
    chat_template = load_chat_template(args.chat_template)
    api_key = args.api_key or os.environ.get("BARYON_API_KEY") or None
    # The engine processes (one per data-parallel replica) import the engine while this process
    # resolves the configuration.
    engines = [EngineProcess() for _ in range(max(args.data_parallel_size, 1))]
    try:
        config = EngineConfig.create(**kwargs)
        if args.enable_auto_tool_choice:
            from baryon.server.tool_parsers import required_tool_parser

            required_tool_parser(args.tool_call_parser, getattr(config.model.hf_config, "model_type", None))
        for engine, replica in zip(engines, config.replicas()):
            engine.configure(replica)  # the model loads while this process loads the tokenizer
        tokenizer = None
        if config.model.tokenizer_path is not None:
            from baryon.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.trust_remote_code)
        model_names = args.served_model_name or [config.model.model]
        return asyncio.run(_serve(args, engines, config, tokenizer, chat_template, model_names, api_key))
    finally:
        for engine in engines:
            engine.kill()  # a no-op once _serve has stopped it


async def _serve(args: argparse.Namespace, engines: list, config: EngineConfig, tokenizer: Any,
                 chat_template: str | None, model_names: list[str], api_key: str | None) -> int:
    from baryon.engine.core_client import AsyncEngineClient

    client = AsyncEngineClient(engines, config, tokenizer)
    try:
        if not await _start_engine(client):
            return 0
        return await _run_http(args, config, client, tokenizer, chat_template, model_names, api_key)
    finally:
        await client.close()


async def _start_engine(client) -> bool:
    """Start the engine process; False if a signal came first (True once it is ready)."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for sig in _SIGNALS:
        loop.add_signal_handler(sig, interrupted.set)
    starting = asyncio.create_task(client.start())
    waiting = asyncio.create_task(interrupted.wait())
    try:
        await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)
        waiting.cancel()
    if not starting.done():
        logger.info("interrupted while the engine was starting")
        starting.cancel()
        return False
    starting.result()  # raises when the engine failed to start
    return True


async def _run_http(args: argparse.Namespace, config: EngineConfig, client, tokenizer: Any,
                    chat_template: str | None, model_names: list[str], api_key: str | None) -> int:
    import uvicorn

    from baryon.server.api import build_app
    from baryon.server.inputs import InputProcessor
    from baryon.server.metrics import ServerMetrics
    from baryon.server.serving import ServerContext

    from baryon.server.reasoning import default_reasoning_parser
    from baryon.server.tool_parsers import default_tool_parser

    model_type = getattr(config.model.hf_config, "model_type", None)
    ctx = ServerContext(config=config, client=client, inputs=InputProcessor(config, tokenizer, chat_template),
                        metrics=ServerMetrics(client, model_names[0]), model_names=model_names,
                        reasoning_parser=args.reasoning_parser or default_reasoning_parser(model_type),
                        tool_parser=args.tool_call_parser or default_tool_parser(model_type))
    app = build_app(ctx, api_key)
    loop = asyncio.get_running_loop()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            loop.call_soon_threadsafe(client.shutdown)  # in-flight requests fail now, not after the grace period

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                   timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S))
    # uvicorn restores the handlers it found and re-raises the signal it caught once it has
    # stopped: let that land here rather than kill the process before the engine is stopped.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in _SIGNALS}
    try:
        logger.info("serving %s at http://%s:%d/v1 (engine processes %s)", model_names[0], args.host, args.port,
                    client.pids)
        await server.serve()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
