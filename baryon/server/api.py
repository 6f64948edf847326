"""The FastAPI app: OpenAI's routes under /v1, plus /health, /metrics, /version, /tokenize and
/detokenize. With an API key, every /v1 route needs `Authorization: Bearer <key>`."""

from __future__ import annotations

import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

import baryon
from baryon.multimodal.inputs import ImageInput
from baryon.server.errors import bad_request, error_response, install_error_handlers
from baryon.server.inputs import check_unicode
from baryon.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from baryon.server.serving import ServerContext, json_response
from baryon.server.serving_chat import create_chat_completion
from baryon.server.serving_completions import create_completion


class ApiKeyMiddleware:
    """401 for a /v1 request without the right bearer key (before its body is even read)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                message = ("this server needs an API key: send the header 'Authorization: Bearer <key>'"
                           if given is None else "the API key is wrong")
                await error_response(401, message, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ContentEncodingMiddleware:
    """400 for a request body sent compressed (any Content-Encoding but identity): the server reads
    bodies as they come, so a compressed one would otherwise fail as text that is not JSON."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            encoding = dict(scope["headers"]).get(b"content-encoding", b"").decode("latin-1").strip()
            if encoding and encoding.lower() != "identity":
                await error_response(400, f"Content-Encoding {encoding!r} is not supported: send the request body "
                                          f"uncompressed", code="invalid_body")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(ctx: ServerContext, api_key: str | None) -> FastAPI:
    app = FastAPI(title="baryon", version=baryon.__version__,
                  description="OpenAI-compatible API of the baryon inference engine")
    install_error_handlers(app)
    app.add_middleware(ContentEncodingMiddleware)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    created = int(time.time())

    @app.api_route("/health", methods=["GET", "HEAD"], summary="200 while the engine serves requests, 503 once it is gone")
    async def health() -> Response:
        ctx.check_alive()
        return Response(status_code=200)

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> Response:
        return json_response({"version": baryon.__version__})

    @app.api_route("/metrics", methods=["GET", "HEAD"], summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> Response:
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "baryon",
                  "root": ctx.config.model.model, "max_model_len": ctx.config.model.max_model_len,
                  "vocab_size": ctx.config.model.vocab_size} for name in ctx.model_names]
        return json_response({"object": "list", "data": cards})

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(ctx, request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(ctx, request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        ctx.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of 'prompt' (text) or 'messages' (a conversation)", param="prompt")
        images = await ctx.read_images(request.messages)  # counted as the tokens they expand to
        tokens = await ctx.prepare(_tokens, request, images)
        return json_response({"count": len(tokens), "max_model_len": ctx.config.model.max_model_len,
                              "tokens": tokens})

    def _tokens(request: TokenizeRequest, images: list[ImageInput] | None) -> list[int]:
        check_unicode(request.model_dump(exclude_none=True))
        if request.prompt is not None:
            return ctx.inputs.tokenize(request.prompt, add_special_tokens=request.add_special_tokens is not False)
        ids = ctx.inputs.chat_prompt(request.messages, request.add_generation_prompt is not False, check=False,
                                     call_id_chars=ctx.call_id_chars)
        return ctx.inputs.expand_images(ids, images, check=False)[0]

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        ctx.check_model(request.model)
        vocab = ctx.config.model.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        tokenizer = ctx.inputs.tokenizer
        if tokenizer is None:
            raise bad_request("/detokenize needs a tokenizer, and this server runs with --skip-tokenizer-init")
        return json_response({"prompt": tokenizer.decode(request.tokens)})

    return app
