"""The `kvpool serve` flags, apart from the server itself so that building the CLI parser stays cheap
(the server pulls in torch, uvicorn and the engine). `ServerConfig`'s fields define them (see kvpool.flags)."""

from __future__ import annotations

import argparse
import ipaddress
import math
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvpool.flags import add_flags, option

ALLOWED_ORIGINS_HELP = ("answer cross-origin (CORS) requests from these origins, e.g. https://app.example.com, or * "
                        "for any (default: none; browsers then refuse to let other sites' scripts read the answers)")


def origin(text: str) -> str:
    """An origin as browsers send it (scheme://host[:port], nothing after), or `*`; ValueError otherwise."""
    if text == "*":
        return text
    u = urlsplit(text)
    if u.scheme not in ("http", "https") or not u.netloc or u.path or u.query or u.fragment:
        raise ValueError(f"{text!r} is not an origin (scheme://host[:port], or *)")
    return text


def _origin(text: str) -> str:
    """An argparse type: a CORS origin (kvpool.server.cors)."""
    try:
        return origin(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def port_number(text: str) -> int:
    """An argparse type: a TCP port (0: any free one)."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {port}")
    return port


def at_least(lowest: int) -> Callable[[str], int]:
    """An argparse type: an int no less than `lowest`."""
    def parse(text: str) -> int:
        n = int(text)
        if n < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {n}")
        return n

    parse.__name__ = "int"  # (argparse names the type in its "invalid int value" message)
    return parse


_positive = at_least(1)


def host_address(text: str) -> str:
    """An argparse type: an address to listen on. Empty is refused (it listens on every interface, not the
    default loopback); one that reads as an IP address must be one (999.1.1.1 failed only once the model had
    loaded). Names are left to the resolver."""
    text = nonempty("an address, e.g. 127.0.0.1 or 0.0.0.0")(text)
    if ":" in text or all(part.isdigit() for part in text.split(".")):
        try:
            ipaddress.ip_address(text.strip("[]"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an IP address") from None
    return text


def nonempty(what: str) -> Callable[[str], str]:
    """An argparse type: a string with something in it. An empty --host listens on every interface (not the
    default loopback), an empty --api-key lets in anyone sending an empty token: both usually come from an
    unset variable (`--api-key "$KEY"`)."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"must not be empty ({what})")
        return text

    parse.__name__ = "str"
    return parse


def _positive_float(text: str) -> float:
    x = float(text)
    if not (math.isfinite(x) and x > 0):  # (NaN compares false to everything: ask for what is wanted)
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return x


@dataclass
class ServerConfig:
    """The HTTP server: where it listens, who may call it, how much it takes in, where KV events go."""

    host: str = option("127.0.0.1", "address to listen on", type=host_address)
    port: int = option(8000, "port to listen on", type=port_number)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1 and admin routes",
                                 type=nonempty("a key; leave the flag out to require none"))
    served_model_name: str | None = option(None, "the model id clients send (default: folder name)",
                                           type=nonempty("a model id; leave the flag out for the folder's name"))
    allowed_origins: tuple[str, ...] | None = option(None, ALLOWED_ORIGINS_HELP, nargs="+", metavar="ORIGIN",
                                                     type=_origin)
    max_pending: int = option(256, "requests in flight (running + waiting) before new ones get HTTP 503",
                              type=_positive)
    max_body_bytes: int = option(4 << 20, "larger request bodies get HTTP 413", type=_positive)
    trust_request_chat_template: bool = option(False, "take a chat request's own `chat_template` (a Jinja "
                                                "template the server renders, sandboxed but free to spend CPU "
                                                "time: only for clients you trust; refused with HTTP 400 "
                                                "without it)")
    kv_events_endpoint: str | None = option(None, "publish KV cache events on this ZeroMQ PUB endpoint "
                                            "(e.g. tcp://127.0.0.1:5557)")
    kv_events_replay_endpoint: str | None = option(None, "answer replay requests (vLLM's ROUTER protocol) on this "
                                                   "ZeroMQ endpoint")
    kv_events_topic: str | None = option(None, "topic frame of each published KV event batch (default: kv-events)")
    pin_prefix: tuple[str, ...] | None = option(
        None, "keep this prefix (text, or @FILE for a file's text without its final newline) cached on the "
        "device for as long as the server runs (computed at start; a reset computes it again); repeatable",
        action="append", metavar="TEXT")
    pin_system_prompt: tuple[str, ...] | None = option(
        None, "the same for a chat system prompt (text or @FILE): pins what every chat that starts with it "
        "shares, in the form the model's chat template gives it; repeatable", action="append", metavar="TEXT")


@dataclass
class ImageServerConfig:
    """Images in chat content parts (for models that take images): where they may come from, how large."""

    allowed_local_media_path: str | None = option(None, "allow file:// image URLs, only for files under DIR "
                                                  "(default: refused)", metavar="DIR")
    max_image_bytes: int = option(20 << 20, "larger images (encoded, after base64 decoding) get HTTP 400")
    max_image_pixels: int = option(4096 * 4096, "images with more pixels (width x height) get HTTP 400")
    max_images_per_request: int = option(8, "requests with more image parts get HTTP 400, counted before any "
                                         "is read (a model may take fewer: its own cap applies too)")


@dataclass
class LoRAServerConfig:
    """The PEFT adapters a server loads at start (kvpool.runner.lora)."""

    lora_modules: tuple[str, ...] | None = option(
        None, "serve these PEFT adapters; a request's `model` names one (or the base model); also vLLM's JSON "
        "form '{\"name\": ..., \"path\": ...}'. Implies --enable-lora", nargs="+", metavar="NAME=PATH")


def add_allowed_origins(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--allowed-origins`, as `kvpool serve` has it, for the other front doors (router, omni-serve)."""
    p.add_argument("--allowed-origins", nargs="+", type=_origin, default=None, metavar="ORIGIN",
                   help=ALLOWED_ORIGINS_HELP)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, ServerConfig, "server")
    add_flags(p, ImageServerConfig, "images (chat content parts of type image_url, for models that take images)")
    add_flags(p, LoRAServerConfig, "LoRA adapters")
