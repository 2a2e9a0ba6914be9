"""Every error the server returns, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import ContextLengthError, InvalidRequestError, SpecdecError, UnsupportedError

log = logging.getLogger("specdec.server")

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class APIError(Exception):
    """Raised by routes and the scheduler; rendered by ``error_response``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        err_type = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def from_specdec(e: SpecdecError) -> APIError:
    """Map the engine's typed errors to HTTP (all are the client's doing, except model loading)."""
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), e.param, "context_length_exceeded")
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), e.param, "invalid_value")
    if isinstance(e, UnsupportedError):
        return APIError(400, str(e), None, "unsupported")
    return APIError(500, str(e), None, "internal_error")


def _loc_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"``."""
    parts = [str(p) for p in loc if p != "body"]
    # pydantic names union members (e.g. "str", "list[int]") in the location; they are not parameters.
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int", "bool", "float")]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body", None, "invalid_request")
    first = errors[0]
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return APIError(400, f"request body is not valid JSON: {ctx.get('error', 'parse error')}", None, "invalid_json")
    param = _loc_param(tuple(first.get("loc", ())))
    if kind == "missing" and param is None:
        return APIError(400, "request body is empty: send a JSON object", None, "invalid_request")
    if kind == "missing":
        return APIError(400, f"missing required field: {param}", param, "missing_field")
    if param is None and kind in ("model_attributes_type", "dict_type"):
        return APIError(400, "request body must be a JSON object", None, "invalid_request")
    msg = str(first.get("msg", "invalid value"))
    # A union (e.g. prompt: string or token ids) reports one error per member: count other fields only.
    others = {_loc_param(tuple(e.get("loc", ()))) for e in errors} - {param}
    more = f" (and problems with {', '.join(sorted(p or 'body' for p in others))})" if others else ""
    return APIError(400, f"invalid value for {param or 'body'}: {msg}{more}", param, "invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape; nothing escapes as a bare 500 page."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(SpecdecError)
    async def _specdec(_: Request, exc: SpecdecError) -> JSONResponse:
        return error_response(from_specdec(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        headers = dict(exc.headers) if exc.headers else None
        return error_response(APIError(exc.status_code, detail, None, code, headers))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", None, "internal_error"))
