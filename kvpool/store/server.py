"""A real Redis (or Valkey) server process for tests and benchmarks: started on a free loopback port with
persistence off, stopped (or killed, as in a crash) on demand. The binary comes from the project's install
(scripts/install.sh installs Debian's redis-server package); `REDIS_SERVER` names another one, e.g. a
valkey-server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time


def find_server_binary() -> str | None:
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit
    return shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One server process; `start` again after `kill` restarts it empty on the same port."""

    def __init__(self, binary: str, port: int | None = None, maxmemory: str | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"{self.binary} exited at start: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: the server vanishes as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
