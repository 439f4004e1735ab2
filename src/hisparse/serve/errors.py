"""Every error the server sends, in OpenAI's shape, whatever raised it.

A client library reads ``{"error": {"message", "type", "param", "code"}}`` and the status:
4xx is the request's fault (``invalid_request_error``, ``param`` names the field), 5xx the
server's (``server_error``). The handlers installed here make that true also for what no
route raises on purpose: an unknown path (404), a wrong method (405), an exception nobody
caught (500, logged with its traceback). Streams that already started cannot change their
status: they end with one ``data: {"error": ...}`` event (`sse_error`), which the OpenAI
clients raise as an `APIError`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("hisparse.serve")

#: the ``code`` of an error when its raiser gave none
_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    499: "client_closed_request",
    500: "internal_error",
    503: "overloaded",
    504: "request_timeout",
}


class ApiError(Exception):
    """An answer other than 200: status, message, the field at fault (``param``), a short
    machine-readable ``code`` and extra headers (``Retry-After`` on a 503)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _CODES.get(status, "error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def sse_error(err: ApiError) -> str:
    """The server-sent event that ends a stream which failed after it started."""
    return f"data: {json.dumps(err.body())}\n\n"


def failure_of(message: str) -> ApiError:
    """The answer to a request the engine failed (``finish_reason="error"``): 400 where the
    request itself can never run here (its prompt needs more GPU blocks than the pool has:
    the scheduler's admission check), 500 for anything else (non-finite logits, a pool that
    cannot hold it while it grows). The engine tells these apart only by message today."""
    if message.startswith("the prompt needs"):
        return ApiError(400, message, "prompt", "prompt_too_large_for_pool")
    return ApiError(500, message, code="request_failed")


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped bodies for `ApiError` and for what Starlette / FastAPI / anything else
    raise, so that no client ever reads a plain-text error."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        headers = dict(err.headers) if err.headers else None
        return ApiError(err.status_code, str(err.detail), headers=headers).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return ApiError(400, f"{loc}: {first.get('msg', 'invalid request')}", loc).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        # (Starlette re-raises it after this answer: uvicorn logs the traceback)
        message = f"internal error: {type(err).__name__}: {err}"
        return ApiError(500, message, code="internal_error").response()
