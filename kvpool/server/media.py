"""Images in OpenAI chat requests: `{"type": "image_url", "image_url": {"url": ...}}` content parts, fetched,
checked, decoded with Pillow, and turned into the prompt's token ids and the engine's multimodal inputs.

Where an image may come from:
- `data:image/...;base64,...` URLs, decoded here;
- `file://` URLs, only under the directory named by `--allowed-local-media-path` (as in vLLM), symlinks
  resolved before the check, so a link cannot lead out of it;
- never `http(s)://`: this server has no network access, and fetching a client's URL from the server would
  let clients make it reach other hosts. Such URLs are refused with a 400 that says so.

Every refusal is a ValueError whose message starts with the JSON path of the part at fault
(`messages[0].content[1].image_url: ...`), which the server returns as an HTTP 400 naming that path: a bad
scheme, bad base64, a non-image media type, bytes Pillow cannot read, a format outside `SUPPORTED_FORMATS`,
an image over `max_image_bytes` (encoded) or `max_image_pixels` (width x height, checked from the header
before the pixels are decoded, so a small file cannot unpack into gigabytes), more images than the model
takes or than `max_images_per_request` (counted before any is read), a `file://` path the OS refuses, or any
image for a model that takes none. All of this happens before the engine sees the request, so a refused
request never holds a KV block. Images are decoded one at a time (`decode_images` is a generator), so a
request holds one full-size decoded picture at once, not all of them.

The pixels then go through the model's own image processor (kvpool.runner.image_inputs) and the chat
template places the model's image token where each image part was. `kvpool omni-serve` (kvpool.omni.serve)
reads and decodes its images with `decode_images` too, then preprocesses them for the omni thinker's tower.
"""

from __future__ import annotations

import base64
import binascii
import errno
import io
import threading
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.engine.chat_template import ChatOptions
from kvpool.runner.multimodal import MMInput
from kvpool.server.protocol import ChatMessage

if TYPE_CHECKING:
    from kvpool.runner.image_inputs import ImageInputs

# Formats a client may send (what OpenAI's API takes, plus BMP); Pillow reads more, but each decoder is attack
# surface that vision models' users do not need.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Formats Pillow names apart that are one of the above: "MPO" is a JPEG carrying an MPF segment (what many phone
# cameras write, for depth or gain maps); Pillow decodes its first picture as the JPEG it is.
_FORMAT_ALIASES = {"MPO": "JPEG"}


@dataclass(frozen=True)
class MediaOptions:
    """The server's limits on images (flags of `kvpool serve` and `kvpool omni-serve`)."""

    allowed_local_media_path: Path | None = None  # file:// URLs only under this directory; None: refused
    max_image_bytes: int = 20 << 20  # an image's encoded size (after base64 decoding)
    max_image_pixels: int = 4096 * 4096  # width x height
    # Images in one request, counted before any is read: each costs a decode (of up to max_image_pixels), so
    # without a bound a request under the body limit could carry dozens of small files that decode huge. (kvpool
    # serve applies it beside its model's own cap.)
    max_images_per_request: int = 8

    def __post_init__(self) -> None:
        if self.max_images_per_request < 1:
            raise ValueError(f"--max-images-per-request: must be >= 1, got {self.max_images_per_request}")


def image_parts(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    """(JSON path, URL) of every image part, in order."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, p in enumerate(m.content):
                if p.type == "image_url" and p.image_url is not None:
                    out.append((f"messages[{i}].content[{j}].image_url", p.image_url.url))
    return out


def check_image_count(parts: Sequence[tuple[str, str]], limit: int, taker: str) -> None:
    """ValueError naming the first part past `limit` (`taker`: who takes at most that many, for the message)."""
    if len(parts) > limit:
        raise ValueError(f"{parts[limit][0]}: {taker} takes at most {limit} image(s) per request, got {len(parts)}")


def _read_data_url(url: str, where: str, opts: MediaOptions) -> bytes:
    header, comma, data = url[len("data:"):].partition(",")
    if not comma:
        raise ValueError(f"{where}: a data URL needs a ',' before its data")
    media_type, *params = header.split(";")
    if "base64" not in (p.strip().lower() for p in params):  # (RFC 2397: the token is case-insensitive)
        raise ValueError(f"{where}: only base64 data URLs are supported (data:image/png;base64,...)")
    if media_type and not media_type.lower().startswith("image/"):
        raise ValueError(f"{where}: media type {media_type!r} is not an image type")
    data = "".join(data.split())  # line breaks are common in pasted base64
    size = len(data) * 3 // 4 - data[-2:].count("=")  # the decoded size, known before decoding
    if size > opts.max_image_bytes:
        raise ValueError(f"{where}: the image is {size} bytes, over the limit of {opts.max_image_bytes} "
                         f"(--max-image-bytes)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: invalid base64 data ({e})") from None


def _read_file_url(url: str, where: str, opts: MediaOptions) -> bytes:
    if opts.allowed_local_media_path is None:
        raise ValueError(f"{where}: file:// URLs are disabled on this server (start it with "
                         f"--allowed-local-media-path DIR to allow files under DIR)")
    # Parsing and the file system refuse some URLs with errors of their own (a malformed host, a NUL byte, a name
    # over the OS's length limit, a permission, a file deleted meanwhile): each is the client's URL at fault.
    try:
        parsed = urllib.parse.urlparse(url)
    except ValueError as e:
        raise _unreadable(url, where, e) from None
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"{where}: file:// URLs must name a local file (host {parsed.netloc!r})")
    try:
        path = Path(urllib.request.url2pathname(parsed.path)).resolve()
        root = opts.allowed_local_media_path.resolve()
    except (OSError, ValueError, RuntimeError) as e:  # (RuntimeError: a symlink loop, before Python 3.13)
        raise _unreadable(url, where, e) from None
    if not path.is_relative_to(root):
        raise ValueError(f"{where}: {str(path)!r} is outside the allowed local media path {str(root)!r}")
    try:
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, "no such file")
        size = path.stat().st_size
        if size > opts.max_image_bytes:
            raise ValueError(f"{where}: the image is {size} bytes, over the limit of {opts.max_image_bytes} "
                             f"(--max-image-bytes)")
        with path.open("rb") as f:  # (no more than the limit allows: the file may have grown since its stat)
            return f.read(opts.max_image_bytes + 1)
    except FileNotFoundError:  # (also when deleted between the check and the read)
        raise ValueError(f"{where}: no such file {str(path)!r}") from None
    except OSError as e:
        raise _unreadable(url, where, e) from None


def _unreadable(url: str, where: str, e: OSError | ValueError) -> ValueError:
    """The refusal of a file:// URL that the URL parser or the OS would not take, naming the part. The URL is cut
    short (its length may be what the OS refused), and an OSError gives its reason without the path again."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    shown = url if len(url) <= 120 else f"{url[:100]}...{url[-16:]}"
    return ValueError(f"{where}: cannot read {shown!r} ({reason})")


def read_image_bytes(url: str, where: str, opts: MediaOptions) -> bytes:
    """The encoded image a URL names; ValueError (starting with `where`) when it cannot be had."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        raw = _read_data_url(url, where, opts)
    elif scheme == "file":
        raw = _read_file_url(url, where, opts)
    elif scheme in ("http", "https"):
        raise ValueError(f"{where}: remote image URLs cannot be fetched by this server (it has no network "
                         f"access); send the image inline as a data URL (data:image/png;base64,...)")
    else:
        raise ValueError(f"{where}: unsupported URL scheme {scheme or url[:20]!r} (use a data: URL, or file:// "
                         f"under --allowed-local-media-path)")
    if len(raw) > opts.max_image_bytes:
        raise ValueError(f"{where}: the image is {len(raw)} bytes, over the limit of {opts.max_image_bytes} "
                         f"(--max-image-bytes)")
    if not raw:
        raise ValueError(f"{where}: the image is empty")
    return raw


_pillow_limit = threading.Lock()


def _allow_pixels(limit: int) -> None:
    """Raise Pillow's own decompression-bomb limit to `limit` where it is lower. Pillow refuses in `Image.open` an
    image over twice its limit (about 179 MP), before our check can run: with --max-image-pixels above that, an
    image within the server's limit was refused, and the refusal cited the server's limit. Ours is checked from
    the header before any pixel is decoded, so it is the one that applies. Only ever raised (never lowered, so a
    server with a larger limit in the same process keeps it), under a lock so two raises cannot undo each other."""
    from PIL import Image

    with _pillow_limit:
        if Image.MAX_IMAGE_PIXELS is not None and limit > Image.MAX_IMAGE_PIXELS:
            Image.MAX_IMAGE_PIXELS = limit


def decode_image(raw: bytes, where: str, opts: MediaOptions) -> Any:
    """A fully decoded PIL image; ValueError for unreadable data, an unsupported format or too many pixels."""
    from PIL import Image, UnidentifiedImageError

    _allow_pixels(opts.max_image_pixels)
    with warnings.catch_warnings():
        # Pillow warns (and past twice its own limit, raises) on huge images; our own limit is checked below.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(raw))
        except UnidentifiedImageError:
            raise ValueError(f"{where}: not an image Pillow can read (supported formats: "
                             f"{', '.join(SUPPORTED_FORMATS)})") from None
        except Image.DecompressionBombError:
            raise ValueError(f"{where}: the image has too many pixels (limit {opts.max_image_pixels}, "
                             f"--max-image-pixels)") from None
        except Exception as e:  # a header Pillow recognised but could not parse
            raise ValueError(f"{where}: could not decode the image ({e})") from None
        fmt = _FORMAT_ALIASES.get(img.format, img.format)
        if fmt not in SUPPORTED_FORMATS:
            raise ValueError(f"{where}: unsupported image format {img.format} (supported: "
                             f"{', '.join(SUPPORTED_FORMATS)})")
        w, h = img.size
        if w * h > opts.max_image_pixels:
            raise ValueError(f"{where}: the image is {w}x{h} = {w * h} pixels, over the limit of "
                             f"{opts.max_image_pixels} (--max-image-pixels)")
        if w < 1 or h < 1:
            raise ValueError(f"{where}: the image is empty ({w}x{h})")
        try:
            img.load()  # decode now: a truncated or corrupt file fails here, not in the processor
        except Exception as e:
            raise ValueError(f"{where}: could not decode the {fmt} image ({e})") from None
    return img


def _template_messages(messages: Sequence[ChatMessage], image_token: str | None) -> list[dict[str, Any]]:
    """Messages for the chat template. With `image_token` None, messages holding images get OpenAI-style content
    lists ({"type": "image"} / {"type": "text"} parts, which multimodal templates render); otherwise their
    content is a string with the image token's text where each image was (for templates that take strings)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        parts = m.content if isinstance(m.content, list) else None
        if parts is None or not any(p.type == "image_url" for p in parts):
            out.append({"role": role, "content": m.text()})
        elif image_token is None:
            out.append({"role": role, "content": [{"type": "text", "text": p.text} if p.type == "text"
                                                  else {"type": "image"} for p in parts]})
        else:
            # (parts a line apart, as vLLM joins a string template's text and image placeholders)
            out.append({"role": role, "content": "\n".join(p.text or "" if p.type == "text" else image_token
                                                           for p in parts)})
    return out


def decode_images(messages: Sequence[ChatMessage], opts: MediaOptions) -> Iterator[tuple[str, Any]]:
    """(JSON path, decoded PIL image) of every image part, in order: read, size-checked and decoded (blocking: run
    it off the event loop). Raises ValueError naming the part at fault. Any server taking pictures (`kvpool serve`,
    `kvpool omni-serve`) goes through here, so they all refuse the same things in the same words.

    One at a time, as the caller asks for the next: a caller that preprocesses each image (down to the model's
    size) before asking holds one full-size picture at once rather than every picture of the request. The
    image count is the caller's to check first (`check_image_count`), before any is read."""
    for where, url in image_parts(messages):
        yield where, decode_image(read_image_bytes(url, where, opts), where, opts)


class ImageChatModel(Protocol):
    """What `chat_with_images` needs of a served model (kvpool.engine.async_engine.AsyncEngine has it)."""

    @property
    def images(self) -> ImageInputs | None: ...

    @property
    def takes_image_tensors(self) -> bool: ...

    def render_chat(self, messages: list[dict[str, Any]], options: ChatOptions | None = None) -> list[int]: ...


def chat_with_images(engine: ImageChatModel, messages: Sequence[ChatMessage], opts: MediaOptions, model_name: str,
                     chat: ChatOptions | None = None) -> tuple[list[int], list[MMInput]]:
    """The prompt's token ids and the engine's inputs for a chat holding image parts (blocking: run it off the
    event loop). Raises ValueError naming the part at fault."""
    parts = image_parts(messages)
    images = engine.images
    if images is None:
        where = parts[0][0]
        if engine.takes_image_tensors:
            # (a cross-attention model without its processor, or an omni thinker's tower)
            raise ValueError(f"{where}: the model `{model_name}` has no image processor "
                             f"(preprocessor_config.json); pass preprocessed images through the Python API")
        raise ValueError(f"{where}: the model `{model_name}` does not take images")
    check_image_count(parts, images.max_images, f"the model `{model_name}`")
    check_image_count(parts, opts.max_images_per_request, "this server (--max-images-per-request)")
    mm: list[MMInput] = []
    for where, img in decode_images(messages, opts):
        try:
            mm += images.process([img])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        del img  # (before the next one is decoded)
    try:
        ids = engine.render_chat(_template_messages(messages, None), chat)
    except ValueError:
        raise
    except Exception:  # e.g. a template that concatenates contents as strings; try that form below
        ids = None
    if ids is None or ids.count(images.image_token_id) != len(parts):
        # A template that renders only string contents: put the image token's text in place of each image.
        try:
            ids = engine.render_chat(_template_messages(messages, images.image_token), chat)
        except ValueError:
            raise
        except Exception as e:  # the template refused the conversation (e.g. roles out of order)
            raise ValueError(f"messages: the chat template refused them: {e}") from None
    return ids, mm
