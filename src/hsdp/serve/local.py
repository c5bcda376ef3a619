"""Run ``hsdp serve`` as a child process on a free loopback port: for tests, benchmarks and the fuzz run.

The server is a real process started through the CLI, so what is exercised is exactly what users run; only
127.0.0.1 is ever bound or contacted.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

__all__ = ["LocalServer", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    """``with LocalServer("tiny-llama", ["--use-hsdp"], log=path) as server: httpx.get(server.url + "/health")``."""

    def __init__(
        self,
        model: str,
        args: list[str] | None = None,
        *,
        log: Path,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
    ):
        self.model, self.args, self.log, self.api_key = model, list(args or []), Path(log), api_key
        self.env = {**os.environ, **(env or {})}
        if api_key:
            self.env["HSDP_API_KEY"] = api_key
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> LocalServer:
        for _ in range(3):  # the free port can be taken between probing and binding: try another
            self.port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "hsdp.cli",
                "serve",
                self.model,
                "--port",
                str(self.port),
                *self.args,
            ]
            with open(self.log, "a") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
            if self._wait_ready():
                return self
            if "address already in use" not in self.log_tail().lower():
                break
        raise RuntimeError(f"hsdp serve {self.model} did not start; log {self.log}:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        return False

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Wait for ``/health`` 200 (after an engine restart)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:  # a busy or restarting server may not answer in time: ask again until the deadline
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy within {timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.5)

    def worker_pids(self) -> list[int]:
        """The engine's worker pids, from ``/metrics`` (``hsdp_worker_info``), in rank order."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        found = re.findall(r'hsdp_worker_info\{[^}]*rank="(\d+)",pid="(\d+)"\}', text)
        return [int(pid) for _, pid in sorted(found, key=lambda rp: int(rp[0]))]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT (graceful: the running batch finishes, queued jobs stay queued on disk), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
