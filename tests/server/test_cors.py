"""Cross-origin requests: off by default; with --allowed-origins, preflights answered before the API key and
the named origins (only those) let read the answers. The router and the omni server take the same flag."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from server_helpers import make_engine

from kvpool.router.app import ReplicaSpec, Router, create_app
from kvpool.server.serve import start_server

APP = "https://app.example.com"
# (as the OpenAI JS SDK sends it from a browser: its own x-stainless-* headers too)
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,x-stainless-retry-count"}


def test_a_server_answers_the_origins_it_names_and_no_others(chat_llama_dir: Path) -> None:
    engine = make_engine(chat_llama_dir)
    h = start_server(engine, served_model_name="tiny", api_key="k", allowed_origins=[APP])
    try:
        url = f"{h.url}/v1/chat/completions"
        pre = httpx.options(url, headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == APP
        assert "POST" in pre.headers["access-control-allow-methods"]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        ok = httpx.post(url, json=body, headers={"Origin": APP, "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP
        other = httpx.post(url, json=body, headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in other.headers
        assert httpx.options(url, headers={**PREFLIGHT, "Origin": "https://evil.example"}).status_code == 400
        no_key = httpx.post(url, json=body, headers={"Origin": APP})
        assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == APP
    finally:
        h.stop()
    plain = start_server(make_engine(chat_llama_dir), served_model_name="tiny")
    try:
        r = httpx.options(f"{plain.url}/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    finally:
        plain.stop()
    with pytest.raises(ValueError, match=r"^allowed_origins: 'app.example.com' is not an origin"):
        start_server(engine, allowed_origins=["app.example.com"])


def test_the_routers_preflights_pass_its_key() -> None:
    router = Router([ReplicaSpec("http://127.0.0.1:9")], block_size=16)
    client = TestClient(create_app(router, api_key="k", allowed_origins=["*"]))
    pre = client.options("/v1/completions", headers=PREFLIGHT)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": APP}).status_code == 401


def test_a_port_in_use_is_refused_before_the_model_loads(chat_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """(vLLM binds its socket first too: uvicorn's own bind came after the model had loaded, and exited 3.)"""
    import socket

    import kvpool.server.serve as serve_mod
    from kvpool.cli import main

    def no_load(**_: object) -> None:
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr(serve_mod, "LLMEngine", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(chat_llama_dir), "--port", str(port)]) == 2
    assert f"kvpool: error: port: cannot listen on 127.0.0.1:{port} (Address already in use)" in capsys.readouterr().err
