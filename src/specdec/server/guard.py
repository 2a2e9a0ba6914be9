"""ASGI middleware in front of the API: API key, body size limit, body encoding.

It buffers a request body (up to the limit) before the app sees it, so an oversized body is refused
with 413 whether or not it declared a Content-Length, and a body that is not UTF-8 gets a clear 400.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.server.errors import APIError

PROTECTED_PREFIX = "/v1/"


class Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"].startswith(PROTECTED_PREFIX) and not self._authorised(headers):
            await _send_error(
                send,
                APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer KEY'",
                    None,
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                ),
            )
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_error(send, self._too_large())
            return
        body, more = await self._read_body(receive)
        if body is None:
            await _send_error(send, self._too_large())
            return
        if more is False:  # the client went away while sending
            return
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            await _send_error(
                send, APIError(400, f"request body is not valid UTF-8 (byte {e.start})", None, "invalid_utf8")
            )
            return
        scope = _as_json(scope)
        await self.app(scope, _replay(body, receive), send)

    def _authorised(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _too_large(self) -> APIError:
        return APIError(
            413, f"request body exceeds the server's limit of {self.max_body_bytes} bytes", None, "request_too_large"
        )

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, bool]:
        """The whole body (None when over the limit) and whether the client is still there."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True


def _as_json(scope: Scope) -> Scope:
    """The API only takes JSON: treat a body sent as form data or text (curl -d) as JSON too."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
    headers.append((b"content-type", b"application/json"))
    return {**scope, "headers": headers}


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect, as the server would

    return replay


async def _send_error(send: Send, err: APIError) -> None:
    payload = json.dumps(err.body()).encode()
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    for k, v in (err.headers or {}).items():
        headers.append((k.lower().encode(), v.encode()))
    start: dict[str, Any] = {"type": "http.response.start", "status": err.status, "headers": headers}
    await send(start)
    await send({"type": "http.response.body", "body": payload})
