"""The router's admin routes: pinned prefixes and the prefix-cache reset, sent to every replica.

A request may land on any replica, so a prefix pinned through the router is pinned on every healthy
replica, and the router answers with a pin of its own (`rpin-...`) that names each replica's pin.
All or nothing, as a single server's pin is: if a replica refuses (over its budget, a prompt it
rejects, a wrong API key), the pins already made on the others are deleted and that replica's own
error is the answer. A replica that cannot be reached is left out and named in `missing` (a pin is a
hint to keep blocks, so the healthy replicas keep theirs; a replica that comes back later does not
get it). `DELETE /v1/pins/{id}` unpins it everywhere; `GET /v1/pins` lists the router's pins. The
router holds no API key of its own: every admin request is forwarded with the client's
Authorization header, and a replica's 401 is the answer.

`POST /reset_prefix_cache` resets every healthy replica; a replica that refuses (requests in flight
hold blocks: 409) is named in the answer, and the others stay reset (a reset cannot be undone).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpool.server.errors import APIError, read_raw

if TYPE_CHECKING:
    from kvpool.router.app import Router

_FORWARD_HEADERS = ("authorization", "content-type", "accept")


def forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}


@dataclass
class RouterPin:
    pin_id: str
    on: dict[str, str]  # replica URL -> that replica's pin id
    num_tokens: int
    num_blocks: int
    expires_at: float | None  # time.monotonic(); None: until deleted
    missing: list[str]  # replicas that could not be reached when it was made

    def json(self) -> dict[str, Any]:
        left = None if self.expires_at is None else max(0.0, self.expires_at - time.monotonic())
        return {"id": self.pin_id, "object": "pin", "num_tokens": self.num_tokens, "num_blocks": self.num_blocks,
                "expires_in": left, "replicas": dict(self.on), "missing": list(self.missing)}


def _message(r: httpx.Response | None) -> str:
    if r is None:
        return "unreachable"
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}"


def _relay(r: httpx.Response) -> Response:
    return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))


def add_admin_routes(app: FastAPI, router: Router, client: httpx.AsyncClient, max_body_bytes: int) -> None:
    pins: dict[str, RouterPin] = {}

    def live() -> dict[str, RouterPin]:
        now = time.monotonic()
        for pid in [p for p, pin in pins.items() if pin.expires_at is not None and pin.expires_at <= now]:
            del pins[pid]  # the replicas let theirs expire at the same time
        return pins

    async def each(method: str, path: str, request: Request, content: bytes | None = None,
                   only: dict[str, str] | None = None) -> list[tuple[str, httpx.Response | None]]:
        """The request on every healthy replica (or on `only`'s, each with its own path suffix), at once;
        None for a replica that could not be reached (it is marked down)."""
        headers = forward_headers(request)
        targets = only if only is not None else {n: "" for n, r in router.replicas.items() if r.healthy}

        async def one(name: str, suffix: str) -> tuple[str, httpx.Response | None]:
            try:
                return name, await client.request(method, f"{name}{path}{suffix}", content=content, headers=headers)
            except httpx.HTTPError:
                router.mark_down(name)
                return name, None

        return list(await asyncio.gather(*(one(n, s) for n, s in targets.items())))

    async def refused(request: Request) -> Response | None:
        """A replica's answer when it does not let this client in (the router checks no key itself)."""
        for _, r in await each("GET", "/v1/pins", request):
            if r is not None and r.status_code in (401, 403):
                return _relay(r)
        return None

    @app.post("/v1/pins")
    async def pin(request: Request) -> Response:
        raw = await read_raw(request, max_body_bytes)
        results = await each("POST", "/v1/pins", request, raw)
        made = {n: r.json() for n, r in results if r is not None and r.status_code == 200}  # kvpool's pin objects
        refusals = [r for _, r in results if r is not None and r.status_code != 200]
        if refusals or not made:
            # All or nothing: undo what the others pinned.
            await each("DELETE", "/v1/pins/", request, only={n: p["id"] for n, p in made.items()})
            if refusals:
                return _relay(refusals[0])
            raise APIError(503, "no replica is healthy")
        first = next(iter(made.values()))
        ttl = first.get("expires_in")
        rp = RouterPin(f"rpin-{uuid.uuid4().hex[:16]}", {n: p["id"] for n, p in made.items()}, first["num_tokens"],
                       first["num_blocks"], None if ttl is None else time.monotonic() + ttl,
                       [n for n, r in results if r is None])
        live()[rp.pin_id] = rp
        return JSONResponse(rp.json())

    @app.get("/v1/pins")
    async def list_pins(request: Request) -> Response:
        denied = await refused(request)
        if denied is not None:
            return denied
        return JSONResponse({"object": "list", "data": [p.json() for p in live().values()]})

    @app.delete("/v1/pins/{pin_id}")
    async def unpin(pin_id: str, request: Request) -> Response:
        denied = await refused(request)
        if denied is not None:
            return denied
        rp = live().pop(pin_id, None)
        if rp is None:
            raise APIError(404, f"pin: no pin {pin_id!r} (unpinned, or its TTL passed)")
        await each("DELETE", "/v1/pins/", request, only=rp.on)  # (a replica gone has dropped its pins anyway)
        return JSONResponse({"id": pin_id, "object": "pin", "deleted": True})

    @app.post("/reset_prefix_cache")
    async def reset(request: Request) -> Response:
        results = await each("POST", "/reset_prefix_cache", request)
        if not results:
            raise APIError(503, "no replica is healthy")
        for _, r in results:
            if r is not None and r.status_code in (401, 403):
                return _relay(r)
        not_reset = {n: _message(r) for n, r in results if r is None or r.status_code != 200}
        if not_reset:
            raise APIError(409, f"prefix cache not reset on {len(not_reset)} of {len(results)} replicas "
                                f"(the others were): {not_reset}")
        return JSONResponse({"reset": True, "replicas": len(results)})
