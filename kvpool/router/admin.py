"""The router's admin routes: pinned prefixes and the prefix-cache reset, sent to every replica.

A request may land on any replica, so a prefix pinned through the router is pinned on every healthy
replica, and the router answers with a pin of its own (`rpin-...`) that names each replica's pin.
All or nothing, as a single server's pin is: if a replica refuses (a 4xx: over its budget, a prompt it
rejects, a wrong API key), the pins already made on the others are deleted and that replica's own
error is the answer. A replica that is down, cannot be reached or fails (a 5xx) is left out and named in
`missing` (a pin is a hint to keep blocks, so the healthy replicas keep theirs), and pinned again later.
`DELETE /v1/pins/{id}` unpins it everywhere; `GET /v1/pins` lists the router's pins. The router holds no
API key of its own: every admin request is forwarded with the client's Authorization header, and a
replica's 401 is the answer.

Pins are kept, not only made: while any live, the router checks every healthy replica's pins once a
second (`PIN_CHECK_S`) and pins again, with the TTL that is left, wherever one is absent: on a
replica that was down when the pin was made, or one restarted since (a fresh process has no pins; a
replica keeps its own through resets and recoveries). Requests can land on any replica, so
a pin held by some replicas only would keep a prefix cached for some of its requests only. A replica
that refuses the pin then (its budget is full of other pins) stays in `missing` and is asked again
at the next check; the refusal is logged once.

`POST /reset_prefix_cache` resets every healthy replica; a replica that refuses (requests in flight
hold blocks: 409) is named in the answer, and the others stay reset (a reset cannot be undone).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpool.server.errors import APIError, read_raw, until_disconnected
from kvpool.server.json_body import parse_json_object

if TYPE_CHECKING:
    from kvpool.router.app import Router

log = logging.getLogger("kvpool.router")
T = TypeVar("T")

WATCH_POLL_S = 0.1  # how often a request waiting on a replica looks whether it has been marked down


async def while_up(work: Awaitable[T], router: Router, name: str, request: Request | None = None,
                   epoch: int | None = None) -> tuple[bool, T | None]:
    """(True, what `work` gives), or (False, None) once replica `name` is marked down (since `epoch`, its
    `downs`; default: now) or the client has left: `work` is then cancelled. A frozen replica accepts a
    request and never answers; without this, whoever waits on it (a client listing models, pinning,
    resetting, generating) waits forever, as the router's requests to replicas have no read timeout (a
    long generation is not a fault)."""
    rep = router.replicas[name]
    since = rep.downs if epoch is None else epoch
    return await until_disconnected(work, request, WATCH_POLL_S, stop=lambda: rep.downs != since)

_FORWARD_HEADERS = ("authorization", "content-type", "accept")
PIN_CHECK_S = 1.0  # how often the router makes sure every healthy replica holds every live pin
_MIN_TTL_LEFT_S = 1.0  # a pin about to expire is not made again
_PIN_LIST_TIMEOUT_S = 5.0  # a replica that does not list its pins in this long is asked at the next check


def forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}


@dataclass
class RouterPin:
    pin_id: str
    on: dict[str, str]  # replica URL -> that replica's pin id
    num_tokens: int
    num_blocks: int
    expires_at: float | None  # time.monotonic(); None: until deleted
    missing: list[str]  # replicas known not to hold it: down when it was made, or found without it since
    body: dict[str, Any]  # the client's pin request, to pin again where the pin is absent
    headers: dict[str, str]  # ... and its headers (the API key the replicas check)
    refused_by: set[str] = field(default_factory=set)  # replicas whose refusal was logged

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

    async def each(method: str, path: str, headers: dict[str, str], content: bytes | None = None,
                   only: dict[str, str] | None = None, request: Request | None = None
                   ) -> list[tuple[str, httpx.Response | None]]:
        """The request on every healthy replica (or on `only`'s, each with its own path suffix), at once;
        None for a replica that could not be reached (it is marked down) or was marked down meanwhile (or
        when the client that asked, `request`, has left)."""
        targets = only if only is not None else {n: "" for n, r in router.replicas.items() if r.healthy}

        async def one(name: str, suffix: str) -> tuple[str, httpx.Response | None]:
            try:
                _, r = await while_up(client.request(method, f"{name}{path}{suffix}", content=content,
                                                     headers=headers), router, name, request)
                return name, r
            except httpx.HTTPError:
                router.mark_down(name)
                return name, None

        return list(await asyncio.gather(*(one(n, s) for n, s in targets.items())))

    async def refused(request: Request) -> Response | None:
        """A replica's answer when it does not let this client in (the router checks no key itself)."""
        for _, r in await each("GET", "/v1/pins", forward_headers(request), request=request):
            if r is not None and r.status_code in (401, 403):
                return _relay(r)
        return None

    keeper: list[asyncio.Task[None]] = []  # the task keeping the live pins on every replica
    checking: dict[str, asyncio.Task[None]] = {}  # replica -> its pin check in progress

    async def keep_pins() -> None:
        while live():
            await asyncio.sleep(PIN_CHECK_S)
            # A check per replica, on its own: a replica slow to answer (or to compute a prefix) holds up
            # only its own next check, never the others'.
            for name, rep in router.replicas.items():
                task = checking.get(name)
                if rep.healthy and (task is None or task.done()):
                    checking[name] = asyncio.create_task(check(name))

    async def check(name: str) -> None:
        """Pin again on replica `name` each live pin it does not hold. A fault here only means trying
        again at the next check: whether a replica is up is the health checks' call, not this one's."""
        by_key: dict[tuple[tuple[str, str], ...], list[RouterPin]] = {}
        for rp in live().values():
            by_key.setdefault(tuple(sorted(rp.headers.items())), []).append(rp)
        try:
            for key, group in by_key.items():
                r = await client.get(f"{name}/v1/pins", headers=dict(key), timeout=_PIN_LIST_TIMEOUT_S)
                if r.status_code != 200:
                    continue  # (a key the replica no longer takes: nothing to do for these pins)
                held = {p["id"] for p in r.json()["data"]}
                for rp in group:
                    if rp.on.get(name) not in held and pins.get(rp.pin_id) is rp:
                        await repin(rp, name)
        except httpx.HTTPError:
            pass
        except Exception:  # a surprise (a body that is not a pin list): log it, try again next time
            log.exception("router: checking the pins of replica %s failed", name)

    async def repin(rp: RouterPin, name: str) -> None:
        rp.on.pop(name, None)
        if name not in rp.missing:
            rp.missing.append(name)
        left = None if rp.expires_at is None else rp.expires_at - time.monotonic()
        if left is not None and left < _MIN_TTL_LEFT_S:
            return
        # No timeout: a pin the replica made after the router stopped waiting would be one it never
        # learns the id of, and could not delete. A replica that dies drops the connection instead.
        r = await client.post(f"{name}/v1/pins", json=dict(rp.body, ttl=left), headers=rp.headers, timeout=None)
        if r.status_code != 200:
            if name not in rp.refused_by:
                rp.refused_by.add(name)
                log.warning("router: replica %s does not take pin %s again: %s", name, rp.pin_id, _message(r))
            return
        made = r.json()["id"]
        if pins.get(rp.pin_id) is not rp:  # unpinned while this one was being made
            await each("DELETE", "/v1/pins/", rp.headers, only={name: made})
            return
        rp.on[name] = made
        rp.missing.remove(name)
        rp.refused_by.discard(name)
        log.info("router: pin %s made again on replica %s", rp.pin_id, name)

    @app.post("/v1/pins")
    async def pin(request: Request) -> Response:
        raw = await read_raw(request, max_body_bytes)
        sent_at = time.monotonic()
        results = await each("POST", "/v1/pins", forward_headers(request), raw, request=request)
        made = {n: r.json() for n, r in results if r is not None and r.status_code == 200}  # kvpool's pin objects
        # A 4xx is the replica's answer to the pin (its budget, the prompt, the key): all or nothing, as on one
        # server. A 5xx is a fault of that replica (its engine failed the step, or stopped): like a replica
        # down, it goes into `missing` and is pinned again once it answers, rather than failing the pin the
        # healthy replicas hold.
        refusals = [r for _, r in results if r is not None and r.status_code != 200 and r.status_code < 500]
        if refusals or not made:
            # All or nothing: undo what the others pinned.
            await each("DELETE", "/v1/pins/", forward_headers(request), only={n: p["id"] for n, p in made.items()})
            if refusals:
                return _relay(refusals[0])
            faults = [r for _, r in results if r is not None and r.status_code >= 500]
            if faults:
                return _relay(faults[0])
            raise APIError(503, "no replica is healthy")
        first = next(iter(made.values()))
        # No later than any replica's own expiry (each counted its TTL from when it pinned, after
        # `sent_at`), so the keeper never sees a replica's pin gone while the router's lives on.
        ttls = [p["expires_in"] for p in made.values() if p.get("expires_in") is not None]
        ttl = min(ttls) if ttls else None
        rp = RouterPin(f"rpin-{uuid.uuid4().hex[:16]}", {n: p["id"] for n, p in made.items()}, first["num_tokens"],
                       first["num_blocks"], None if ttl is None else sent_at + ttl,
                       [n for n in router.replicas if n not in made],
                       # (the body the replicas took, kept to pin again where the pin goes missing)
                       parse_json_object(raw, request.headers.get("content-type")), forward_headers(request))
        live()[rp.pin_id] = rp
        if not keeper or keeper[0].done():
            keeper[:] = [asyncio.create_task(keep_pins())]
        return JSONResponse(rp.json())

    @app.get("/v1/pins")
    async def list_pins(request: Request) -> Response:
        denied = await refused(request)
        if denied is not None:
            return denied
        return JSONResponse({"object": "list", "data": [p.json() for p in live().values()]})

    @app.delete("/v1/pins/{pin_id:path}")  # (any id, "/" included, gets a 404 body, not a redirect)
    async def unpin(pin_id: str, request: Request) -> Response:
        denied = await refused(request)
        if denied is not None:
            return denied
        rp = live().pop(pin_id, None)
        if rp is None:
            raise APIError(404, f"pin: no pin {pin_id!r} (unpinned, or its TTL passed)")
        # (A replica that is gone has dropped its pins anyway.)
        await each("DELETE", "/v1/pins/", forward_headers(request), only=rp.on)
        return JSONResponse({"id": pin_id, "object": "pin", "deleted": True})

    @app.post("/reset_prefix_cache")
    async def reset(request: Request) -> Response:
        results = await each("POST", "/reset_prefix_cache", forward_headers(request), request=request)
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
