"""The omni pipeline over HTTP (`kvpool omni-serve`, served for real on 127.0.0.1): a tiny chat thinker (SmolLM2's
tokenizer and chat template on a tiny random Llama) with the seeded vision tower, then a tiny talker.

- A chat with a PNG picture returns the text and codes that `Pipeline.generate` gives in Python for the same
  picture through the same processor (`TinyVisionEncoder.preprocess`), on a second pipeline built alike.
- The same picture twice runs the tower once and the second response reports cached tokens; another picture
  misses the cache and runs it again.
- Refusals (bad base64, a remote URL, a file:// URL the OS refuses, an image for a pipeline without a vision
  stage, more images than --max-images-per-request, streaming) are 400s naming the field as the client sent it
  (`max_completion_tokens`, `messages`), and leave both stages' KV pools idle. Images are counted before any is
  decoded, and each is preprocessed before the next is decoded.
- A chat the thinker takes but the talker could not (its prompt grows with the thinker's prompt and output) is
  refused before the thinker runs, naming `messages` and the pipeline's limit, which /v1/models reports.
- Requests waiting while a batch runs go through as one batch, answered as they would be alone; a bad one among
  them fails alone. A request whose client leaves before its batch starts is dropped unrun.
- A request sent while the worker is failing is answered (503), never left waiting.
- The tower's processor is the normalisation its docstring states.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from helpers import data_url, picture

from kvpool.engine.sampling_params import SamplingParams
from kvpool.omni.pipeline import Pipeline, reference_pipeline
from kvpool.omni.serve import OmniServerHandle, start_omni_server
from kvpool.omni.talker import make_talker
from kvpool.server.media import MediaOptions

THINKER_TOKENS, TALKER_TOKENS = 4, 3
P0 = "messages[0].content[0].image_url"






def chat(url: str | None, text: str = "What is in this picture?", **kw: object) -> dict:
    parts = ([{"type": "image_url", "image_url": {"url": url}}] if url is not None else []) + [
        {"type": "text", "text": text}]
    return {"model": "omni", "messages": [{"role": "user", "content": parts}], "temperature": 0, **kw}


def pipeline(thinker: Path, talker: Path, vision: bool = True, thinker_blocks: int = 64) -> Pipeline:
    engine = dict(block_size=4, num_blocks=64, dtype="float32")
    return reference_pipeline(str(thinker), str(talker), thinker_tokens=THINKER_TOKENS, talker_tokens=TALKER_TOKENS,
                              layer=0, thinker_engine={**engine, "num_blocks": thinker_blocks}, talker_engine=engine,
                              vision=vision, seed=0, dtype="float32")


@pytest.fixture(scope="module")
def talker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_talker(tmp_path_factory.mktemp("talker"), seed=3, max_position_embeddings=512)


@pytest.fixture(scope="module")
def omni(chat_llama_dir: Path, talker_dir: Path) -> Iterator[OmniServerHandle]:
    h = start_omni_server(pipeline(chat_llama_dir, talker_dir))
    yield h
    h.stop()


# `limited`: a thinker whose context (1020 tokens) is longer than the talker's (252, less its 3 codes: 250), and
# image limits: file:// URLs under a folder, two images per request.
LIMIT = 64 * 4 - 4 - TALKER_TOKENS + 1


@pytest.fixture(scope="module")
def limited(chat_llama_dir: Path, talker_dir: Path, media_dir: Path) -> Iterator[OmniServerHandle]:
    h = start_omni_server(pipeline(chat_llama_dir, talker_dir, thinker_blocks=256),
                          media=MediaOptions(media_dir, max_images_per_request=2))
    yield h
    h.stop()


def post(h: OmniServerHandle, body: dict) -> httpx.Response:
    return httpx.post(f"{h.url}/v1/chat/completions", json=body, timeout=60)


def encoder_runs(h: OmniServerHandle) -> int:
    return h.pipeline.stages[0].engine.mm.encoder_runs


def assert_idle(h: OmniServerHandle) -> None:
    for st in h.pipeline.stages:
        kv = st.engine.kv
        kv.check_integrity()
        assert kv.get_num_free_blocks() == kv.block_pool.num_usable_blocks
        assert not st.engine.has_unfinished_requests()


def test_text_and_codes_equal_the_python_pipeline(omni: OmniServerHandle, chat_llama_dir: Path,
                                                  talker_dir: Path) -> None:
    from PIL import Image

    raw = picture(1)
    r = post(omni, chat(data_url(raw)))
    assert r.status_code == 200, r.text
    got = r.json()

    ref = pipeline(chat_llama_dir, talker_dir)
    tower = ref.vision_encoder
    ids = ref.stages[0].engine.apply_chat_template([{"role": "user", "content": "What is in this picture?"}])
    prompt, mm = ref.image_prompt(ids, [tower.preprocess(Image.open(io.BytesIO(raw)))])
    want = ref.generate([prompt], [mm], [SamplingParams.greedy(THINKER_TOKENS)])[0]

    assert got["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert got["omni"]["codes"] == want.codes and len(want.codes) == TALKER_TOKENS
    assert got["usage"]["prompt_tokens"] == len(prompt) == tower.num_tokens + len(ids)
    assert got["usage"]["completion_tokens"] == len(want.stages[0].token_ids) == THINKER_TOKENS
    assert got["omni"]["stage_prompt_tokens"] == [len(prompt), len(prompt) + THINKER_TOKENS - 1]
    # Without max_tokens the thinker writes the server's --thinker-tokens; with it, as many as asked.
    short = post(omni, chat(data_url(raw), max_tokens=2)).json()
    assert short["usage"]["completion_tokens"] == 2 and len(short["omni"]["codes"]) == TALKER_TOKENS
    assert_idle(omni)


def test_same_image_twice_runs_the_encoder_once_and_hits_the_cache(omni: OmniServerHandle) -> None:
    runs = encoder_runs(omni)
    first = post(omni, chat(data_url(picture(2)), text="Describe it."))
    assert first.status_code == 200, first.text
    assert encoder_runs(omni) == runs + 1
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = post(omni, chat(data_url(picture(2)), text="Describe it."))
    assert encoder_runs(omni) == runs + 1  # the tower did not run again
    a, b = first.json(), second.json()
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert b["omni"]["stage_cached_tokens"][0] == b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert b["choices"][0]["message"] == a["choices"][0]["message"] and b["omni"]["codes"] == a["omni"]["codes"]
    # Another picture, same text: the placeholder tokens are the same, the content hash is not: no hit.
    other = post(omni, chat(data_url(picture(3)), text="Describe it."))
    assert encoder_runs(omni) == runs + 2
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other.json()["omni"]["codes"] != a["omni"]["codes"]  # the picture reaches the talker
    assert_idle(omni)


BAD = [
    ("bad base64", chat("data:image/png;base64,iVBORw0K#$%"), P0,
     f"{P0}: invalid base64 data (Only base64 data is allowed)"),
    ("http", chat("http://10.0.0.1/cat.png"), P0,
     f"{P0}: remote image URLs cannot be fetched by this server (it has no network access); send the image "
     "inline as a data URL (data:image/png;base64,...)"),
    ("file without an allowed path", chat("file:///etc/hostname"), P0,
     f"{P0}: file:// URLs are disabled on this server (start it with --allowed-local-media-path DIR to allow "
     "files under DIR)"),
    ("stream", chat(data_url(picture(1)), stream=True), "stream",
     "stream: not supported by the omni server (the talker's codes come after the thinker's whole text); send "
     "stream=false"),
    ("cache_salt", chat(None, cache_salt="tenant"), "cache_salt", "cache_salt: not supported by the omni server"),
    ("n", chat(None, n=2), "n", "n: the omni server answers with one choice (the talker speaks one text); send n=1"),
    ("logprobs", chat(None, logprobs=True), "logprobs", "logprobs: not supported by the omni server"),
    ("prompt_logprobs", chat(None, prompt_logprobs=0), "prompt_logprobs",
     "prompt_logprobs: not supported by the omni server"),
    ("return_token_ids", chat(None, return_token_ids=True), "return_token_ids",
     "return_token_ids: not supported by the omni server"),
    ("truncate_prompt_tokens", chat(None, truncate_prompt_tokens=5), "truncate_prompt_tokens",
     "truncate_prompt_tokens: not supported by the omni server"),
    ("add_generation_prompt", chat(None, add_generation_prompt=False), "add_generation_prompt",
     "add_generation_prompt: not supported by the omni server"),
    ("chat_template_kwargs", chat(None, chat_template_kwargs={"x": 1}), "chat_template_kwargs",
     "chat_template_kwargs: not supported by the omni server"),
    ("chat_template", chat(None, chat_template="{{ 'x' }}"), "chat_template",
     "chat_template: not supported by the omni server"),
    ("two structured outputs", chat(None, guided_choice=["a"], structured_outputs={"regex": "a"}), "guided_choice",
     "guided_choice: give one of response_format, structured_outputs, guided_json, guided_regex, guided_choice, "
     "guided_grammar, not several (got structured_outputs, guided_choice)"),
    ("max_tokens", chat(None, max_tokens=0), "max_tokens", "max_tokens: must be an int >= 1, got 0"),
    # The field the client sent, as kvpool serve names it (not the engine's max_tokens).
    ("max_completion_tokens", chat(None, max_completion_tokens=0), "max_completion_tokens",
     "max_completion_tokens: must be an int >= 1, got 0"),
]


@pytest.mark.parametrize(("body", "param", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_are_a_400_naming_the_field(omni: OmniServerHandle, body: dict, param: str,
                                                 message: str) -> None:
    runs = encoder_runs(omni)
    r = post(omni, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": 400}
    assert encoder_runs(omni) == runs
    assert_idle(omni)


def test_an_image_for_a_pipeline_without_vision(chat_llama_dir: Path, talker_dir: Path) -> None:
    h = start_omni_server(pipeline(chat_llama_dir, talker_dir, vision=False), model_name="text-omni")
    try:
        models = httpx.get(f"{h.url}/v1/models").json()["data"]
        assert [(m["id"], m["stages"], m["vision"]) for m in models] == [("text-omni", ["thinker", "talker"], False)]
        r = post(h, {**chat(data_url(picture(1))), "model": "text-omni"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == P0
        assert r.json()["error"]["message"] == (f"{P0}: the omni pipeline `text-omni` has no vision stage and takes "
                                                "no images (it was started with --no-vision)")
        assert_idle(h)
        # Text alone is served, and the model must be this server's.
        ok = post(h, {**chat(None, max_tokens=2), "model": "text-omni"})
        assert ok.status_code == 200 and len(ok.json()["omni"]["codes"]) == TALKER_TOKENS
        assert post(h, chat(None)).status_code == 404
        assert httpx.get(f"{h.url}/health").json() == {"status": "ok"}
    finally:
        h.stop()


def test_waiting_requests_run_as_one_batch_and_a_bad_one_fails_alone(omni: OmniServerHandle,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    pipe = omni.pipeline
    generate, batches, entered, release = pipe.generate, [], threading.Event(), threading.Event()

    def held_generate(prompts: list, mm: list, sampling: list) -> list:
        batches.append(len(prompts))
        if len(batches) == 1:  # hold the first run until the others wait behind it
            entered.set()
            assert release.wait(30)
        # A refusal only an engine makes (every one the server can make comes before the worker): max_tokens=3
        # stands for it here.
        if any(sp.max_tokens == 3 for sp in sampling):
            raise ValueError("max_tokens: refused by an engine")
        return generate(prompts, mm, sampling)

    monkeypatch.setattr(pipe, "generate", held_generate)
    bodies = [chat(data_url(picture(4)), text="First."), chat(data_url(picture(5)), text="Second."),
              chat(None, text="Refused in the worker", max_tokens=3), chat(data_url(picture(6)), text="Third."),
              chat(None, text="Too long", max_tokens=100_000)]
    got: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        got[i] = post(omni, bodies[i])

    threads = [threading.Thread(target=send, args=(0,))]
    threads[0].start()
    assert entered.wait(30)
    threads += [threading.Thread(target=send, args=(i,)) for i in (1, 2, 3, 4)]
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 30
    while omni.worker.num_waiting < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    # The one no stage could hold was refused before it reached the worker: it joins no batch.
    threads[4].join(30)
    assert got[4].status_code == 400 and got[4].json()["error"]["param"] == "max_tokens"
    assert got[4].json()["error"]["message"].startswith("max_tokens: 100000 new tokens after a ")
    release.set()
    for t in threads:
        t.join(60)
    # The three that waited ran as one batch; the bad one refused it, so each then ran alone.
    assert batches == [1, 3, 1, 1, 1]
    assert got[2].status_code == 400 and got[2].json()["error"] == {
        "message": "max_tokens: refused by an engine", "type": "invalid_request_error", "param": "max_tokens",
        "code": 400}
    monkeypatch.setattr(pipe, "generate", generate)
    for i in (0, 1, 3):  # batched or not, the same answer as alone (batch-invariant stages)
        alone = post(omni, bodies[i]).json()
        assert got[i].status_code == 200
        assert got[i].json()["choices"] == alone["choices"] and got[i].json()["omni"]["codes"] == alone["omni"]["codes"]
    assert_idle(omni)


def test_a_chat_the_talker_could_not_hold_is_refused_before_the_thinker_runs(limited: OmniServerHandle) -> None:
    pipe = limited.pipeline
    thinker, talker = (s.engine for s in pipe.stages)
    assert (thinker.max_model_len, talker.max_model_len) == (1020, 252)
    # The talker's prompt is the thinker's prompt and output less one token, and it writes TALKER_TOKENS more.
    assert pipe.max_model_len == LIMIT == 250
    models = httpx.get(f"{limited.url}/v1/models").json()["data"]
    assert [m["max_model_len"] for m in models] == [LIMIT]
    computed = thinker.runner.num_tokens_computed
    long_chat = {"model": "omni", "messages": [{"role": "user", "content": "hello " * 300}], "max_tokens": 2}
    r = post(limited, long_chat)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages"
    assert err["message"].startswith("messages: the prompt has ")
    assert f"tokens; the pipeline's context holds {LIMIT}, and one must be left to generate (bound by the talker " \
           "stage, whose prompt grows with the thinker's prompt and output)" in err["message"]
    # Within the thinker's context, past what the talker holds after its output: the field the client sent.
    r = post(limited, chat(None, text="Hi.", max_completion_tokens=LIMIT))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert r.json()["error"]["message"].startswith(f"max_completion_tokens: {LIMIT} new tokens after a ")
    assert f"exceed the pipeline's context of {LIMIT} tokens (at most " in r.json()["error"]["message"]
    assert thinker.runner.num_tokens_computed == computed  # nothing ran for either
    assert_idle(limited)
    # At the limit exactly, both stages run it.
    prompt_len = post(limited, chat(None, text="Hi.", max_tokens=1)).json()["usage"]["prompt_tokens"]
    r = post(limited, chat(None, text="Hi.", max_tokens=LIMIT - prompt_len, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["omni"]["stage_prompt_tokens"] == [prompt_len, LIMIT - 1]
    assert len(r.json()["omni"]["codes"]) == TALKER_TOKENS
    # The Python API refuses it before any stage runs, too.
    computed = thinker.runner.num_tokens_computed
    with pytest.raises(ValueError, match=f"^prompt_token_ids: the prompt has {LIMIT} tokens; the pipeline's "):
        pipe.generate([[5] * LIMIT])
    assert thinker.runner.num_tokens_computed == computed
    assert_idle(limited)


def test_a_client_gone_before_its_batch_starts_is_dropped_unrun(omni: OmniServerHandle,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib
    import threading
    import time

    pipe = omni.pipeline
    generate, runs, entered, release = pipe.generate, [], threading.Event(), threading.Event()

    def held_generate(prompts: list, *a: object, **kw: object) -> list:
        runs.append(len(prompts))
        if len(runs) == 1:
            entered.set()
            assert release.wait(30)
        return generate(prompts, *a, **kw)

    monkeypatch.setattr(pipe, "generate", held_generate)
    first = threading.Thread(target=post, args=(omni, chat(None, text="First.", max_tokens=1)))
    first.start()
    try:
        assert entered.wait(30)
        # The second client gives up while the first batch runs: its connection closes.
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{omni.url}/v1/chat/completions", json=chat(None, text="Gone.", max_tokens=1), timeout=1.0)
        time.sleep(1.0)  # the handler notices (it polls the connection)
    finally:
        release.set()
        first.join(60)
    # A later request is answered after the worker has passed the abandoned one: it ran only the first and this.
    assert post(omni, chat(None, text="Last.", max_tokens=1)).status_code == 200
    assert sum(runs) == 2, runs
    assert omni.worker.num_waiting == 0
    assert_idle(omni)


def test_more_images_than_the_cap_are_refused_before_any_is_decoded(limited: OmniServerHandle,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.server import media

    events: list[str] = []
    decode, tower = media.decode_image, limited.pipeline.vision_encoder
    preprocess = tower.preprocess

    def counted_decode(*a: object) -> object:
        events.append("decode")
        return decode(*a)

    def counted_preprocess(img: object) -> torch.Tensor:
        events.append("preprocess")
        return preprocess(img)

    monkeypatch.setattr(media, "decode_image", counted_decode)
    monkeypatch.setattr(tower, "preprocess", counted_preprocess)
    three = {"model": "omni", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(picture(i))}} for i in range(3)]}]}
    r = post(limited, three)
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "messages[0].content[2].image_url: this server (--max-images-per-request) takes at most 2 "
                   "image(s) per request, got 3",
        "type": "invalid_request_error", "param": "messages[0].content[2].image_url", "code": 400}
    assert events == []  # counted first: nothing was read
    assert_idle(limited)
    # Two are served, each preprocessed (down to the tower's size) before the next is decoded.
    three["messages"][0]["content"].pop()
    r = post(limited, three)
    assert r.status_code == 200, r.text
    assert events == ["decode", "preprocess", "decode", "preprocess"]
    assert r.json()["usage"]["prompt_tokens"] == 2 * tower.num_tokens + len(
        limited.pipeline.stages[0].engine.apply_chat_template([{"role": "user", "content": ""}]))


def test_file_urls_the_os_refuses_are_a_400_naming_the_part(limited: OmniServerHandle, media_dir: Path) -> None:
    root = media_dir.as_uri()
    assert post(limited, chat(f"{root}/cat.png", max_tokens=1)).status_code == 200
    cases = {
        f"{root}/{'a' * 300}.png": "(File name too long)",  # inside the folder, but over the OS's name limit
        f"{root}/a%00b.png": "(embedded null byte)",
        "file://[x/cat.png": "(Invalid IPv6 URL)",
    }
    for url, reason in cases.items():
        r = post(limited, chat(url, max_tokens=1))
        assert r.status_code == 400, (url, r.text)
        err = r.json()["error"]
        assert err["param"] == P0, err
        assert err["message"].startswith(f"{P0}: cannot read 'file://") and err["message"].endswith(f"' {reason}")
    assert_idle(limited)


def test_a_request_sent_while_the_worker_fails_is_answered(chat_llama_dir: Path, talker_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    h = start_omni_server(pipeline(chat_llama_dir, talker_dir, vision=False))
    worker, inbox = h.worker, h.worker._inbox
    second_checked = threading.Event()
    puts: list[object] = []

    class SlowPut:
        """The inbox, with the second request's put delayed: it has seen the worker alive, and loses the CPU
        while the worker fails (the window between a liveness check and the put, made wide)."""

        def __getattr__(self, name: str) -> object:
            return getattr(inbox, name)

        def put(self, item: object) -> None:
            puts.append(item)
            if len(puts) == 2:
                second_checked.set()
                time.sleep(1.0)
            inbox.put(item)

    def broken(*a: object, **kw: object) -> None:
        assert second_checked.wait(30)  # the second request is past submit's check
        raise RuntimeError("a bug in a step")

    monkeypatch.setattr(worker, "_inbox", SlowPut())
    monkeypatch.setattr(h.pipeline, "generate", broken)
    got: dict[str, httpx.Response | str] = {}

    def send(name: str) -> None:
        try:
            got[name] = post(h, chat(None, max_tokens=1)) if name == "a" else httpx.post(
                f"{h.url}/v1/chat/completions", json=chat(None, max_tokens=1), timeout=10)
        except httpx.TimeoutException:
            got[name] = "no answer"

    try:
        a = threading.Thread(target=send, args=("a",))
        a.start()
        deadline = time.monotonic() + 10
        while not puts and time.monotonic() < deadline:
            time.sleep(0.01)
        send("b")
        a.join(30)
        assert isinstance(got["a"], httpx.Response) and got["a"].status_code == 500
        b = got["b"]
        assert isinstance(b, httpx.Response), b
        assert b.status_code == 503
        assert b.json()["error"]["message"] == "the omni pipeline stopped: RuntimeError('a bug in a step')"
        assert inbox.qsize() == 0
    finally:
        h.stop()


def test_the_tower_processor_is_the_documented_normalisation() -> None:
    from PIL import Image

    from kvpool.runner.vision import TinyVisionEncoder

    tower = TinyVisionEncoder(out_dim=64, image_size=8)
    img = Image.open(io.BytesIO(picture(9, (21, 13))))
    # RGB, resized to the tower's size (bicubic), scaled to [0, 1], normalised with mean = std = 0.5, (3, H, W).
    want = np.asarray(img.convert("RGB").resize((8, 8), Image.Resampling.BICUBIC), dtype=np.float32) / 255
    want = ((want - 0.5) / 0.5).transpose(2, 0, 1)
    got = tower.preprocess(img)
    assert got.dtype == torch.float32 and tuple(got.shape) == (3, 8, 8)
    assert np.allclose(got.numpy(), want, atol=1e-6)
    # A grayscale picture becomes three equal channels.
    grey = tower.preprocess(img.convert("L"))
    assert tuple(grey.shape) == (3, 8, 8) and torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])


def test_a_failing_pipeline_fails_its_requests_and_then_refuses(chat_llama_dir: Path, talker_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    h = start_omni_server(pipeline(chat_llama_dir, talker_dir, vision=False))
    try:
        def broken(*a: object, **kw: object) -> None:
            raise RuntimeError("a bug in a step")

        monkeypatch.setattr(h.pipeline, "generate", broken)
        r = post(h, chat(None))
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "internal error: RuntimeError('a bug in a step')"
        assert httpx.get(f"{h.url}/health").status_code == 503
        r = post(h, chat(None))
        assert r.status_code == 503 and r.json()["error"]["message"] == "the omni pipeline is not running"
    finally:
        h.stop()
