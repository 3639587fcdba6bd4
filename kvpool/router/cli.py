"""The `kvpool router` flags, apart from the app so that building the CLI parser stays cheap."""

from __future__ import annotations

import argparse

from kvpool.router.index import DEFAULT_MAX_STORE_BLOCKS
from kvpool.server.options import add_allowed_origins, host_address, nonempty, port_number


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", required=True, metavar="URL[,events=EP][,replay=EP][,topic=T]",
                   help="a replica's base URL, with its KV event endpoints (repeat per replica)")
    p.add_argument("--host", default="127.0.0.1", type=host_address)
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--model", default=None, help="the replicas' model folder, for its tokenizer (default: SmolLM2)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="the replicas' --chat-template, if they set one (the router renders chats as they do)")
    p.add_argument("--block-size", type=int, default=16, help="the replicas' --block-size")
    p.add_argument("--hash-algo", default="sha256", choices=["sha256", "xxh3_128"], help="the replicas' --hash-algo")
    p.add_argument("--hash-seed", default=None, help="the replicas' hash seed, if they set one")
    p.add_argument("--policy", default="cache", choices=["cache", "round-robin"])
    p.add_argument("--load-weight", type=float, default=None,
                   help="beta: how much relative load outweighs cache affinity (0: cache only; default 1; "
                        "--policy cache only)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--max-store-blocks", type=int, default=DEFAULT_MAX_STORE_BLOCKS,
                   help="how many block hashes of the replicas' shared store (their STORAGE events) the router "
                        "remembers, least recently stored forgotten first: a store evicts without telling "
                        "(~600 bytes each)")
    add_allowed_origins(p)
    p.add_argument("--api-key", default=None, type=nonempty("a key; leave the flag out to require none"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /router routes (checked here, then "
                        "forwarded to the replicas with the request)")
