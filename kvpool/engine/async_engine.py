"""The engine on its own thread, for asyncio callers: requests go in through an inbox, outputs come back
as per-request async streams, and a step report (stats deltas, finished requests, KV events) goes to
listeners after every step.

Only the engine thread touches the scheduler and the KV cache manager; callers reach them through
`submit`, `abort` and `call`, so an HTTP handler never waits for a forward pass and never races one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvpool.core.events import KVCacheEvent
from kvpool.engine.chat_template import ChatOptions
from kvpool.engine.engine import LLMEngine
from kvpool.engine.lora_request import LoRARequest
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.image_inputs import ImageInputs
from kvpool.runner.multimodal import MMInput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised); no request can be served."""


class EngineStepError(EngineDeadError):
    """A step raised while the request was in it: it failed, the engine recovered (every request in flight
    aborted, the prefix cache reset) and serves on; sending the request again may succeed."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are in flight; the caller should retry later."""


@dataclass
class StepReport:
    """What one engine step changed, for metrics and KV event publishing (deltas since the last report)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    host_usage: float | None = None  # None: no host tier
    prefix_queries: int = 0  # tokens
    prefix_hits: int = 0
    host_hits: int = 0
    prompt_tokens: int = 0  # of requests whose prefill completed this step, cached tokens included
    generation_tokens: int = 0
    preemptions: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    bytes_per_block: int = 0
    prompt_rows_read: int = 0  # prompt positions scored from the prompt-row cache
    prompt_rows_bytes: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)
    kv_events: list[KVCacheEvent] = field(default_factory=list)


StepListener = Callable[[StepReport], None]


class RequestStream:
    """Outputs of one request, pushed by the engine thread onto the caller's event loop.

    Iterate it for the request's outputs; `abort()` (or leaving the iteration early and calling it)
    stops the request and frees its blocks.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def push(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine already dropped it
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Idempotent; a no-op once the request finished."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_pending: int = 256, idle_poll: float = 0.05) -> None:
        if max_pending < 1:
            raise ValueError("max_pending: must be >= 1")
        self.engine = engine
        self.max_pending = max_pending
        self._idle_poll = idle_poll
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        # Engine thread only: per request, each choice's (tokens so far, when its last came): n > 1 has several.
        self._last_token_time: dict[str, dict[int, tuple[int, float]]] = {}
        self._pending = 0  # requests submitted and not yet finished or aborted
        self._pending_lock = threading.Lock()
        # Requests whose structured output needs compiling are made here (milliseconds, or seconds for a
        # pathological schema that llguidance cannot cancel), apart from the default pool that tokenizes every
        # other request: a burst of slow compiles waits for these threads, never stalls plain requests or
        # those whose constraint is compiled already. Made anew by each start.
        self._grammar_pool = self._new_grammar_pool()
        self._grammar_pool_closed = False
        # Held while an item goes into the inbox and while the stopping engine thread closes it: an item put
        # after the thread's last look at the inbox would wait there forever (a request hung, not refused).
        self._inbox_lock = threading.Lock()
        self._closed = False
        self._aborted: list[RequestOutput] = []  # engine thread only: aborts for the next step report
        self._listeners: list[StepListener] = []
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._last_stats = (0, 0, 0, 0, 0)
        self._unreported = False

    # -- lifecycle -----------------------------------------------------------------------------------

    def add_listener(self, fn: StepListener) -> None:
        """Called on the engine thread after every step; must be quick and must not raise."""
        self._listeners.append(fn)

    def remove_listener(self, fn: StepListener) -> None:
        self._listeners.remove(fn)

    @staticmethod
    def _new_grammar_pool() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpool-grammar")

    def start(self) -> None:
        if self._thread is not None:
            return
        if self._grammar_pool_closed:
            self._grammar_pool, self._grammar_pool_closed = self._new_grammar_pool(), False
        with self._inbox_lock:
            self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvpool-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._grammar_pool_closed = True
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_pending(self) -> int:
        return self._pending

    @property
    def num_queued(self) -> int:
        """Inbox items (requests, aborts, calls) not yet applied by the engine thread."""
        return self._inbox.qsize()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    def list_loras(self) -> list[LoRARequest]:
        """The LoRA adapters loaded (kvpool serve --lora-modules)."""
        return self.engine.list_loras()

    async def apply_chat_template(self, messages: list[dict[str, Any]], options: ChatOptions | None = None
                                  ) -> list[int]:
        """The prompt token ids of a chat (on a worker thread: the engine tokenizes safely off its thread)."""
        return await asyncio.to_thread(self.engine.apply_chat_template, messages, True, options)

    async def chat_prefix(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
                          ) -> list[int]:
        """`LLMEngine.chat_prefix`, off the event loop (and off the engine thread)."""
        return await asyncio.to_thread(self.engine.chat_prefix, messages, template_kwargs)

    async def reset_prefix_cache(self) -> bool:
        """`LLMEngine.reset_prefix_cache` on the engine thread. Its KV events (every block cleared, pinned
        prefixes stored again) go out right away, not with the next step: a router indexing this replica
        must not route by blocks it no longer holds."""

        def reset(e: LLMEngine) -> bool:
            ok = e.reset_prefix_cache()
            self._unreported = True  # (on the engine thread: the idle loop publishes a report)
            return ok

        return await self.call(reset)

    def render_chat(self, messages: list[dict[str, Any]], options: ChatOptions | None = None) -> list[int]:
        """`apply_chat_template`, blocking: for code already off the event loop (the tokenizer has its own lock,
        so any thread may call it while the engine thread steps)."""
        return self.engine.apply_chat_template(messages, True, options)

    @property
    def images(self) -> ImageInputs | None:
        """The model's own image preprocessing (pictures -> mm_inputs); None when it takes no pictures."""
        return self.engine.images

    @property
    def takes_image_tensors(self) -> bool:
        """Whether the model takes images at all (perhaps only preprocessed, through the Python API): a
        cross-attention model's image token, or a vision encoder in front of its embeddings."""
        mm = self.engine.mm
        return getattr(mm, "image_token_id", None) is not None or getattr(mm, "encoder", None) is not None

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (on the engine thread, before its next step)."""
        with contextlib.suppress(EngineDeadError):  # (a stopped engine holds no request)
            self._put(("abort", request_id))

    def _put(self, item: Any) -> None:
        """Into the inbox, unless the engine thread has stopped reading it (EngineDeadError)."""
        with self._inbox_lock:
            if self._closed:
                raise EngineDeadError("the engine is not running")
            self._inbox.put(item)

    # -- caller side (any thread with a running event loop) --------------------------------------------

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams, *, request_id: str,
                          cache_salt: str | None = None, mm_inputs: Sequence[MMInput] = (),
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and queue a request; its outputs arrive on the returned stream.

        Raises ValueError for bad input (nothing is queued), EngineOverloadedError when `max_pending`
        requests are already in flight, EngineDeadError when the engine is not running.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        with self._pending_lock:  # (its place is taken before the work of making it: a burst cannot overrun it)
            if self._pending >= self.max_pending:
                raise EngineOverloadedError(f"{self._pending} requests are in flight (limit {self.max_pending})")
            self._pending += 1
        make = functools.partial(self.engine.make_request, prompt, params, request_id=request_id,
                                 cache_salt=cache_salt, mm_inputs=mm_inputs, lora_request=lora_request)
        so = getattr(params, "structured_outputs", None)
        try:
            if so is not None and not await asyncio.to_thread(self.engine.grammars_compiled, so):  # (to compile)
                req = await asyncio.get_running_loop().run_in_executor(self._grammar_pool, make)
            else:
                req = await asyncio.to_thread(make)
        except BaseException as e:
            self._release_place()
            if self._grammar_pool_closed and isinstance(e, asyncio.CancelledError | RuntimeError):
                # (the engine shut down while it waited for a compile, or as it was handed to the pool)
                raise EngineDeadError("the engine is not running") from None
            raise
        stream = RequestStream(self, req.request_id, asyncio.get_running_loop())
        try:
            self._put(("add", req, stream))
        except EngineDeadError:  # (it stopped while the prompt was being tokenized)
            self._release_place()
            raise
        return stream

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (e.g. reset the prefix cache, read state)."""
        return await asyncio.wrap_future(self.call_soon(fn))

    def call_soon(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """`call` for code without an event loop: wait on the returned future."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put(("call", fn, fut))
        return fut

    # -- engine thread ---------------------------------------------------------------------------------

    # A step that raises fails the requests in flight and the engine recovers; this many in a row
    # (with no step between them that worked) mean it is broken, and it stops.
    MAX_FAILED_STEPS = 3

    def _run(self) -> None:
        failed = 0
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain(block=idle):
                    return
                if self.engine.has_unfinished_requests():
                    try:
                        self._step()
                        failed = 0
                    except Exception as e:
                        failed += 1
                        if failed >= self.MAX_FAILED_STEPS:
                            raise
                        self._recover(e)
                elif (self._unreported or self.engine.has_kv_events()) and self._listeners:
                    # No step will follow to report what changed (an abort freed blocks, a reset cleared
                    # them, the store took the last blocks written through): report it now.
                    self._publish(self._report())
        except BaseException as e:  # a bug in a step: fail every request loudly rather than hang them
            log.exception("engine step failed; the engine is stopped")
            self.error = e
        finally:
            self._fail_all(EngineDeadError(f"the engine stopped: {self.error!r}" if self.error
                                           else "the engine was shut down"))

    def _recover(self, e: Exception) -> None:
        """One failed step: its requests (every one in flight) fail with EngineStepError, and the engine
        is reset (`LLMEngine.recover`: half-written blocks are never hit) to serve what comes next."""
        log.exception("engine step failed; the requests in flight fail, the prefix cache is reset")
        err = EngineStepError(f"the request failed in an engine step ({e!r}); the engine recovered, retry")
        for rid, stream in list(self._streams.items()):
            stream.push(err)
            self._done(rid)
        self._streams.clear()
        self.engine.recover()  # (pinned prefixes are computed and pinned again, on this thread)
        self._unreported = True

    def _fail_all(self, dead: EngineDeadError) -> None:
        for rid, stream in self._streams.items():
            stream.push(dead)
            self._done(rid)
            # Its blocks go back too: an engine started again must not run it for nobody, holding them.
            with contextlib.suppress(Exception):  # (after a failed step the engine may be in any state)
                self.engine.abort_request(rid)
        self._streams.clear()
        with self._inbox_lock:  # nothing goes in after this: callers get EngineDeadError instead
            self._closed = True
        while True:  # whatever arrived after the last drain
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP and item[0] == "add":
                self._done(item[1].request_id)
                item[2].push(dead)
            elif item is not _STOP and item[0] == "call":
                item[2].set_exception(dead)

    def _drain(self, block: bool) -> bool:
        """Apply everything in the inbox; False when asked to stop."""
        while True:
            try:
                item = self._inbox.get(timeout=self._idle_poll) if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            kind = item[0]
            if kind == "add":
                _, req, stream = item
                try:
                    self.engine.enqueue(req)
                except ValueError as e:  # (never queued: its id may be a running request's, whose timing stays)
                    self._release_place()
                    stream.push(e)
                    continue
                except Exception as e:  # a fault of this request's own: it fails, the engine serves on
                    log.exception("enqueueing request %s failed", req.request_id)
                    self._release_place()
                    stream.push(EngineStepError(f"the request could not be queued ({e!r}); retry"))
                    continue
                self._streams[req.request_id] = stream
            elif kind == "abort":
                if self._streams.pop(item[1], None) is not None:
                    out = self.engine.abort_request(item[1])
                    if out is not None and self._listeners:  # (reported with the requests finished)
                        self._aborted.append(out)
                    self._done(item[1])
                    self._unreported = True
            elif kind == "call":
                _, fn, fut = item
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # handed to the caller, who asked for it
                    fut.set_exception(e)

    def _done(self, request_id: str) -> None:
        """A request in flight ended (engine thread)."""
        self._last_token_time.pop(request_id, None)
        self._release_place()

    def _release_place(self) -> None:
        """A request's place among max_pending is free again (any thread: a request that was never queued gives
        back its place here, touching nothing of the engine thread's, whose request may bear the same id)."""
        with self._pending_lock:
            self._pending -= 1

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.time()
        report = self._report() if self._listeners else None
        for out in outputs:
            rid = out.request_id
            seen = self._last_token_time.setdefault(rid, {})
            if report is not None and not seen:  # the prefill just completed
                report.prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                count, at = seen.get(c.index, (0, 0.0))
                if len(c.token_ids) > count:  # (a choice that got a token this step)
                    if count and report is not None:
                        report.inter_token_latencies.append(now - at)
                    seen[c.index] = (len(c.token_ids), now)
            stream = self._streams.get(rid)
            if out.finished:
                self._streams.pop(rid, None)
                self._last_token_time.pop(rid, None)
                if stream is not None:
                    self._done(rid)
                if report is not None:
                    report.finished.append(out)
            if stream is not None:
                stream.push(out)
        if report is not None:
            self._publish(report)

    def _publish(self, report: StepReport) -> None:
        self._unreported = False
        for fn in self._listeners:
            fn(report)

    def _report(self) -> StepReport:
        eng = self.engine
        st = eng.stats()
        pc = eng.take_prefix_cache_stats()
        totals = (st.num_generation_tokens, st.num_preemptions, st.num_blocks_swapped_out, st.num_blocks_swapped_in,
                  st.prompt_rows_read)
        d = [a - b for a, b in zip(totals, self._last_stats, strict=True)]
        self._last_stats = totals
        aborted, self._aborted = self._aborted, []
        return StepReport(num_running=st.num_running, num_waiting=st.num_waiting, kv_usage=st.kv_usage,
                          host_usage=st.host_usage,
                          prefix_queries=pc.queries, prefix_hits=pc.hits, host_hits=pc.host_hits,
                          generation_tokens=d[0], preemptions=d[1], blocks_swapped_out=d[2], blocks_swapped_in=d[3],
                          bytes_per_block=st.bytes_per_block, prompt_rows_read=d[4],
                          prompt_rows_bytes=st.prompt_rows_bytes, kv_events=eng.take_kv_events(), finished=aborted)
