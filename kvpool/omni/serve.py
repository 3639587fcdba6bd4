"""`kvpool omni-serve`: the omni pipeline (thinker -> talker, kvpool.omni.pipeline) behind an OpenAI-compatible
API: `/v1/chat/completions`, `/v1/models`, `/health`.

A chat request becomes one pipeline run: the thinker's prompt is its chat template over the messages' text, after
the request's images (OpenAI `image_url` content parts). Images are read, checked and decoded by
kvpool.server.media (the same refusals, in the same words, as `kvpool serve`), then preprocessed by the thinker's
vision tower's own processor (`TinyVisionEncoder.preprocess`, shared with Python callers) and placed before the
text by `Pipeline.image_prompt`, as `kvpool omni --image` places them. The thinker hashes the pixels by content,
so the same picture again hits its prefix cache and its encoder cache (the tower does not run again).

The response is a chat completion whose message is the thinker's text, with the talker's codes in an extra
`omni` object (`codes`, and each stage's prompt and cached token counts); `usage` is the thinker's.

The pipeline runs on one worker thread (`PipelineWorker`): the requests waiting when it is free run together,
as one batch through `Pipeline.generate`. Not supported, each refused with a 400 naming the field: `stream` (the
codes come after the whole text), `cache_salt`, any image when the pipeline has no vision stage, and more images
than `--max-images-per-request` (counted before any is read; they are decoded and preprocessed one at a time).
A chat longer than the pipeline holds (`Pipeline.max_model_len`: the thinker's prompt + max_tokens, which the
talker's prompt grows with; /v1/models reports it) is refused with a 400 naming `messages` or the max-tokens
field the client sent. Errors name the request's fields as `kvpool serve`'s do (`ChatCompletionRequest.
param_renames`). Every refusal happens before the request reaches the worker, so none holds a KV block and none
spoils its batch-mates' run; a request whose client leaves before its batch starts is dropped unrun (the handler
watches the connection as `kvpool serve`'s does, `until_disconnected`), one already running runs to its end (a
batch is not interruptible). A request sent while the worker is failing or stopping gets an error, never silence.

Why a command of its own rather than `kvpool omni serve` or `kvpool serve --omni`: `kvpool omni` takes free-text
prompts as positional arguments (a `serve` subcommand would shadow the prompt "serve"), and `kvpool serve`'s
flags configure one engine, while a pipeline has two stages configured by `kvpool omni`'s flags.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpool.engine.sampling_params import SamplingParams
from kvpool.omni.pipeline import OmniOutput, Pipeline
from kvpool.runner.multimodal import MMInput
from kvpool.server.app import APIError, add_error_handlers, check_api_key, read_body, usage_json
from kvpool.server.cors import add_cors
from kvpool.server.errors import ClientDisconnected, until_disconnected
from kvpool.server.media import MediaOptions, check_image_count, decode_images, image_parts
from kvpool.server.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)

_STOP = object()


class PipelineStopped(RuntimeError):
    """The worker is not running (failed or stopped): the job was not run, and is answered with a 503."""


@dataclass
class _Job:
    prompt: list[int]
    mm: list[MMInput]
    params: SamplingParams
    future: concurrent.futures.Future[OmniOutput]


class PipelineWorker:
    """The pipeline on its own thread: every job waiting when it is free runs in one `Pipeline.generate`."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # Held while a job is checked in and put, and while the worker closes (on a failure, or stopping) and
        # empties the inbox: a job put after that last look would never be answered. Under it, each job is
        # either refused by `submit` or in the inbox before the close empties it.
        self._lock = threading.Lock()
        self._closed = False

    @property
    def is_alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self.error is None
                and not self._closed)

    @property
    def num_waiting(self) -> int:
        """Jobs queued and not yet taken into a batch."""
        return self._inbox.qsize()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpool-omni", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            with self._lock:  # (no job can follow the stop into the inbox)
                self._closed = True
                self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, prompt: list[int], mm: list[MMInput], params: SamplingParams
               ) -> concurrent.futures.Future[OmniOutput]:
        fut: concurrent.futures.Future[OmniOutput] = concurrent.futures.Future()
        with self._lock:
            if not self.is_alive:
                raise PipelineStopped("the omni pipeline is not running")
            self._inbox.put(_Job(prompt, mm, params, fut))
        return fut

    def _run(self) -> None:
        jobs: list[_Job] = []
        try:
            while True:
                first = self._inbox.get()
                batch, stop = [first], first is _STOP
                while not stop:
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    stop = item is _STOP
                    if not stop:
                        batch.append(item)
                # A job whose caller gave up (client gone) before its batch started is dropped unrun.
                jobs = [j for j in batch if j is not _STOP and j.future.set_running_or_notify_cancel()]
                if jobs:
                    self._generate(jobs)
                if stop:
                    self._close()
                    return
        except BaseException as e:  # a bug in a step: fail every request loudly rather than hang them
            log.exception("the omni pipeline failed; it is stopped")
            dead = self._close(e)
            for j in jobs:  # the batch it failed in (when running each alone, those not reached yet)
                if not j.future.done():
                    j.future.set_exception(dead)

    def _close(self, error: BaseException | None = None) -> PipelineStopped:
        """Refuse new jobs from now on (`error`: the failure that stopped the worker) and fail those still queued:
        under the lock, so no `submit` that saw the worker alive can put a job after the inbox was emptied.
        Returns the error the jobs that were never run get."""
        answer = PipelineStopped("the omni pipeline was stopped" if error is None
                                 else f"the omni pipeline stopped: {error!r}")
        with self._lock:
            self._closed = True
            if error is not None and self.error is None:
                self.error = error
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP and item.future.set_running_or_notify_cancel():
                    item.future.set_exception(answer)
        return answer

    def _generate(self, jobs: list[_Job]) -> None:
        try:
            outs = self.pipeline.generate([j.prompt for j in jobs], [j.mm for j in jobs], [j.params for j in jobs])
        except ValueError as e:
            if len(jobs) == 1:
                jobs[0].future.set_exception(e)
                return
            # One bad request refuses the whole batch (LLM.generate frees what it added): run each alone, so
            # only the bad one gets the error.
            for j in jobs:
                self._generate([j])
            return
        except BaseException as e:
            self._close(e)  # first: once its requests are answered, /health and `submit` see the worker stopped
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(e)
            raise
        for j, o in zip(jobs, outs, strict=True):
            j.future.set_result(o)


def omni_json(out: OmniOutput) -> dict[str, Any]:
    """The response's `omni` object: the talker's codes and what each stage read from its caches."""
    return {"codes": out.codes, "stage_prompt_tokens": [len(s.prompt_token_ids) for s in out.stages],
            "stage_cached_tokens": [s.num_cached_tokens for s in out.stages]}


def prepare(pipeline: Pipeline, body: ChatCompletionRequest, media: MediaOptions, model_name: str
            ) -> tuple[list[int], list[MMInput]]:
    """The thinker's prompt and image inputs for a chat (blocking: run it off the event loop); ValueError naming
    the field or the image part at fault."""
    parts = image_parts(body.messages)
    tower = pipeline.vision_encoder
    if parts and tower is None:
        raise ValueError(f"{parts[0][0]}: the omni pipeline `{model_name}` has no vision stage and takes no images "
                         f"(it was started with --no-vision)")
    check_image_count(parts, media.max_images_per_request, "this server (--max-images-per-request)")
    pixels = []
    for where, img in decode_images(body.messages, media):  # one at a time: each is preprocessed down to the
        try:                                                # tower's size before the next is decoded
            pixels.append(tower.preprocess(img))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        del img
    thinker = pipeline.stages[0].engine
    try:
        ids = thinker.apply_chat_template(body.chat_messages())
    except ValueError:
        raise
    except Exception as e:  # the template itself refused the conversation (e.g. roles out of order)
        raise ValueError(f"messages: the chat template refused them: {e}") from None
    return pipeline.image_prompt(ids, pixels)


def create_omni_app(worker: PipelineWorker, *, model_name: str, api_key: str | None = None,
                    max_body_bytes: int = 4 << 20, media: MediaOptions | None = None,
                    allowed_origins: Sequence[str] | None = None) -> FastAPI:
    app = FastAPI(title="kvpool omni", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    add_cors(app, allowed_origins)
    pipeline = worker.pipeline
    thinker = pipeline.stages[0].engine
    created = int(time.time())
    media = media or MediaOptions()
    default_max_tokens = pipeline.configs[0].sampling.max_tokens

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' checks)
    async def health() -> Response:
        if not worker.is_alive:
            return APIError(503, "the omni pipeline is not running").response()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_api_key(request, api_key)
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "kvpool",
             # (the longest chat the whole pipeline holds: the talker's context may bound it, not the thinker's)
             "root": str(thinker.model_dir), "parent": None, "max_model_len": pipeline.max_model_len,
             "stages": [c.name for c in pipeline.configs], "vision": pipeline.vision_encoder is not None}]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        check_api_key(request, api_key)
        body = await read_body(request, ChatCompletionRequest, max_body_bytes)
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model: The model `{body.model}` does not exist (this server has `{model_name}`)",
                           "model")
        if body.stream:
            raise APIError(400, "stream: not supported by the omni server (the talker's codes come after the "
                                "thinker's whole text); send stream=false", "stream")
        if body.cache_salt is not None:
            raise APIError(400, "cache_salt: not supported by the omni server", "cache_salt")
        if body.n != 1:
            raise APIError(400, "n: the omni server answers with one choice (the talker speaks one text); send n=1",
                           "n")
        # Fields the pipeline cannot honour: per-token scores and ids (the talker speaks one text), the chat's
        # rendering (the pipeline renders its own prompt, the assistant's turn opened) and its truncation.
        refused = {"logprobs": bool(body.logprobs), "prompt_logprobs": body.prompt_logprobs is not None,
                   "return_token_ids": body.return_token_ids,
                   "add_generation_prompt": not body.add_generation_prompt,
                   "continue_final_message": body.continue_final_message,
                   "chat_template_kwargs": bool(body.chat_template_kwargs),
                   "chat_template": body.chat_template is not None,
                   "truncate_prompt_tokens": body.truncate_prompt_tokens is not None}
        for name, set_ in refused.items():
            if set_:
                raise APIError(400, f"{name}: not supported by the omni server", name)
        rename = body.param_renames()  # (the fields the client sent, as kvpool serve names them)
        try:
            params = body.to_sampling_params()
            if body.max_completion_tokens is None and body.max_tokens is None:
                params = dataclasses.replace(params, max_tokens=default_max_tokens)  # the server's --thinker-tokens
            prompt, mm = await asyncio.to_thread(prepare, pipeline, body, media, model_name)
            # Here, not in the worker: refused after the thinker's run, it would waste that run, and in a batch
            # make the worker rerun every batch-mate alone.
            pipeline.check_request(len(prompt), params.max_tokens)
        except ValueError as e:
            raise APIError.from_value_error(e, rename) from None
        try:
            fut = worker.submit(prompt, mm, params)
        except PipelineStopped as e:
            raise APIError(503, str(e)) from None
        try:
            # A client gone before its batch starts: the wrapper is cancelled, which cancels the job (the worker
            # skips it); once running, it runs to its end (a batch is not interruptible) and is dropped here.
            done, out = await until_disconnected(asyncio.wrap_future(fut), request)
        except ValueError as e:  # refused by an engine when added (checked above; a batch-mate's refusal reruns)
            raise APIError.from_value_error(e, rename) from None
        except PipelineStopped as e:  # queued when the worker failed or stopped: never run
            raise APIError(503, str(e)) from None
        if not done or out is None:
            raise ClientDisconnected
        thinker_out = out.stages[0]
        return JSONResponse({
            "id": f"chatcmpl-omni-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                         "finish_reason": thinker_out.outputs[0].finish_reason}],
            "usage": usage_json([thinker_out]), "omni": omni_json(out)})

    return app


@dataclass
class OmniServerHandle:
    url: str
    worker: PipelineWorker
    _server: uvicorn.Server
    _thread: threading.Thread

    @property
    def pipeline(self) -> Pipeline:
        return self.worker.pipeline

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self.worker.shutdown()


def start_omni_server(pipeline: Pipeline, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "omni",
                      **kw: Any) -> OmniServerHandle:
    """A real server on a background thread (port 0: a free one); tests use it."""
    from kvpool.server.serve import serve_in_thread

    worker = PipelineWorker(pipeline)
    app = create_omni_app(worker, model_name=model_name, **kw)
    worker.start()
    try:
        url, server, thread = serve_in_thread(app, host, port)
    except RuntimeError:
        worker.shutdown()
        raise
    return OmniServerHandle(url, worker, server, thread)


def run(a: argparse.Namespace) -> None:
    from kvpool.omni.cli import build_pipeline
    from kvpool.server.serve import listen, media_options, serve_on

    media = media_options(a)  # checked before the models load
    sock = listen(a.host, a.port)
    pipeline = build_pipeline(a, vision=not a.no_vision)
    worker = PipelineWorker(pipeline)
    app = create_omni_app(worker, model_name=a.served_model_name, api_key=a.api_key,
                          max_body_bytes=a.max_body_bytes, media=media, allowed_origins=a.allowed_origins)
    worker.start()
    log.info("serving the omni pipeline `%s` (%s) on http://%s:%d", a.served_model_name,
             " -> ".join(c.name for c in pipeline.configs), a.host, a.port)
    try:
        serve_on(app, sock)
    finally:
        worker.shutdown()
