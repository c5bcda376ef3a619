"""Run ``hsdp serve`` as a child process on a free loopback port: for tests, benchmarks and the fuzz run.

The server is a real process started through the CLI, so what is exercised is exactly what users run; only
127.0.0.1 is ever bound or contacted. :class:`LocalNodes` runs it over several torchrun agents on this host, as on
that many nodes (docs/serving.md, multi-node).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import httpx

__all__ = ["LocalNodes", "LocalServer", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    """``with LocalServer("tiny-llama", ["--use-hsdp"], log=path) as server: httpx.get(server.url + "/health")``."""

    python: ClassVar[Callable[[], str]] = staticmethod(lambda: sys.executable)
    """The interpreter that runs ``hsdp serve``: this process's. A test suite may name a stand-in that forks the
    server from a process with the imports done (tests/conftest.py); :attr:`proc` is then the stand-in, which
    passes signals on and exits as the server exits. A server that leads a process group of its own
    (``own_group``) always runs in ``sys.executable``: the group it leads must hold the server itself."""

    def __init__(
        self,
        model: str,
        args: list[str] | None = None,
        *,
        log: Path,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
        own_group: bool = False,
    ):
        """``own_group``: the server leads a process group (a session) of its own, as a service manager starts
        it, so that :meth:`signal_group` reaches it and its ranks alike."""
        self.model, self.args, self.log, self.api_key = model, list(args or []), Path(log), api_key
        self.own_group = own_group
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
                sys.executable if self.own_group else type(self).python(),
                "-m",
                "hsdp.cli",
                "serve",
                self.model,
                "--port",
                str(self.port),
                *self.args,
            ]
            with open(self.log, "a") as log:
                self.proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=self.own_group
                )
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

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to every process of the server's group, as systemd's stop, ``timeout`` or a terminal's
        Ctrl-C do (``own_group`` servers only)."""
        if not self.own_group:
            raise ValueError("signal_group needs LocalServer(own_group=True)")
        os.killpg(self.proc.pid, sig)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.own_group and self.proc is not None:  # ranks a failed stop left in the group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def _health(url: str) -> int | None:
    """``/health``'s status, or None while nothing answers (a group being restarted)."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux: read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()  # pid (comm) state ppid ...; comm may hold spaces
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _torchrun_rank(pid: int) -> int | None:
    """The global ``RANK`` torchrun gave process ``pid``, or None (not a torchrun worker, or gone)."""
    with contextlib.suppress(OSError, ValueError):
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"RANK="):
                return int(item[5:])
    return None


class LocalNodes:
    """``hsdp serve`` over ``nnodes`` torchrun agents on this host, as if on that many nodes: each runs
    ``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d`` against a free loopback rendezvous port, and
    global rank 0 (on whichever agent c10d gives it) serves HTTP on :attr:`port`. Linux only (ranks are found in
    /proc). Each agent logs to ``<log_dir>/node<i>.log``.

    ``with LocalNodes("tiny-wan", ["--use-hsdp", "--hsdp-shard-size", "2"], log_dir=path) as nodes: ...``
    """

    python: ClassVar[Callable[[], str]] = staticmethod(lambda: sys.executable)
    """The interpreter that runs each torchrun agent (and, through ``sys.executable``, its ranks): as
    :attr:`LocalServer.python`. A stand-in that forks the command from a process with the imports done names the
    process it stands for with :attr:`process_of`."""

    process_of: ClassVar[Callable[[int], int]] = staticmethod(lambda pid: pid)
    """The process that runs the command that process ``pid`` (an agent or a rank torchrun started) stands for:
    ``pid`` itself, unless :attr:`python` is a stand-in."""

    def __init__(
        self,
        model: str,
        args: list[str] | None = None,
        *,
        log_dir: Path,
        nnodes: int = 2,
        nproc_per_node: int = 1,
        max_restarts: int = 0,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
    ):
        self.model, self.args, self.log_dir = model, list(args or []), Path(log_dir)
        self.nnodes, self.nproc_per_node, self.max_restarts = nnodes, nproc_per_node, max_restarts
        # A fresh store per rendezvous round, as docs/serving.md says (torch's shared one keeps a dead round's
        # addresses, and a restarted group may read them).
        self.env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.agents: list[subprocess.Popen] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalNodes:
        rdzv, self.port = free_port(), free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for node in range(self.nnodes):
            cmd = [
                *(type(self).python(), "-m", "torch.distributed.run", "--nnodes", str(self.nnodes)),
                *("--nproc-per-node", str(self.nproc_per_node), "--max-restarts", str(self.max_restarts)),
                *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}"),
                *("-m", "hsdp.cli", "serve", self.model, "--port", str(self.port), *self.args),
            ]
            with open(self.log_dir / f"node{node}.log", "ab") as log:
                self.agents.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
                    )
                )
        try:
            self.wait_healthy(self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def health(self) -> int | None:
        return _health(self.url)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Wait for ``/health`` 200 (at start, or after torchrun restarted the group); raise if an agent ended."""
        deadline = time.monotonic() + timeout_s
        while self.health() != 200:
            ended = [i for i, agent in enumerate(self.agents) if agent.poll() is not None]
            if ended or time.monotonic() > deadline:
                what = f"torchrun agent(s) {ended} ended" if ended else f"not healthy within {timeout_s:.0f}s"
                raise RuntimeError(
                    f"hsdp serve {self.model} over {self.nnodes} nodes: {what}\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def _workers(self) -> list[tuple[int, int, int]]:
        """(global rank, node, pid) of each process the agents started and still run (a rank, or its stand-in)."""
        found = []
        for node, agent in enumerate(self.agents):
            for pid in _children(self.process_of(agent.pid)):
                rank = _torchrun_rank(pid)
                if rank is not None:
                    found.append((rank, node, pid))
        return found

    def ranks(self) -> dict[int, tuple[int, int]]:
        """Global rank -> (node, pid) of the ranks running now."""
        return {rank: (node, self.process_of(pid)) for rank, node, pid in self._workers()}

    def head_node(self) -> int | None:
        """The node whose agent runs global rank 0 (the HTTP server); c10d may move it at a restart."""
        return self.ranks().get(0, (None, 0))[0]

    def kill_node(self, node: int) -> list[int]:
        """SIGKILL every rank of ``node`` (its agent lives on: torchrun restarts them, up to --max-restarts)."""
        pids = [pid for n, pid in self.ranks().values() if n == node]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def log_tail(self, lines: int = 20) -> str:
        tails = []
        for node in range(len(self.agents)):
            with contextlib.suppress(OSError):
                text = (self.log_dir / f"node{node}.log").read_text(errors="replace").splitlines()[-lines:]
                tails.append(f"--- node{node}.log\n" + "\n".join(text))
        return "\n".join(tails)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every agent at once (torchrun stops its ranks), SIGKILL what is left after ``timeout_s``."""
        workers = [pid for _, _, pid in self._workers()]
        for agent in self.agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for agent in self.agents:
            try:
                agent.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for pid in workers:  # ranks run in sessions of their own: an agent killed above leaves them behind
            if _torchrun_rank(pid) is not None:
                for process in dict.fromkeys((self.process_of(pid), pid)):  # the rank, then its stand-in
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process, signal.SIGKILL)

    def __enter__(self) -> LocalNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
