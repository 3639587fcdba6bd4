"""What the server, the omni server and the router (which must not import the engine) share about a
client: errors as the OpenAI API shapes them ({"error": {"message", "type", "param", "code"}}), the
handlers that turn every exception into one, reading a body under a size limit, and waiting for work
while watching whether the client is still there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                503: "service_unavailable", 500: "internal_server_error"}


class ClientDisconnected(Exception):
    """The client went away before its answer was ready (the request was aborted, its blocks freed)."""


def rename_field(msg: str, rename: dict[str, str] | None = None) -> tuple[str, str | None]:
    """A "field: what is wrong" message with its field renamed by `rename` (the engine's name for it -> the
    request's), and the field (None for a message that names none)."""
    head = msg.split(":", 1)[0]
    field = head if ":" in msg and " " not in head else None
    if field is not None and rename and field in rename:
        return rename[field] + msg[len(field):], rename[field]
    return msg, field


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @classmethod
    def from_value_error(cls, e: ValueError, rename: dict[str, str] | None = None) -> APIError:
        """A 400 whose `param` is the field the message starts with; `rename` maps the engine's names
        for a field to the request's (the engine's `prompt_token_ids` is a chat request's `messages`)."""
        msg, field = rename_field(str(e), rename)
        return cls(400, msg, field)

    def body(self) -> dict[str, dict[str, object]]:
        """The error object, also as a streamed event's data once a stream has begun."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


async def read_raw(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be over `max_bytes` (by its Content-Length,
    or while reading a chunked one): a large body is never held in memory whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"body: {declared} bytes is over the limit of {max_bytes}")
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_bytes:
                raise APIError(413, f"body: over the limit of {max_bytes} bytes")
    except ClientDisconnect:  # left mid-upload: nothing started, nobody to answer (not a server error)
        raise ClientDisconnected() from None
    return bytes(raw)


T = TypeVar("T")


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless the request carries 'Authorization: Bearer <api_key>' (no key configured: anyone). An empty
    key lets no one in (the servers refuse one at start: it would let in an empty token)."""
    if api_key is None:
        return
    if not api_key.strip():
        raise APIError(401, "Incorrect API key provided; send it as 'Authorization: Bearer KEY'")
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    # (Starlette decodes a header's bytes as latin-1: encoding them back gives the bytes the client sent,
    # which for a key beyond ASCII are its UTF-8)
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), api_key.encode()):
        raise APIError(401, "Incorrect API key provided; send it as 'Authorization: Bearer KEY'")


async def until_disconnected(work: Awaitable[T], request: Request | None, poll_s: float = 0.25,
                             stop: Callable[[], bool] | None = None) -> tuple[bool, T | None]:
    """(True, what `work` gives), or (False, None) as soon as the client has disconnected (or `stop()` says
    so: the router stops waiting on a replica marked down); `work` is then cancelled (for a request to a
    replica, cancelling or closing it mid-answer makes the replica abort it and free its blocks). `work`'s
    own exception propagates. `request` None: work with no client waiting on it (only `stop` ends it)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return True, task.result()
            if (stop is not None and stop()) or (request is not None and await request.is_disconnected()):
                return False, None
    finally:
        await cancel_and_wait(task)


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and let it wind down (an upstream connection closed) before going on, even when the
    caller is being cancelled itself (inside a streamed response whose client left): a read cut short in
    its own cleanup leaves the connection to the replica open, and the replica working for no one. Its own
    outcome is dropped; the caller's cancellation, held off meanwhile, is passed on."""
    if task.done():
        return
    task.cancel()
    with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    current = asyncio.current_task()
    if current is not None and current.cancelling():
        raise asyncio.CancelledError


def add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error object: ours (APIError), routing's (404/405), and anything else (500)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        r = APIError(e.status_code, str(e.detail)).response()
        r.headers.update(e.headers or {})  # (a 405's Allow: the methods the path takes)
        return r

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {e!r}").response()
