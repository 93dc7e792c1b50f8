"""Errors in OpenAI's (and vLLM's) shape, and the middleware that guarantees every failure leaves the
server as one: `{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status, as vLLM
sends it. No handler ever answers bad input with a traceback or a 500."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from aiohttp import web

from jaxinfer.errors import InvalidRequestError, RequestFailedError, TokenizerError
from serve.app_keys import MAX_REQUEST_BYTES

logger = logging.getLogger(__name__)

# vLLM's `type` values: the exception class name of the HTTP status.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by handlers for any request the server refuses; the middleware renders it."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def __reduce__(self):  # (raised in the body-parsing helper process, re-raised here)
        return APIError, (self.status, self.message, self.param, self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(error_body(status, message, param)),
                        content_type="application/json", headers=headers)


def as_api_error(exc: BaseException) -> APIError | None:
    """The client-facing error for an exception raised while handling a request, or None when it is
    a server fault (those are logged and answered with a generic 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, TokenizerError):  # e.g. a chat template that rejects the messages
        return APIError(400, str(exc), "messages")
    if isinstance(exc, RequestFailedError):  # the engine's fault, logged there; the engine goes on
        return APIError(500, f"internal server error: {exc}")
    if type(exc).__name__ == "EngineDeadError":  # the process exits non-zero to be restarted
        return APIError(503, f"the engine loop has stopped: {exc.__cause__!r}")
    return None


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects etc. pass through untouched
            raise
        if exc.status == 413:  # aiohttp's client_max_size check while reading the body
            message = (f"request body is larger than the server's limit of "
                       f"{request.app[MAX_REQUEST_BYTES]} bytes (--max-request-bytes)")
        elif exc.status == 404:
            message = f"no route {request.method} {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        else:
            message = exc.reason
        return error_response(exc.status, message, headers={
            k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")})
    except Exception as exc:  # the last line of defence: never a traceback to the client
        api_error = as_api_error(exc)
        if api_error is None:
            logger.exception("internal error while handling %s %s", request.method, request.path)
            return error_response(500, f"internal server error: {type(exc).__name__}")
        return error_response(api_error.status, api_error.message, api_error.param, api_error.headers)
