"""The `kvpool serve` flags, apart from the server itself so that building the CLI parser stays cheap
(the server pulls in torch, uvicorn and the engine)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and admin routes")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: folder name)")
    g.add_argument("--max-pending", type=int, default=256,
                   help="requests in flight (running + waiting) before new ones get HTTP 503")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get HTTP 413")
    g.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV cache events on this ZeroMQ PUB endpoint (e.g. tcp://127.0.0.1:5557)")
    g.add_argument("--kv-events-replay-endpoint", default=None,
                   help="answer replay requests (vLLM's ROUTER protocol) on this ZeroMQ endpoint")
    g.add_argument("--kv-events-topic", default="kv-events", help="topic frame of each published KV event batch")
    lg = p.add_argument_group("LoRA adapters")
    lg.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="serve these PEFT adapters; a request's `model` names one (or the base model); also "
                         "vLLM's JSON form '{\"name\": ..., \"path\": ...}'. Implies --enable-lora")
