"""The omni pipeline over HTTP (`kvpool omni-serve`, served for real on 127.0.0.1): a tiny chat thinker (SmolLM2's
tokenizer and chat template on a tiny random Llama) with the seeded vision tower, then a tiny talker.

- A chat with a PNG picture returns the text and codes that `Pipeline.generate` gives in Python for the same
  picture through the same processor (`TinyVisionEncoder.preprocess`), on a second pipeline built alike.
- The same picture twice runs the tower once and the second response reports cached tokens; another picture
  misses the cache and runs it again.
- Refusals (bad base64, a remote URL, an image for a pipeline without a vision stage, streaming) are 400s naming
  the field, and leave both stages' KV pools idle.
- Requests waiting while a batch runs go through as one batch, answered as they would be alone; a bad one among
  them fails alone.
- The tower's processor is the normalisation its docstring states.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from kvpool.engine.sampling_params import SamplingParams
from kvpool.omni.pipeline import Pipeline, reference_pipeline
from kvpool.omni.serve import OmniServerHandle, start_omni_server
from kvpool.omni.talker import make_talker

THINKER_TOKENS, TALKER_TOKENS = 4, 3
P0 = "messages[0].content[0].image_url"


def picture(seed: int, size: tuple[int, int] = (13, 21)) -> bytes:
    """Random RGB noise as PNG bytes; size is (width, height)."""
    from PIL import Image

    a = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(raw).decode()}"


def chat(url: str | None, text: str = "What is in this picture?", **kw: object) -> dict:
    parts = ([{"type": "image_url", "image_url": {"url": url}}] if url is not None else []) + [
        {"type": "text", "text": text}]
    return {"model": "omni", "messages": [{"role": "user", "content": parts}], "temperature": 0, **kw}


def pipeline(thinker: Path, talker: Path, vision: bool = True) -> Pipeline:
    engine = dict(block_size=4, num_blocks=64, dtype="float32")
    return reference_pipeline(str(thinker), str(talker), thinker_tokens=THINKER_TOKENS, talker_tokens=TALKER_TOKENS,
                              layer=0, thinker_engine=engine, talker_engine=engine, vision=vision, seed=0,
                              dtype="float32")


@pytest.fixture(scope="module")
def talker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_talker(tmp_path_factory.mktemp("talker"), seed=3, max_position_embeddings=512)


@pytest.fixture(scope="module")
def omni(chat_llama_dir: Path, talker_dir: Path) -> Iterator[OmniServerHandle]:
    h = start_omni_server(pipeline(chat_llama_dir, talker_dir))
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
    ("max_tokens", chat(None, max_tokens=0), "max_tokens", "max_tokens: must be an int >= 1, got 0"),
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

    def held_generate(prompts: list, *a: object, **kw: object) -> list:
        batches.append(len(prompts))
        if len(batches) == 1:  # hold the first run until the others wait behind it
            entered.set()
            assert release.wait(30)
        return generate(prompts, *a, **kw)

    monkeypatch.setattr(pipe, "generate", held_generate)
    bodies = [chat(data_url(picture(4)), text="First."), chat(data_url(picture(5)), text="Second."),
              chat(None, text="Too long?", max_tokens=100_000), chat(data_url(picture(6)), text="Third.")]
    got: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        got[i] = post(omni, bodies[i])

    threads = [threading.Thread(target=send, args=(0,))]
    threads[0].start()
    assert entered.wait(30)
    threads += [threading.Thread(target=send, args=(i,)) for i in (1, 2, 3)]
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 30
    while omni.worker.num_waiting < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(60)
    # The three that waited ran as one batch; the bad one refused it, so each then ran alone.
    assert batches == [1, 3, 1, 1, 1]
    assert got[2].status_code == 400 and got[2].json()["error"]["param"] == "max_tokens"
    assert got[2].json()["error"]["message"].startswith("max_tokens: 100000 new tokens after a ")
    monkeypatch.setattr(pipe, "generate", generate)
    for i in (0, 1, 3):  # batched or not, the same answer as alone (batch-invariant stages)
        alone = post(omni, bodies[i]).json()
        assert got[i].status_code == 200
        assert got[i].json()["choices"] == alone["choices"] and got[i].json()["omni"]["codes"] == alone["omni"]["codes"]
    assert_idle(omni)


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
