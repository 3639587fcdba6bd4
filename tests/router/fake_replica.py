"""A replica that misbehaves on purpose, for the faults a real one cannot be made to show: raw HTTP/1.1
over asyncio on a thread, so an answer can be a 500 while /health is fine, or a stream can be cut in the
middle of an event. It answers /health with 200, /metrics with `metrics`, and every POST per `mode`:
- "err500": a 500 with an OpenAI error body;
- "cutmid": a 200 event stream (chunked) with one whole event, then half of the next, then the
  connection closes;
- "err404": a 404 with an OpenAI error body (a replica without the model or adapter asked for)."""

from __future__ import annotations

import asyncio
import threading

from replicas import free_port

CUT_EVENT = (b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" Hello",'
             b'"finish_reason":null}]}\n\n')
CUT_PART = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" wor'
ERR500 = (b'{"error":{"message":"internal error: boom","type":"internal_server_error","param":null,'
          b'"code":500}}')
ERR404 = b'{"error":{"message":"model `x` not found","type":"not_found_error","param":"model","code":404}}'


class FakeReplica:
    def __init__(self, mode: str, metrics: bytes = b"kvpool:num_requests_running 0\n") -> None:
        self.mode, self.metrics = mode, metrics
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.posts = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                method, path, _ = head.split("\r\n", 1)[0].split(" ")
                length = next((int(h.split(":", 1)[1]) for h in head.split("\r\n")
                               if h.lower().startswith("content-length:")), 0)
                if length:
                    await reader.readexactly(length)
                if method == "POST" and self.mode == "cutmid":
                    self.posts += 1
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
                    for c in (CUT_EVENT, CUT_PART):
                        writer.write(b"%x\r\n%s\r\n" % (len(c), c))
                        await writer.drain()
                        await asyncio.sleep(0.05)
                    return  # (closed mid-body: the client reads an incomplete chunked body)
                if method == "POST" and self.mode == "err404":
                    self.posts += 1
                    status, ctype, out = b"404 Not Found", b"application/json", ERR404
                elif method == "POST":
                    self.posts += 1
                    status, ctype, out = b"500 Internal Server Error", b"application/json", ERR500
                elif path == "/metrics":
                    status, ctype, out = b"200 OK", b"text/plain", self.metrics
                else:
                    status, ctype, out = b"200 OK", b"application/json", b'{"status":"ok"}'
                writer.write(b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, ctype, len(out), out))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
