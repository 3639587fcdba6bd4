"""`kvpool serve`: build the engine, start its thread, and serve the OpenAI-compatible API with uvicorn.

`start_server` runs the same thing on a background thread and returns a handle (URL, engine, stop);
tests and benchmarks use it to run a real server on 127.0.0.1 without a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from kvpool.engine.async_engine import AsyncEngine
from kvpool.engine.engine import LLMEngine
from kvpool.server.app import create_app
from kvpool.server.cors import add_cors, check_origins
from kvpool.server.kv_events import KVEventPublisher
from kvpool.server.media import MediaOptions
from kvpool.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from kvpool.core.pins import Pin
    from kvpool.engine.llm import LLM

log = logging.getLogger(__name__)


@dataclass
class ServerHandle:
    url: str
    engine: AsyncEngine
    metrics: ServerMetrics
    _server: uvicorn.Server
    _thread: threading.Thread
    _publisher: KVEventPublisher | None

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self.engine.shutdown()
        if self._publisher is not None:
            self._publisher.close()


def check_kv_events_options(endpoint: str | None, replay_endpoint: str | None, topic: str | None = None) -> None:
    """A replay socket only replays what the PUB socket published, and a topic names what it publishes:
    without one either would be ignored silently."""
    if replay_endpoint and not endpoint:
        raise ValueError("kv_events_replay_endpoint: --kv-events-replay-endpoint needs --kv-events-endpoint "
                         "(the replay resends published batches; none are published without it)")
    if topic is not None and not endpoint:
        raise ValueError("kv_events_topic: --kv-events-topic needs --kv-events-endpoint (it names the published "
                         "batches; none are published without it)")


def build(engine: LLMEngine, *, served_model_name: str | None = None, api_key: str | None = None,
          max_pending: int = 256, max_body_bytes: int = 4 << 20, kv_events_endpoint: str | None = None,
          kv_events_replay_endpoint: str | None = None, kv_events_topic: str | None = None,
          media: MediaOptions | None = None, pin_prefixes: Sequence[StandingPrefix] = (),
          allowed_origins: Sequence[str] | None = None, trust_request_chat_template: bool = False
          ) -> tuple[Any, AsyncEngine, ServerMetrics, KVEventPublisher | None]:
    """The app and what runs it, for `engine`; `pin_prefixes` are pinned now (computed) and kept for as
    long as the server runs (`--pin-prefix`)."""
    name = served_model_name or engine.model_dir.name
    if any(r.lora_name == name for r in engine.list_loras()):
        raise ValueError(f"lora_modules: adapter name {name!r} is the served model's name; a request's `model` "
                         f"could not tell them apart")
    check_kv_events_options(kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic)
    check_origins(allowed_origins)
    pin_standing(engine, pin_prefixes)  # (with no TTL: the engine keeps pins through resets and recoveries)
    async_engine = AsyncEngine(engine, max_pending=max_pending)
    metrics = ServerMetrics(name, host_tier=engine.has_host_tier)
    async_engine.add_listener(metrics.observe)
    if engine.store is not None:
        from kvpool.store.engine_store import StoreCollector

        metrics.registry.register(StoreCollector(engine.store, name))
    publisher = None
    if kv_events_endpoint:
        if not engine.config.enable_kv_events:
            raise ValueError("kv_events_endpoint: the engine was built without enable_kv_events=True")
        topic = "kv-events" if kv_events_topic is None else kv_events_topic  # ("" is a topic: subscribers' all)
        publisher = KVEventPublisher(kv_events_endpoint, topic=topic, replay_endpoint=kv_events_replay_endpoint)
        publisher.bind()
        async_engine.add_listener(publisher.observe)
    app = create_app(async_engine, model_name=name, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes,
                     media=media, kv_events_instance=None if publisher is None else publisher.instance,
                     trust_request_chat_template=trust_request_chat_template)
    add_cors(app, allowed_origins)
    return app, async_engine, metrics, publisher


def serve_in_thread(app: Any, host: str, port: int) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Run `app` with uvicorn on a background thread, once it listens: (URL, server, thread); port 0 picks a
    free one. RuntimeError when it does not start (the caller stops what it started for it)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="kvpool-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return f"http://{host}:{bound}", server, thread


def start_server(engine: LLMEngine, *, host: str = "127.0.0.1", port: int = 0, **kw: Any) -> ServerHandle:
    """A real server on a background thread; port 0 picks a free one."""
    app, async_engine, metrics, publisher = build(engine, **kw)
    async_engine.start()
    try:
        url, server, thread = serve_in_thread(app, host, port)
    except RuntimeError:
        async_engine.shutdown()
        raise
    return ServerHandle(url, async_engine, metrics, server, thread, publisher)


def media_options(args: argparse.Namespace) -> MediaOptions:
    root = args.allowed_local_media_path
    if root is not None and not Path(root).is_dir():
        raise ValueError(f"--allowed-local-media-path: {root!r} is not a directory")
    for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    return MediaOptions(Path(root) if root is not None else None, args.max_image_bytes, args.max_image_pixels,
                        args.max_images_per_request)


def add_lora_modules(engine: LLMEngine, specs: list[str]) -> None:
    """Load `--lora-modules` (name=PATH ...) now, so that a bad adapter stops the start with a ValueError."""
    from kvpool.engine.lora_request import parse_lora_modules

    for lora in parse_lora_modules(specs):
        engine.add_lora(lora)


@dataclass(frozen=True)
class StandingPrefix:
    """A prefix a server keeps pinned for as long as it runs (`--pin-prefix`, `--pin-system-prompt`): text
    as it is, or a chat system prompt, pinned as what every chat starting with it shares."""

    text: str
    system_prompt: bool = False

    def pin(self, llm: LLM) -> Pin:
        if self.system_prompt:
            return llm.pin_prefix(messages=[{"role": "system", "content": self.text}])
        return llm.pin_prefix(self.text)


def read_standing_prefixes(args: argparse.Namespace) -> list[StandingPrefix]:
    """The `--pin-prefix` and `--pin-system-prompt` values: the text itself, or `@FILE` for a file's text."""
    out = []
    for field, system_prompt in (("pin_prefix", False), ("pin_system_prompt", True)):
        for spec in getattr(args, field, None) or []:
            text = spec
            if spec.startswith("@"):
                try:
                    text = Path(spec[1:]).read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as e:
                    raise ValueError(f"{field}: cannot read {spec[1:]!r}: {getattr(e, 'strerror', None) or e}"
                                     ) from None
                text = text.removesuffix("\n")  # (the newline an editor or `echo` ends a file with)
            if not text:
                raise ValueError(f"{field}: {spec!r} is empty")
            out.append(StandingPrefix(text, system_prompt))
    return out


def pin_standing(engine: LLMEngine, prefixes: Sequence[StandingPrefix]) -> None:
    """Pin a server's standing prefixes until it stops, computing them first, before it serves (nothing
    else steps the engine yet). ValueError over the pin budget: the server does not start."""
    from kvpool.engine.llm import LLM

    llm = LLM.from_engine(engine)
    for prefix in prefixes:
        pin = prefix.pin(llm)
        log.info("pinned a standing %s: %d tokens in %d blocks (%s)",
                 "system prompt" if prefix.system_prompt else "prefix", pin.num_tokens, len(pin.blocks), pin.pin_id)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before a model loads (as vLLM binds it): a port in use, or an address that is
    not this machine's, is a ValueError naming the port in a second, not uvicorn's exit after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"port: cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def serve_on(app: Any, sock: socket.socket) -> None:
    """Run `app` on a socket from `listen` until interrupted (uvicorn's signal handling; a Ctrl-C ends it
    quietly, as `uvicorn.run` does: uvicorn raises the signal again once it has shut down)."""
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(uvicorn.Config(app, log_level="info", lifespan="off")).run(sockets=[sock])


def run(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> None:
    media = media_options(args)  # checked before the model loads
    sock = listen(args.host, args.port)
    standing = read_standing_prefixes(args)
    check_kv_events_options(args.kv_events_endpoint, args.kv_events_replay_endpoint,
                            args.kv_events_topic)  # (before the model loads)
    if args.kv_events_endpoint:
        engine_kwargs = dict(engine_kwargs, enable_kv_events=True)
    if args.lora_modules:
        engine_kwargs = dict(engine_kwargs, enable_lora=True)
    engine = LLMEngine(**engine_kwargs)
    add_lora_modules(engine, args.lora_modules or [])
    app, async_engine, _, publisher = build(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                                            max_pending=args.max_pending, max_body_bytes=args.max_body_bytes,
                                            kv_events_endpoint=args.kv_events_endpoint,
                                            kv_events_replay_endpoint=args.kv_events_replay_endpoint,
                                            kv_events_topic=args.kv_events_topic, media=media,
                                            pin_prefixes=standing, allowed_origins=args.allowed_origins,
                                            trust_request_chat_template=args.trust_request_chat_template)
    async_engine.start()
    log.info("serving %s on http://%s:%d (%d KV blocks of %d tokens)", engine.model_dir.name, args.host,
             sock.getsockname()[1], engine.stats().num_blocks, engine.config.block_size)
    try:
        serve_on(app, sock)
    finally:
        async_engine.shutdown()
        if publisher is not None:
            publisher.close()
