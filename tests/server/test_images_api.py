"""Images over the OpenAI API: `image_url` content parts on /v1/chat/completions, served for real by the tiny
chat Mllama (`chat_mllama_dir`: tokenizer, chat template and transformers' image processor in the folder).

- Greedy tokens over HTTP equal the Python API's (`LLM.generate` with the processor's tiles) and transformers'
  own (`MllamaProcessor` + `MllamaForConditionalGeneration.generate`) for the same picture and prompt.
- The same picture twice runs the vision tower once (the encoder cache, keyed by content) and the second
  request reports its prefix-cache hit in usage.prompt_tokens_details.cached_tokens; another picture shares
  nothing.
- Every refusal (remote URL, bad base64, a non-image, an unsupported format, an oversize image, too many images,
  file:// outside the allowed directory or a path the OS refuses, an image for a text-only model) is a 400
  naming the part, and leaves no request and no KV block behind.
- A JPEG carrying MPF data (Pillow's "MPO", as phone cameras write) is served as the JPEG it is, and a data URL's
  `;base64` token is read in any case (RFC 2397).
- With --max-image-pixels above Pillow's own bomb limit, the server's limit is the one that applies.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers import data_url, picture
from server_helpers import make_engine

from kvpool.engine.async_engine import AsyncEngine, StepReport
from kvpool.engine.llm import LLM
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.multimodal import TiledImageInput
from kvpool.server.media import MediaOptions, read_image_bytes
from kvpool.server.serve import ServerHandle, start_server

BS = 4
N_OUT = 6
MAX_BYTES = 24 << 10
MAX_PIXELS = 96 * 96






def chat(url: str | list[str], text: str = "What is in this picture?", **kw: object) -> dict:
    urls = [url] if isinstance(url, str) else url
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return {"model": "vis", "messages": [{"role": "user", "content": parts}], "max_tokens": N_OUT,
            "temperature": 0, **kw}


@pytest.fixture(scope="module")
def vis(chat_mllama_dir: Path, media_dir: Path) -> Iterator[ServerHandle]:
    opts = MediaOptions(media_dir, max_image_bytes=MAX_BYTES, max_image_pixels=MAX_PIXELS)
    h = start_server(make_engine(chat_mllama_dir, block_size=BS), served_model_name="vis", media=opts)
    yield h
    h.stop()


def finished_outputs(h: ServerHandle) -> tuple[list[RequestOutput], object]:
    """Collects the engine's finished outputs (token ids, which the OpenAI response does not carry)."""
    got: list[RequestOutput] = []

    def listen(report: StepReport) -> None:
        got.extend(report.finished)

    h.engine.add_listener(listen)
    return got, listen


def post(h: ServerHandle, body: dict) -> httpx.Response:
    return httpx.post(f"{h.url}/v1/chat/completions", json=body, timeout=60)


def test_tokens_equal_the_python_api_and_transformers(vis: ServerHandle, chat_mllama_dir: Path) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, MllamaForConditionalGeneration, MllamaProcessor

    # A wide and a tall picture: different tilings (aspect ratio ids), one image per request.
    pics = [picture(1, (21, 13)), picture(2, (9, 30))]
    got, listen = finished_outputs(vis)
    try:
        texts = []
        for raw in pics:
            r = post(vis, chat(data_url(raw)))
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        deadline = time.monotonic() + 10
        while len(got) < len(pics) and time.monotonic() < deadline:
            time.sleep(0.01)  # listeners run just after the outputs are pushed to the HTTP handlers
    finally:
        vis.engine.remove_listener(listen)
    http_tokens = [o.outputs[0].token_ids for o in got]

    tok = AutoTokenizer.from_pretrained(str(chat_mllama_dir))
    images = [Image.open(io.BytesIO(raw)) for raw in pics]
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    prompt_text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
    assert [o.prompt_token_ids for o in got] == [ids, ids]

    # The Python API, given the image processor's tiles directly.
    proc = AutoImageProcessor.from_pretrained(str(chat_mllama_dir))
    mm = []
    for img in images:
        f = proc(images=[[img]], return_tensors="pt")
        mm.append([TiledImageInput(f["pixel_values"][0, 0], int(f["aspect_ratio_ids"][0, 0]),
                                   f["aspect_ratio_mask"][0, 0])])
    assert mm[0][0].aspect_ratio_id != mm[1][0].aspect_ratio_id
    llm = LLM(str(chat_mllama_dir), dtype="float32", block_size=BS, num_blocks=256)
    py = llm.generate([ids, ids], SamplingParams.greedy(N_OUT), use_tqdm=False, mm_inputs=mm)
    assert [o.outputs[0].token_ids for o in py] == http_tokens

    # transformers end to end: its processor (text and image) and its model.
    processor = MllamaProcessor(image_processor=proc, tokenizer=tok, chat_template=tok.chat_template)
    ref = MllamaForConditionalGeneration.from_pretrained(str(chat_mllama_dir), dtype=torch.float32)
    want = []
    with torch.inference_mode():
        for img in images:
            inputs = processor(text=prompt_text, images=[img], return_tensors="pt", add_special_tokens=False)
            assert inputs["input_ids"][0].tolist() == ids
            out = ref.generate(**inputs, max_new_tokens=N_OUT, min_new_tokens=N_OUT, do_sample=False)
            want.append(out[0, len(ids):].tolist())
    assert http_tokens == want
    assert want[0] != want[1]  # the picture matters
    assert texts == [tok.decode(t, skip_special_tokens=True) for t in want]


def test_same_image_twice_runs_the_encoder_once_and_hits_the_prefix_cache(vis: ServerHandle) -> None:
    eng = vis.engine.engine
    assert eng.mm is not None
    runs, hits = eng.mm.encoder_runs, eng.mm.cache.hits
    url = data_url(picture(11))
    first, second = post(vis, chat(url)), post(vis, chat(url))
    assert first.status_code == second.status_code == 200
    assert eng.mm.encoder_runs == runs + 1  # the second request took the encoder cache's states
    assert eng.mm.cache.hits == hits + 1
    u1, u2 = first.json()["usage"], second.json()["usage"]
    n = u1["prompt_tokens"]
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    # Every full block of the prompt but the last token's is cached (the image keys the first block).
    assert u2["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BS * BS > 0
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]
    # The same picture as a JPEG is other pixels: another image, no hit, another encoder run.
    other = post(vis, chat(data_url(picture(11, fmt="JPEG"), "image/jpeg")))
    assert other.status_code == 200
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert eng.mm.encoder_runs == runs + 2
    # The same text without the image shares no block with it either.
    plain = {"model": "vis", "max_tokens": 2, "messages": [{"role": "user", "content": "What is in this picture?"}]}
    r = post(vis, plain)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_openai_client_sends_images(vis: ServerHandle) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{vis.url}/v1", api_key="unused", max_retries=0)
    url = data_url(picture(4))
    r = client.chat.completions.create(model="vis", max_tokens=N_OUT, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                                     {"type": "text", "text": "What is in this picture?"}]}])
    assert r.choices[0].message.content == post(vis, chat(url)).json()["choices"][0]["message"]["content"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="vis", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert e.value.status_code == 400 and "cannot be fetched" in e.value.message


def test_cache_salt_isolates_the_encoder_cache(vis: ServerHandle) -> None:
    eng = vis.engine.engine
    url = data_url(picture(12))
    runs = eng.mm.encoder_runs

    def send(salt: str | None) -> tuple[int, int]:
        body = chat(url, max_tokens=1) | ({"cache_salt": salt} if salt else {})
        r = post(vis, body)
        assert r.status_code == 200, r.text
        return eng.mm.encoder_runs - runs, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    a1, a2, b, none = send("tenant-a"), send("tenant-a"), send("tenant-b"), send(None)
    # Within a salt the picture is encoded once and the prompt's blocks are shared; across salts (and without
    # one) neither: a tenant cannot tell from timing that another sent this picture.
    assert [a1[0], a2[0], b[0], none[0]] == [1, 1, 2, 3]
    assert a1[1] == 0 and a2[1] > 0 and b[1] == 0 and none[1] == 0


def test_a_template_that_takes_only_strings_gets_the_image_token_in_the_text(chat_mllama_dir: Path,
                                                                            smol_dir: Path) -> None:
    from kvpool.server.media import chat_with_images
    from kvpool.server.protocol import ChatCompletionRequest

    eng = make_engine(chat_mllama_dir, block_size=BS)
    eng.tokenizer.chat_template = (smol_dir / "chat_template.jinja").read_text()  # renders content as a string
    body = ChatCompletionRequest.model_validate(chat(data_url(picture(1)), text="Hi there"))
    ids, mm = chat_with_images(AsyncEngine(eng), body.messages, MediaOptions(), "vis")
    assert len(mm) == 1 and ids.count(eng.images.image_token_id) == 1
    # (parts a line apart, as vLLM puts a string template's image placeholder before the text)
    assert ids == eng.apply_chat_template([{"role": "user", "content": "<|image|>\nHi there"}])


def test_file_url_under_the_allowed_path(vis: ServerHandle, media_dir: Path) -> None:
    by_file = post(vis, chat((media_dir / "cat.png").as_uri()))
    inline = post(vis, chat(data_url(picture(7))))
    assert by_file.status_code == inline.status_code == 200, by_file.text
    assert by_file.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
    assert inline.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same pixels, same hash


def test_streaming_with_an_image(vis: ServerHandle) -> None:
    body = chat(data_url(picture(3)), stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{vis.url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == post(vis, chat(data_url(picture(3)))).json()["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == N_OUT


def _tiff() -> bytes:
    return picture(5, (8, 8), "TIFF")


P0 = "messages[0].content[0].image_url"
BAD = [
    ("https", chat("https://example.com/cat.png"), P0,
     f"{P0}: remote image URLs cannot be fetched by this server (it has no network access); send the image "
     "inline as a data URL (data:image/png;base64,...)"),
    ("http", chat("http://10.0.0.1/cat.png"), P0,
     f"{P0}: remote image URLs cannot be fetched by this server (it has no network access); send the image "
     "inline as a data URL (data:image/png;base64,...)"),
    ("ftp", chat("ftp://example.com/cat.png"), P0,
     f"{P0}: unsupported URL scheme 'ftp' (use a data: URL, or file:// under --allowed-local-media-path)"),
    ("bad base64", chat("data:image/png;base64,iVBORw0K#$%"), P0,
     f"{P0}: invalid base64 data (Only base64 data is allowed)"),
    ("base64 padding", chat("data:image/png;base64,iVBORw0KG"), P0,
     f"{P0}: invalid base64 data (Invalid base64-encoded string: number of data characters (9) cannot be 1 more "
     "than a multiple of 4)"),
    ("not base64", chat("data:image/png,rawbytes"), P0,
     f"{P0}: only base64 data URLs are supported (data:image/png;base64,...)"),
    ("not an image type", chat(data_url(picture(1), "text/plain")), P0,
     f"{P0}: media type 'text/plain' is not an image type"),
    ("not an image", chat(data_url(b"just some text, no picture")), P0,
     f"{P0}: not an image Pillow can read (supported formats: PNG, JPEG, WEBP, GIF, BMP)"),
    ("tiff", chat(data_url(_tiff(), "image/tiff")), P0,
     f"{P0}: unsupported image format TIFF (supported: PNG, JPEG, WEBP, GIF, BMP)"),
    ("truncated", chat(data_url(picture(1, (40, 40))[:300])), P0, f"{P0}: could not decode the PNG image ("),
    ("too many bytes", chat(data_url(picture(1, (95, 95)))), P0,
     f"{P0}: the image is {len(picture(1, (95, 95)))} bytes, over the limit of {MAX_BYTES} (--max-image-bytes)"),
    ("too many pixels", chat(data_url(picture(0, (97, 96), solid=True))), P0,
     f"{P0}: the image is 97x96 = 9312 pixels, over the limit of {MAX_PIXELS} (--max-image-pixels)"),
    ("two images", chat([data_url(picture(1)), data_url(picture(2))]), "messages[0].content[1].image_url",
     "messages[0].content[1].image_url: the model `vis` takes at most 1 image(s) per request, got 2"),
    ("outside the allowed path", chat("file:///etc/hostname"), P0,
     f"{P0}: '/etc/hostname' is outside the allowed local media path"),
    ("no such file", chat("file:///MEDIA/none.png"), P0, f"{P0}: no such file"),
    ("escaping ..", chat("file:///MEDIA/../x.png"), P0, "x.png' is outside the allowed local media path"),
    # Inside the folder, but refused by the OS or by the URL parser: the part, not the chat template, is at fault.
    ("a name over the OS's limit", chat("file:///MEDIA/" + "a" * 300 + ".png"), P0, "aaa.png' (File name too long)"),
    ("a NUL byte", chat("file:///MEDIA/a%00b.png"), P0, "a%00b.png' (embedded null byte)"),
    ("a malformed host", chat("file://[x/cat.png"), P0, f"{P0}: cannot read 'file://[x/cat.png' (Invalid IPv6 URL)"),
    ("a symbolic link loop", chat("file:///MEDIA/loop"), P0, f"{P0}: cannot read 'file://"),
    ("the image token typed in the text too", chat(data_url(picture(1)), text="<|image|> twice?"), "messages",
     "messages: the prompt must hold the image token (id 49152) exactly once for its image; found it 2 times"),
    ("unknown part", {"model": "vis", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content", "messages[0].content: Input should be a valid string / [0].type: Input should be 'text' or "
     "'image_url'"),
    ("image_url not an object", {"model": "vis", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]}]},
     "messages[0].content", "messages[0].content: Input should be a valid string / [0].image_url: Input should be a "
     "valid dictionary or instance of ImageURL"),
    ("image part without its url", {"model": "vis", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]},
     "messages[0].content", "messages[0].content: Input should be a valid string / [1]: Value error, a part of type "
     "'image_url' needs a 'image_url' field"),
]


def test_a_jpeg_with_mpf_data_is_served_as_a_jpeg(vis: ServerHandle) -> None:
    from PIL import Image

    # Pillow opens a JPEG with an MPF segment (a second picture after the first) as format "MPO".
    img = Image.open(io.BytesIO(picture(8, (16, 16), "JPEG")))
    buf = io.BytesIO()
    img.save(buf, "MPO", save_all=True, append_images=[img.rotate(90)])
    mpo = buf.getvalue()
    assert mpo[:3] == b"\xff\xd8\xff" and Image.open(io.BytesIO(mpo)).format == "MPO"
    r = post(vis, chat(data_url(mpo, "image/jpeg")))
    assert r.status_code == 200, r.text
    # Its first picture, as a plain JPEG of the same pixels gives it.
    plain = io.BytesIO()
    Image.open(io.BytesIO(mpo)).convert("RGB").save(plain, "PNG")
    assert r.json()["choices"] == post(vis, chat(data_url(plain.getvalue()))).json()["choices"]


def test_the_base64_token_of_a_data_url_is_read_in_any_case(vis: ServerHandle) -> None:
    raw = base64.b64encode(picture(1)).decode()
    want = post(vis, chat(f"data:image/png;base64,{raw}"))
    assert want.status_code == 200, want.text
    for url in (f"data:image/png;BASE64,{raw}", f"data:IMAGE/PNG;Base64,{raw}"):
        r = post(vis, chat(url))
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == want.json()["choices"]


def _png_header(width: int, height: int) -> bytes:
    """A PNG (8-bit grey) that declares width x height, with data that is not zlib's: Pillow reads the size from
    its header, and only decoding, after the size checks, fails (before touching the pixels)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"not zlib data") + chunk(b"IEND", b"")


def test_the_servers_pixel_limit_applies_above_pillows(chat_mllama_dir: Path, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    from PIL import Image

    # Pillow refuses in Image.open what is over twice its own limit (about 179 MP); this server allows 400 MP.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # (restored after the test)
    limit = 400_000_000
    assert 2 * Image.MAX_IMAGE_PIXELS < 20_000 * 10_000
    h = start_server(make_engine(chat_mllama_dir, block_size=BS), served_model_name="vis",
                     media=MediaOptions(max_image_pixels=limit))
    try:
        # Within the server's limit: past the size checks, to the decoder (which finds the data broken).
        r = post(h, chat(data_url(_png_header(20_000, 10_000))))
        assert r.status_code == 400
        assert r.json()["error"]["message"] == f"{P0}: could not decode the PNG image (broken data stream when " \
                                               "reading image file)", r.text
        # Over it: refused as over the server's limit, with the image's size.
        r = post(h, chat(data_url(_png_header(30_000, 15_000))))
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (f"{P0}: the image is 30000x15000 = 450000000 pixels, over the limit "
                                                f"of {limit} (--max-image-pixels)")
        assert h.engine.num_pending == 0
    finally:
        h.stop()


@pytest.mark.parametrize(("body", "param", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_images_are_a_400_naming_the_part(vis: ServerHandle, media_dir: Path, body: dict, param: str,
                                              message: str) -> None:
    body = json.loads(json.dumps(body).replace("file:///MEDIA", media_dir.as_uri()))
    eng = vis.engine.engine
    runs = eng.mm.encoder_runs
    r = post(vis, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == 400
    assert message in err["message"]
    assert eng.mm.encoder_runs == runs
    # Nothing queued, no block held; the server still serves images.
    assert vis.engine.num_pending == 0
    assert vis.engine.call_soon(lambda e: e.kv.get_num_free_blocks() == e.kv.block_pool.num_usable_blocks
                                ).result(10)
    assert post(vis, chat(data_url(picture(1)), max_tokens=1)).status_code == 200


def test_an_image_for_a_text_only_model(server: ServerHandle) -> None:
    body = {**chat(data_url(picture(1))), "model": "tiny"}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": f"{P0}: the model `tiny` does not take images",
                                 "type": "invalid_request_error", "param": P0, "code": 400}
    assert server.engine.num_pending == 0
    # Text parts alone are still fine for it.
    body = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_file_urls_are_refused_without_an_allowed_path(tmp_path: Path) -> None:
    f = tmp_path / "a.png"
    f.write_bytes(picture(1))
    with pytest.raises(ValueError) as e:
        read_image_bytes(f.as_uri(), "x", MediaOptions())
    assert str(e.value) == ("x: file:// URLs are disabled on this server (start it with --allowed-local-media-path "
                            "DIR to allow files under DIR)")
    # A symlink inside the allowed directory that leads out of it is outside too.
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link.png").symlink_to(f)
    with pytest.raises(ValueError, match=r"^x: '.*/a\.png' is outside the allowed local media path"):
        read_image_bytes((allowed / "link.png").as_uri(), "x", MediaOptions(allowed))
    assert read_image_bytes(f.as_uri(), "x", MediaOptions(tmp_path)) == picture(1)


def test_an_engine_with_a_vision_tower_but_no_image_processor(chat_llama_dir: Path) -> None:
    # The omni pipeline's thinker takes images as tensors (a seeded tower, no transformers processor): over HTTP
    # it says so rather than that the model takes no images.
    from kvpool.runner.vision import TinyVisionEncoder
    from kvpool.server.media import chat_with_images
    from kvpool.server.protocol import ChatCompletionRequest

    eng = make_engine(chat_llama_dir, vision_encoder=TinyVisionEncoder(out_dim=64), num_blocks=32)
    body = ChatCompletionRequest.model_validate(chat(data_url(picture(1))))
    with pytest.raises(ValueError) as e:
        chat_with_images(AsyncEngine(eng), body.messages, MediaOptions(), "omni")
    assert str(e.value) == (f"{P0}: the model `omni` has no image processor (preprocessor_config.json); pass "
                            "preprocessed images through the Python API")
