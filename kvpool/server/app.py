"""The OpenAI-compatible HTTP API over an AsyncEngine: completions, chat completions, models, health,
Prometheus metrics and a prefix-cache reset.

Every failure a client can cause is an OpenAI-style error object ({"error": {"message", "type",
"param", "code"}}) with a 4xx status; the engine thread never sees an invalid request. Bodies are read
and parsed here rather than by FastAPI's automatic validation, so size limits, UTF-8 and JSON errors
and field errors all get the same shape and status 400/413.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from kvpool.core import hit_rules
from kvpool.core.pins import Pin, PinBudgetExceeded, PrefixNotCached
from kvpool.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestStream
from kvpool.engine.chat_template import ChatOptions
from kvpool.engine.lora_request import LoRARequest
from kvpool.engine.outputs import CompletionOutput, RequestOutput
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.multimodal import MMInput
from kvpool.server.errors import (
    APIError,
    ClientDisconnected,
    add_error_handlers,
    check_api_key,
    read_raw,
    until_disconnected,
)
from kvpool.server.json_body import BodyError, parse_json_object
from kvpool.server.logprobs import LogprobsWriter, Prompt, prompt_logprobs_json
from kvpool.server.media import MediaOptions, chat_with_images, image_parts
from kvpool.server.metrics import ServerMetrics
from kvpool.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    PinRequest,
    StreamOptions,
    TokenizeRequest,
    chat_messages,
)

M = TypeVar("M", bound=BaseModel)


def template_refused(e: Exception) -> APIError:
    """A chat template's own error (roles out of order, a field it needs), not jinja's TemplateError (the
    engine's ValueError): the client's messages, so a 400 naming them."""
    return APIError(400, f"messages: the chat template refused them: {e}", "messages")


async def read_body(request: Request, model: type[M], max_bytes: int) -> M:
    raw = await read_raw(request, max_bytes)
    try:
        data = parse_json_object(raw, request.headers.get("content-type"))
    except BodyError as e:
        raise APIError(400, str(e)) from None
    try:
        # Strict: a wrong JSON type is an error ("stream": "yes", "seed": "5"), not coerced.
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        raise _validation_error(e) from None


# Union members show up in pydantic's error locations ("prompt.str", "content.list[...]"); users name fields.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|bytes|none|list|dict)$|[\[\]-]")


def _path(parts: Sequence[str | int]) -> str:
    """A location as the request writes it, list indexes in brackets (`messages[0].content`): the form every
    `param` of kvpool's takes (images' parts, a batch's prompts), so a client maps each back one way."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _validation_error(e: ValidationError) -> APIError:
    by_field: dict[str, list[str]] = {}
    for err in e.errors():
        loc = list(err["loc"])
        cut = next((i for i, p in enumerate(loc) if i and isinstance(p, str) and _TYPE_TAG.search(p)), len(loc))
        inner = _path([p for p in loc[cut:] if not (isinstance(p, str) and _TYPE_TAG.search(p))])
        msg = f"{inner}: {err['msg']}" if inner else err["msg"]
        msgs = by_field.setdefault(_path(loc[:cut]) or "body", [])
        if msg not in msgs:
            msgs.append(msg)
    field, msgs = next(iter(by_field.items()))
    # Several messages for one field: it is a union, and the value matched none of its forms.
    return APIError(400, f"{field}: {' / '.join(msgs[:4])}", field)


def usage_json(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """Each prompt counted once (n > 1: it is computed once, shared), every choice's tokens."""
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


async def merged(streams: Sequence[RequestStream], n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt number, output) from a batch's streams as they come, each output's choices numbered across
    the batch (prompt i's choice j is i * n + j, as OpenAI's and vLLM's). A stream's error ends it all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, replace(item, outputs=[replace(c, index=i * n + c.index) for c in item.outputs])
    finally:
        for t in tasks:
            t.cancel()


class _TextDeltas:
    """Text to send in each streamed chunk. Holds back what may still change: a trailing partial UTF-8
    character (decoded as U+FFFD) and the last len(stop)-1 characters, which may be the start of a stop
    string that the finished text will not contain."""

    def __init__(self, params: SamplingParams) -> None:
        stops: list[str] = params.stop or []  # type: ignore[assignment]
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def next(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            end -= self._hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta


def create_app(engine: AsyncEngine, *, model_name: str, metrics: ServerMetrics, api_key: str | None = None,
               max_body_bytes: int = 4 << 20, media: MediaOptions | None = None,
               kv_events_instance: str | None = None, trust_request_chat_template: bool = False) -> FastAPI:
    """`kv_events_instance`: the id of the replica's KV-event stream, told on /health (header
    `kvpool-instance`) so that a router polling it sees a restart even when the new stream's first
    batches are lost (the id changes with every process). /health also says what a hit needs from each
    layer group (header `kvpool-kv-groups`). `trust_request_chat_template`: a chat's own `chat_template`
    is rendered (vLLM's --trust-request-chat-template); without it, refused."""
    app = FastAPI(title="kvpool", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    # What a prefix hit needs from each layer group, also told on /health: a router indexing this replica's
    # KV events finds the prefix every group can serve (kvpool.core.hit_rules).
    kv_groups = hit_rules.encode(engine.engine.kv.hit_rules)
    media = media or MediaOptions()

    add_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        # Any route whose engine call finds the engine stopped (or a step failed under its request: the
        # message says to retry): 503, not a 500 with the connection dropped.
        return APIError(503, str(e)).response()

    def authorize(request: Request) -> None:
        check_api_key(request, api_key)

    def loras() -> dict[str, LoRARequest]:
        return {r.lora_name: r for r in engine.list_loras()}

    def check_model(name: str | None) -> LoRARequest | None:
        """The LoRA adapter that `model` names (None: the base model); 404 for a name this server lacks."""
        if name is None or name == model_name:
            return None
        lora = loras().get(name)
        if lora is None:
            have = ", ".join(f"`{n}`" for n in [model_name, *loras()])
            raise APIError(404, f"model: The model `{name}` does not exist (this server has {have})", "model")
        return lora

    def chat_options(body: ChatCompletionRequest | TokenizeRequest) -> ChatOptions:
        options = body.chat_options()
        if options.template is not None and not trust_request_chat_template:
            raise ValueError("chat_template: a request's own chat template needs a server started with "
                             "--trust-request-chat-template")
        return options

    async def start(prompt: str | list[int], params: SamplingParams, salt: str | None,
                    mm_inputs: Sequence[MMInput] = (), lora: LoRARequest | None = None,
                    rename: dict[str, str] | None = None) -> RequestStream:
        try:
            return await engine.add_request(prompt, params, request_id=uuid.uuid4().hex, cache_salt=salt,
                                            mm_inputs=mm_inputs, lora_request=lora)
        except ValueError as e:
            raise APIError.from_value_error(e, rename) from None
        except EngineOverloadedError as e:
            raise APIError(503, f"server overloaded: {e}; retry later") from None

    async def finish(request: Request, streams: Sequence[RequestStream], n: int = 1) -> list[RequestOutput]:
        """The final outputs, prompt by prompt (choices numbered across them); aborts every request if the
        client goes away first."""

        async def last() -> list[RequestOutput]:
            outs: dict[int, RequestOutput] = {}
            async for i, out in merged(streams, n):
                outs[i] = out
            assert len(outs) == len(streams)
            return [outs[i] for i in range(len(streams))]

        try:
            done, outs = await until_disconnected(last(), request)
            if not done or outs is None:
                raise ClientDisconnected
            return outs
        except ValueError as e:  # refused on the engine thread when queued (e.g. a request id in use)
            raise APIError.from_value_error(e) from None
        finally:
            for stream in streams:
                stream.abort()

    def finish_fields(out: CompletionOutput | None, final: bool) -> dict[str, Any]:
        """A choice's finish_reason and vLLM's stop_reason (the stop string or stop_token_ids entry that ended
        it; None for EOS and the length limit), both None until the choice's last chunk."""
        if out is None or not final:
            return {"finish_reason": None, "stop_reason": None}
        return {"finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    def logprobs_writer(params: SamplingParams, chat: bool, echo: bool = False) -> LogprobsWriter | None:
        """A choice's, when the request asks for logprobs (`echo`: the prompt's first)."""
        if params.logprobs is None:
            return None
        return LogprobsWriter(engine.engine.token_texts, chat, params.logprobs if echo else None)

    def whole_logprobs(params: SamplingParams, out: RequestOutput, choice: CompletionOutput, chat: bool,
                       echo: bool = False) -> dict[str, Any] | None:
        """A finished choice's logprobs, all at once (a response that is not streamed)."""
        w = logprobs_writer(params, chat, echo)
        return w.next(choice.logprobs, prompt_of(out)) if w else None

    def prompt_of(out: RequestOutput) -> Prompt | None:
        return (out.prompt_token_ids, out.prompt_logprobs) if out.prompt_logprobs is not None else None

    def prompt_fields(out: RequestOutput, k: int | None, ids: bool) -> dict[str, Any]:
        """The prompt's fields vLLM adds when asked: `prompt_logprobs` (k top tokens) and `prompt_token_ids`
        (return_token_ids); none until all asked for are known (n > 1: child 0 computes the log-probabilities)."""
        fields: dict[str, Any] = {}
        if k is not None:
            p = prompt_of(out)
            if p is None:
                return {}
            fields["prompt_logprobs"] = prompt_logprobs_json(p, k, engine.engine.token_texts)
        if ids:
            fields["prompt_token_ids"] = out.prompt_token_ids
        return fields

    def sse(streams: Sequence[RequestStream],
            chunk: Callable[[str, CompletionOutput, bool, dict[str, Any] | None], dict[str, Any]],
            params: SamplingParams, options: StreamOptions | None, rid: str, obj: str, stamp: int,
            first: Sequence[dict[str, Any]] = (), first_prompt_tokens: int = 0,
            model: str = model_name, shape: Callable[[int, RequestOutput], RequestOutput] | None = None,
            prompt_extra: Callable[[RequestOutput], dict[str, Any]] | None = None, extra_in_choice: bool = True,
            echo: bool = False, token_ids: bool = False) -> StreamingResponse:
        """The streams' chunks: one choice each (n > 1 or a batch of prompts: the choices interleave, each
        by its index, as OpenAI's and vLLM's do), a choice's text held back as `_TextDeltas` says, its
        finish_reason on its last chunk. `options.include_usage`: a last chunk with the usage (null in the
        others, as OpenAI's); with `continuous_usage_stats` too, each chunk carries its own choice's usage so
        far, its prompt's tokens and the choice's (vLLM's; `first` chunks: `first_prompt_tokens` and none).
        `shape(i, out)`: prompt i's output as the client sees it (echo); `prompt_extra(out)`: fields a
        choice's first chunk carries once they are known (prompt_logprobs: n > 1, child 0 computes them), in
        the choice or at the top; `echo`: the logprobs start with the prompt's; `token_ids`: each chunk's choice
        carries the ids of the tokens since its last chunk (vLLM's return_token_ids)."""
        deltas = [_TextDeltas(params) for _ in range(len(streams) * params.n)]
        ended = [False] * len(deltas)
        opened = [False] * len(deltas)
        ids_sent = [0] * len(deltas)
        logprobs = [logprobs_writer(params, obj.startswith("chat"), echo) for _ in deltas]
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options is not None and options.continuous_usage_stats
        last: dict[int, RequestOutput] = {}

        def data(body: dict[str, Any], prompt_tokens: int = 0, completion_tokens: int = 0) -> str:
            if include_usage:
                body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens} if continuous else None
            return f"data: {json.dumps(body)}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                for body in first:
                    yield data(body, first_prompt_tokens)
                async for i, out in merged(streams, params.n):
                    if shape is not None:
                        out = shape(i, out)
                    last[i] = out
                    for o in out.outputs:
                        if ended[o.index]:
                            continue
                        final = o.finish_reason is not None
                        text = deltas[o.index].next(o.text, final)
                        if text or final:  # (with the logprobs of every token since the choice's last chunk)
                            ended[o.index] = final
                            w = logprobs[o.index]
                            body = chunk(text, o, final, w.next(o.logprobs, prompt_of(out)) if w else None)
                            if token_ids:
                                body["choices"][0]["token_ids"] = o.token_ids[ids_sent[o.index]:]
                                ids_sent[o.index] = len(o.token_ids)
                            extra = prompt_extra(out) if prompt_extra is not None and not opened[o.index] else None
                            if extra:
                                opened[o.index] = True
                                (body["choices"][0] if extra_in_choice else body).update(extra)
                            yield data(body, len(out.prompt_token_ids), len(o.token_ids))
                if include_usage and last:
                    body = {"id": rid, "object": obj, "created": stamp, "model": model,
                            "choices": [], "usage": usage_json(list(last.values()))}
                    yield f"data: {json.dumps(body)}\n\n"
            except EngineDeadError as e:  # (the same error object as a response's, `param` included)
                yield f"data: {json.dumps(APIError(503, str(e)).body())}\n\n"
            except ValueError as e:  # refused on the engine thread when queued
                yield f"data: {json.dumps(APIError.from_value_error(e).body())}\n\n"
            finally:
                for stream in streams:
                    stream.abort()  # a no-op when finished; frees the blocks when the client left mid-stream
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' checks)
    async def health() -> Response:
        if not engine.is_alive:
            return APIError(503, "the engine is not running").response()
        headers = {hit_rules.HEADER: kv_groups}
        if kv_events_instance:
            headers["kvpool-instance"] = kv_events_instance
        return JSONResponse({"status": "ok"}, headers=headers)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if engine.is_alive:
            try:
                pinned_blocks, st = await engine.call(lambda e: (e.expire_pins(), e.stats()))
                metrics.pinned_blocks.set(pinned_blocks)
                metrics.pins.set(st.num_pins)
                # Usage as of now, not of the last step: a pin, an unpin or an expiry with no step after
                # it changes it too (and routers read it as the replica's load).
                metrics.set_load(st.num_running, st.num_waiting, st.kv_usage)
            except EngineDeadError:
                pass
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def pin_json(pin: Pin) -> dict[str, Any]:
        left = None if pin.expires_at is None else max(0.0, pin.expires_at - time.monotonic())
        return {"id": pin.pin_id, "object": "pin", "num_tokens": pin.num_tokens, "num_blocks": len(pin.blocks),
                "block_ids": pin.block_ids, "expires_in": left}

    async def chat_prefix(messages: list[ChatMessage], template_kwargs: dict[str, Any] | None) -> list[int]:
        try:
            return await engine.chat_prefix(chat_messages(messages), template_kwargs)
        except ValueError:
            raise
        except Exception as e:
            raise template_refused(e) from None

    @app.post("/v1/pins")
    async def pin_prefix(request: Request) -> JSONResponse:
        """Pin a prefix (text or token ids) for `ttl` seconds: computed first if not cached; 409 over
        the pin budget (never pinned in part)."""
        authorize(request)
        body = await read_body(request, PinRequest, max_body_bytes)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give the prefix as `prompt` (text or token ids) or as `messages` (a "
                                "chat's first messages), one of the two", "prompt")
        field = "prompt" if body.messages is None else "messages"
        rename = {"prompt_token_ids": field, "pin_prefix": field}
        if body.messages is not None and (parts := image_parts(body.messages)):
            # (A pin is of the chat's text alone: it would hold tokens that no chat with the image starts with.)
            where = parts[0][0]
            raise APIError(400, f"{where}: a pinned prefix is text only; pin the messages before the first image",
                           where)
        try:
            prompt = (body.prompt if body.messages is None
                      else await chat_prefix(body.messages, body.chat_options().template_kwargs))

            def pin(e: Any) -> Pin:
                return e.pin_prefix(prompt, ttl=body.ttl, cache_salt=body.cache_salt)

            try:
                return JSONResponse(pin_json(await engine.call(pin)))
            except PrefixNotCached:
                # Compute the prefix (one token of output), then pin what it cached.
                await finish(request, [await start(prompt, SamplingParams(max_tokens=1), body.cache_salt,
                                                   rename=rename)])
                return JSONResponse(pin_json(await engine.call(pin)))
        except PinBudgetExceeded as e:
            raise APIError(409, APIError.from_value_error(e, rename).message, field) from None
        except PrefixNotCached as e:
            raise APIError(409, f"{e} (evicted again before it could be pinned; retry)", field) from None
        except ValueError as e:
            raise APIError.from_value_error(e, rename) from None

    @app.get("/v1/pins")
    async def list_pins(request: Request) -> JSONResponse:
        authorize(request)
        pins = await engine.call(lambda e: e.list_pins())
        return JSONResponse({"object": "list", "data": [pin_json(p) for p in pins]})

    @app.delete("/v1/pins/{pin_id:path}")  # (any id, "/" included, gets a 404 body, not a redirect)
    async def unpin(pin_id: str, request: Request) -> JSONResponse:
        authorize(request)
        if not await engine.call(lambda e: e.unpin(pin_id)):
            raise APIError(404, f"pin: no pin {pin_id!r} (unpinned, or its TTL passed)")
        return JSONResponse({"id": pin_id, "object": "pin", "deleted": True})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        base = {"id": model_name, "object": "model", "created": created, "owned_by": "kvpool",
                "root": str(engine.model_dir), "parent": None, "max_model_len": engine.max_model_len}
        # LoRA adapters as vLLM lists them: their folder as `root`, the base model as `parent`.
        adapters = [{"id": r.lora_name, "object": "model", "created": created, "owned_by": "kvpool",
                     "root": r.lora_path, "parent": model_name, "max_model_len": engine.max_model_len}
                    for r in loras().values()]
        return JSONResponse({"object": "list", "data": [base, *adapters]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's /tokenize: the token ids a prompt (or a chat, its template rendered) is served as."""
        authorize(request)
        body = await read_body(request, TokenizeRequest, max_body_bytes)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give `prompt` (text) or `messages` (a chat), one of the two", "prompt")
        if body.messages is not None and (parts := image_parts(body.messages)):
            where = parts[0][0]
            raise APIError(400, f"{where}: a chat with images is not tokenized here (its image tokens come from "
                                f"the image processor)", where)
        llm = engine.engine
        try:
            options = chat_options(body)  # (checked for a prompt too: contradictory options are refused)
            if body.prompt is not None:
                ids = await asyncio.to_thread(llm.encode, body.prompt, body.add_special_tokens)
            else:
                ids = await asyncio.to_thread(llm.apply_chat_template, chat_messages(body.messages), True, options)
            strs = await asyncio.to_thread(llm.token_strs, ids) if body.return_token_strs else None
        except ValueError as e:
            raise APIError.from_value_error(e) from None
        except Exception as e:
            raise template_refused(e) from None
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's /detokenize: the text of token ids (special tokens included, as vLLM decodes them)."""
        authorize(request)
        body = await read_body(request, DetokenizeRequest, max_body_bytes)
        check_model(body.model)
        try:
            return JSONResponse({"prompt": await asyncio.to_thread(engine.engine.decode, body.tokens)})
        except ValueError as e:
            raise APIError.from_value_error(e) from None

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        authorize(request)
        ok = await engine.reset_prefix_cache()
        if not ok:
            raise APIError(409, "prefix cache not reset: running requests hold blocks; retry when idle")
        return JSONResponse({"reset": True})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body = await read_body(request, CompletionRequest, max_body_bytes)
        lora = check_model(body.model)
        served = lora.lora_name if lora is not None else model_name
        try:
            prompts, params = body.prompts(), body.to_sampling_params(engine.engine.sampling_defaults)
            renames = body.structured_renames()
        except ValueError as e:
            raise APIError.from_value_error(e, {"prompt_token_ids": "prompt"}) from None
        if len(prompts) > engine.max_pending:  # (a 503 "retry later" would never pass)
            raise APIError(400, f"prompt: a batch of {len(prompts)} prompts is more than this server holds in "
                                f"flight (--max-pending {engine.max_pending}); send at most that many at once",
                           "prompt")
        streams: list[RequestStream] = []
        echoed: list[str] = []  # each prompt's text, before its choices' texts (echo)
        sent: list[int | None] = []  # each prompt's token count as sent (None: text), to tell a truncation
        try:
            for i, prompt in enumerate(prompts):  # (a batch: each prompt a request; all or none)
                name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                if body.echo:
                    try:
                        echoed.append(prompt if isinstance(prompt, str) else
                                      await asyncio.to_thread(engine.engine.decode, prompt))
                    except ValueError as e:
                        raise APIError.from_value_error(e, {"tokens": name}) from None
                if isinstance(prompt, str) and not body.add_special_tokens:
                    try:
                        prompt = await asyncio.to_thread(engine.engine.encode, prompt, False)
                    except ValueError as e:
                        raise APIError.from_value_error(e, {"prompt": name}) from None
                sent.append(len(prompt) if isinstance(prompt, list) else None)
                streams.append(await start(prompt, params, body.cache_salt, lora=lora,
                                           rename={"prompt_token_ids": name, "prompt": name, **renames}))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        rid, stamp = f"cmpl-{streams[0].request_id}", int(time.time())  # (one `created` for every chunk)
        asked = body.prompt_logprobs  # (echo with logprobs computes them too, shown in `logprobs` only)
        truncated: set[int] = set()  # (prompts whose echo is the prompt the engine ran, decoded)

        def shape(i: int, out: RequestOutput) -> RequestOutput:
            """The prompt's text before each choice's; with max_tokens 0 the prompt alone (the token the
            engine sampled to finish the prompt is dropped: the choice ends by its length, 0)."""
            if not body.echo:
                return out
            if i not in truncated and (out.prompt is None if sent[i] is None
                                       else len(out.prompt_token_ids) < sent[i]):
                truncated.add(i)
                echoed[i] = engine.engine.decode(out.prompt_token_ids)
            if body.echo_only:
                return replace(out, outputs=[
                    replace(c, text=echoed[i], token_ids=[], logprobs=[] if c.logprobs is not None else None,
                            finish_reason="length" if c.finish_reason else None, stop_reason=None)
                    for c in out.outputs])
            return replace(out, outputs=[replace(c, text=echoed[i] + c.text) for c in out.outputs])

        def choice(text: str, out: CompletionOutput, final: bool, logprobs: dict[str, Any] | None) -> dict[str, Any]:
            return {"index": out.index, "text": text, "logprobs": logprobs, **finish_fields(out, final)}

        if body.stream:
            return sse(streams, lambda t, o, f, lp: {"id": rid, "object": "text_completion", "created": stamp,
                                                     "model": served, "choices": [choice(t, o, f, lp)]},
                       params, body.stream_options, rid, "text_completion", stamp, model=served, shape=shape,
                       prompt_extra=lambda out: prompt_fields(out, asked, body.return_token_ids), echo=body.echo,
                       token_ids=body.return_token_ids)
        outs = [shape(i, out) for i, out in enumerate(await finish(request, streams, params.n))]
        return JSONResponse({"id": rid, "object": "text_completion", "created": stamp, "model": served,
                             "choices": [{**choice(o.text, o, True, whole_logprobs(params, out, o, False, body.echo)),
                                          **prompt_fields(out, asked, body.return_token_ids),
                                          **({"token_ids": o.token_ids} if body.return_token_ids else {})}
                                         for out in outs for o in out.outputs],
                             "usage": usage_json(outs)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await read_body(request, ChatCompletionRequest, max_body_bytes)
        lora = check_model(body.model)
        served = lora.lora_name if lora is not None else model_name
        mm: list[MMInput] = []
        rename = body.param_renames()
        try:
            params = body.to_sampling_params(engine.engine.sampling_defaults)
            options = chat_options(body)
            if image_parts(body.messages):  # decoded, checked and preprocessed before the engine sees them
                ids, mm = await asyncio.to_thread(chat_with_images, engine, body.messages, media, model_name,
                                                  options)
            else:
                ids = await engine.apply_chat_template(body.chat_messages(), options)
        except ValueError as e:
            raise APIError.from_value_error(e, rename) from None
        except Exception as e:
            raise template_refused(e) from None
        stream = await start(ids, params, body.cache_salt, mm, lora, rename)
        rid, stamp = f"chatcmpl-{stream.request_id}", int(time.time())  # (one `created` for every chunk)

        def chunk(text: str, out: CompletionOutput | None, final: bool, logprobs: dict[str, Any] | None = None,
                  index: int = 0, delta: dict[str, Any] | None = None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": stamp, "model": served,
                    "choices": [{"index": out.index if out is not None else index,
                                 "delta": delta if delta is not None else {"content": text},
                                 "logprobs": logprobs, **finish_fields(out, final)}]}

        if body.stream:
            # Each choice opens with the assistant's role, as vLLM's do; the first chunk of all carries the prompt's
            # token ids (return_token_ids), as vLLM's. (The request was made: its truncation is valid.)
            n_prompt = engine.engine.truncated_length(len(ids), params)
            opening = [chunk("", None, False, None, i, {"role": "assistant", "content": ""}) for i in range(params.n)]
            if body.return_token_ids:
                opening[0]["prompt_token_ids"] = ids[len(ids) - n_prompt:]
            return sse([stream], chunk, params, body.stream_options, rid, "chat.completion.chunk", stamp,
                       first=opening, first_prompt_tokens=n_prompt, model=served,
                       prompt_extra=lambda out: prompt_fields(out, body.prompt_logprobs, False),
                       extra_in_choice=False, token_ids=body.return_token_ids)
        [out] = await finish(request, [stream])
        return JSONResponse({"id": rid, "object": "chat.completion", "created": stamp, "model": served,
                             "choices": [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                                          "logprobs": whole_logprobs(params, out, o, chat=True),
                                          **finish_fields(o, True),
                                          **({"token_ids": o.token_ids} if body.return_token_ids else {})}
                                         for o in out.outputs],
                             "usage": usage_json([out]),
                             **prompt_fields(out, body.prompt_logprobs, body.return_token_ids)})

    return app
