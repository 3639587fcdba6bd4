"""Cross-origin requests (CORS), for browser apps calling a server or router directly.

Off unless `--allowed-origins` names origins (or `*`): kvpool listens on 127.0.0.1 by default, and answering
any web page's scripts would let every site a user visits read from the local server. vLLM allows `*` by
default; here it is one flag away. Preflight requests (OPTIONS) are answered before routes and API keys, as
browsers send them without credentials.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from kvpool.server.options import origin

ALLOWED_METHODS = ["GET", "POST", "DELETE", "OPTIONS"]
# Any request header (OpenAI's SDKs send their own x-stainless-* ones from browsers too): with no credentials
# allowed, a header can carry nothing the browser adds on its own.
ALLOWED_HEADERS = ["*"]


def check_origins(origins: Sequence[str] | None) -> None:
    """ValueError naming `allowed_origins` for one that is not an origin."""
    for o in origins or ():
        try:
            origin(o)
        except ValueError as e:
            raise ValueError(f"allowed_origins: {e}") from None


def add_cors(app: FastAPI, origins: Sequence[str] | None) -> None:
    """Answer cross-origin requests from `origins` (None or empty: none). Add it last: the outermost
    middleware, so a preflight never meets the API key check."""
    check_origins(origins)
    if not origins:
        return
    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=ALLOWED_METHODS,
                       allow_headers=ALLOWED_HEADERS, allow_credentials=False)
