"""Which requests another replica may finish (`resumable`), and how a replacement stream's events are cut
to follow what the client already has (`StreamText`): text matched across other event boundaries, the
role-only chunk and the repeated text dropped, the first stream's id kept, and a replacement that does
not repeat the text refused (`Diverged`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpool.router.resume import Diverged, StreamText, resumable


def completion(text: str | None, finish: str | None = None, id_: str = "cmpl-a", created: int = 1) -> bytes:
    return json.dumps({"id": id_, "object": "text_completion", "created": created,
                       "choices": [{"index": 0, "text": text, "finish_reason": finish}]}).encode()


def chat(delta: dict[str, Any], finish: str | None = None, id_: str = "chatcmpl-a", created: int = 1) -> bytes:
    return json.dumps({"id": id_, "object": "chat.completion.chunk", "created": created,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode()


@pytest.mark.parametrize("body,ok", [
    ({"temperature": 0}, True),
    ({"temperature": 0.0, "n": 1}, True),
    ({"top_k": 1, "temperature": 0.8}, True),
    ({"seed": 7, "temperature": 0.8}, True),
    ({}, False),  # sampled (temperature 1 by default) without a seed
    ({"temperature": 0.7}, False),
    ({"temperature": 0, "n": 2}, False),
    ({"temperature": 0, "echo": True}, False),
    ({"seed": True}, False),  # (a bool is not a seed)
    ({"temperature": False}, False),
    ({"temperature": "0"}, False),
    ({"temperature": 0, "tools": [{"type": "function", "function": {"name": "f"}}]}, False),  # (tool deltas)
    ({"temperature": 0, "logprobs": True}, False),  # (per-token logprobs a text skip would cut wrongly)
    ({"temperature": 0, "logprobs": 2}, False),
    ({"temperature": 0, "top_logprobs": 3}, False),
    ({"temperature": 0, "prompt_logprobs": 0}, False),  # (the replacement's first chunk would carry them again)
    ({"temperature": 0, "prompt_logprobs": None}, True),
    ({"temperature": 0, "return_token_ids": True}, False),
    ({"temperature": 0, "return_token_ids": False}, True),
    ({"temperature": 0, "tools": []}, True),
    ({"temperature": 0, "prompt": ["a", "b"]}, False),  # (a batch's choices interleave)
    ({"temperature": 0, "prompt": [[1, 2], [3]]}, False),
    ({"temperature": 0, "prompt": ["a"]}, True),
    ({"temperature": 0, "prompt": [1, 2, 3]}, True),  # (one prompt of token ids)
])
def test_resumable(body: dict[str, Any], ok: bool) -> None:
    assert resumable(body) is ok


def test_completion_followed_across_other_event_boundaries() -> None:
    st = StreamText()
    for p in (completion(" Once"), completion(" upon a"), completion(" ti")):
        st.sent(p)
    assert st.text == " Once upon a ti"
    st.restart()
    replacement = [completion(" Once upon", id_="cmpl-b", created=9), completion(" a time", id_="cmpl-b", created=9),
                   completion(" there", "length", id_="cmpl-b", created=9), b"[DONE]"]
    out = [st.follow(p) for p in replacement]
    assert out[0] is None  # all of it sent already
    assert json.loads(out[1]) == json.loads(completion("me"))  # the rest of the word, under the first id
    assert json.loads(out[2]) == json.loads(completion(" there", "length"))
    assert out[3] == b"[DONE]"


def test_chat_drops_the_role_chunk_and_keeps_the_usage() -> None:
    st = StreamText()
    for p in (chat({"role": "assistant", "content": ""}), chat({"content": "Hi"}), chat({"content": " there"})):
        st.sent(p)
    st.restart()
    usage = json.dumps({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 5, "choices": [],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}).encode()
    out = [st.follow(p) for p in (chat({"role": "assistant", "content": ""}, id_="chatcmpl-b"),
                                  chat({"content": "Hi there"}, id_="chatcmpl-b"),
                                  chat({"content": "!"}, "stop", id_="chatcmpl-b"), usage, b"", b"[DONE]")]
    assert out[:2] == [None, None]
    assert json.loads(out[2]) == json.loads(chat({"content": "!"}, "stop"))
    assert json.loads(out[3])["id"] == "chatcmpl-a" and json.loads(out[3])["usage"]["completion_tokens"] == 3
    assert out[4:] == [None, b"[DONE]"]


def test_a_replacement_finishing_on_what_was_sent_keeps_only_the_finish() -> None:
    st = StreamText()
    st.sent(completion(" a b"))
    st.restart()
    assert json.loads(st.follow(completion(" a b", "stop"))) == json.loads(completion("", "stop"))


@pytest.mark.parametrize("replacement,why", [
    ([completion(" Once upon a tide")], "differs"),
    ([completion(" Once")], None),  # a prefix of what was sent: fine so far
    ([completion(" Once", "stop")], "finished before"),
    ([completion(" Once"), b"[DONE]"], "ended before"),
    ([completion(" Once"), json.dumps({"id": "x", "choices": [], "usage": {}}).encode()], "ended before"),
])
def test_a_replacement_that_does_not_repeat_the_text_is_refused(replacement: list[bytes], why: str | None) -> None:
    st = StreamText()
    st.sent(completion(" Once upon a time"))
    st.restart()
    if why is None:
        assert [st.follow(p) for p in replacement] == [None]
        return
    with pytest.raises(Diverged, match=why):
        for p in replacement:
            st.follow(p)


def test_a_second_take_up_repeats_what_the_first_replacement_relayed() -> None:
    st = StreamText()
    st.sent(completion("Hello"))
    st.restart()  # B takes it up, relays more, then fails too
    assert st.follow(completion("Hello world")) is not None and st.text == "Hello world"
    st.restart()  # C
    out = [st.follow(p) for p in (completion("Hello wor"), completion("ld foo", "stop"), b"[DONE]")]
    assert out[0] is None and json.loads(out[1])["choices"][0]["text"] == " foo" and out[2] == b"[DONE]"
    assert st.text == "Hello world foo" and st.finished and st.done


def test_what_the_client_already_has_of_the_end() -> None:
    st = StreamText()
    st.sent(completion("Hi"))
    assert not st.finished and not st.done
    st.sent(completion("", "stop"))
    assert st.finished and not st.done
    st.sent(b"[DONE]")
    assert st.done


def test_a_replacement_error_and_its_end_are_passed_on_once() -> None:
    st = StreamText()
    st.sent(completion(" Once upon"))
    st.restart()
    err = json.dumps({"error": {"message": "engine died", "type": "x", "param": None, "code": 503}}).encode()
    assert st.follow(err) == err
    assert st.follow(b"[DONE]") == b"[DONE]"  # not a second, made-up error: it ended with its own


def test_a_replacement_ending_short_is_not_complete() -> None:
    st = StreamText()
    st.sent(completion(" Once upon"))
    st.restart()
    assert st.follow(completion(" Once")) is None and not st.complete()
    assert st.follow(completion(" upon a")) is not None and st.complete()


def test_a_client_gone_before_the_body_still_closes_the_replicas_answer() -> None:
    """Starlette cancels a streamed response whose client leaves before the body starts; the relay's own
    clean-up never runs then, so the response closes the replica's answer itself, and the replica is no
    longer counted in flight."""
    import asyncio
    from types import SimpleNamespace

    from kvpool.router.app import _relay, _RelayResponse, _Upstream

    events: list[str] = []

    class Answer:  # the replica's streamed answer (httpx.Response's part the relay uses)
        async def aclose(self) -> None:
            events.append("closed")

    async def chunks() -> Any:
        yield b"data: {}\n\n"

    async def run() -> None:
        router = SimpleNamespace(done=lambda name: events.append(f"done {name}"), replicas={})
        up = _Upstream("http://r", 0, Answer(), chunks(), b"", True)  # type: ignore[arg-type]
        response = _RelayResponse(up, router, _relay(up, router, None))  # type: ignore[arg-type]

        async def receive() -> dict[str, str]:
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await asyncio.sleep(0.5)  # the headers take a while: the disconnect is seen first

        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        assert not up.relayed

    asyncio.run(run())
    assert events == ["closed", "done http://r"]
