"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status.

Handlers turn every failure the server expects into one: request validation (400), our own
`APIError`s (400 / 401 / 404 / 503), unknown routes and methods (404 / 405). A 500 means a bug.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from baryon.logger import get_logger

logger = get_logger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def validation_error_response(error: RequestValidationError, content_type: str | None) -> JSONResponse:
    """A 400 naming the first offending field (pydantic's errors, reworded for JSON clients)."""
    errors = error.errors()
    if not errors:
        return error_response(400, "the request is invalid")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                              code="invalid_json")
    if not loc:
        if content_type and "json" not in content_type:
            return error_response(400, f"the request body must be JSON, sent with 'Content-Type: application/json' "
                                       f"(got {content_type!r})", code="invalid_body")
        if kind == "missing":
            return error_response(400, "the request needs a JSON object body", code="invalid_body")
        return error_response(400, f"the request body must be a JSON object ({first.get('msg')})", code="invalid_body")
    if kind == "extra_forbidden":
        return error_response(400, f"unsupported field '{param}': this server does not implement it; remove it "
                                   f"from the request (see the README for the supported fields)",
                              param=param, code="unsupported_parameter")
    if kind == "missing":
        return error_response(400, f"'{param}' is required", param=param, code="missing_parameter")
    # A union (prompt: a string or a list ...) reports one error per alternative under a common
    # path: name that path and the alternatives.
    locs = [[str(part) for part in e.get("loc", ()) if part != "body"] for e in errors]
    locs = [other for other in locs if other[:1] == loc[:1]]
    if len(locs) > 1:
        prefix = _common_prefix(locs)
        alternatives = sorted({other[len(prefix)].replace("constrained-int", "int")
                               for other in locs if len(other) > len(prefix)})
        param = ".".join(prefix) or param
        return error_response(400, f"invalid value for '{param}': expected one of {', '.join(alternatives)}",
                              param=param, code="invalid_value")
    return error_response(400, f"invalid value for '{param}': {first.get('msg')}", param=param, code="invalid_value")


def _common_prefix(paths: list[list[str]]) -> list[str]:
    prefix = paths[0]
    for path in paths[1:]:
        n = 0
        while n < min(len(prefix), len(path)) and prefix[n] == path[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error_response(error, request.headers.get("content-type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = f"no route {request.url.path}"
        elif error.status_code == 405:  # Starlette's error carries the route's methods as Allow
            allowed = (error.headers or {}).get("Allow")
            message = f"method {request.method} is not allowed on {request.url.path}" + \
                (f" (allowed: {allowed})" if allowed else "")
        elif isinstance(error.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            return error_response(400, f"the request body is not UTF-8 text ({error.__cause__}); send the JSON "
                                       f"body as UTF-8", code="invalid_body")
        elif isinstance(error.__cause__, RecursionError):
            return error_response(400, "the request body nests JSON values too deeply to parse", code="invalid_body")
        else:
            message = str(error.detail) or HTTPStatus(error.status_code).phrase
            if error.__cause__ is not None:
                message += f" ({type(error.__cause__).__name__}: {error.__cause__})"
        return error_response(error.status_code, message, headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(500, f"internal server error: {type(error).__name__}: {error}")
