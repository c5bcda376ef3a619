"""``hsdp`` commands for tests, run as their own process without paying the imports again.

``subprocess.run([sys.executable, "-m", "hsdp.cli", ...])`` spends 4-5 s per command importing torch, diffusers
and transformers before the command's first line: most of the time of a test that checks a refusal or runs a
tiny model. :func:`run_hsdp` runs the command through :func:`preloaded_python`: in a child of a fork server that
has those modules imported, the command still a process of its own (its exit code, its stdout and stderr, its
working folder and environment, its signal dispositions and atexit handlers as a fresh ``python`` has them, ranks
it starts by fork from it), only without the imports. Where the platform has no fork, ``HSDP_TEST_SUBPROCESS=1``,
or the command's environment differs in what a library reads at import, it is a fresh interpreter.

:func:`preloaded_python` is a ``python`` for torchrun: its agent and the ranks it starts (``python -u ...``) run
forked from a fork server of this process's (tests/docs_forkserver.py, as the docs tier's commands), each still a
process of its own standing where torchrun started it.

Tests of the start-up itself (what a fresh interpreter imports, a signal while it does) keep ``subprocess``; so do
tests of environment variables that a library reads when it is imported (huggingface_hub's ``HF_HOME`` and
``HF_HUB_OFFLINE``): the child has the forkserver's modules, imported under the forkserver's environment.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

_FORKED = "forkserver" in mp.get_all_start_methods() and os.environ.get("HSDP_TEST_SUBPROCESS") != "1"


def run_hsdp(
    args: Sequence[str],
    *,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """``hsdp ARGS`` as ``subprocess.run(..., capture_output=True, text=True)`` returns it (raises
    :class:`subprocess.TimeoutExpired` after ``timeout`` seconds, the command killed, with the end of its output in
    the message). The command runs as ``python -m hsdp.cli`` through :func:`preloaded_python`: forked from the rank
    fork server where its environment allows, else a fresh interpreter. (Forking it from hsdp's own forkserver hung
    now and then before the command's first line: 2 of the last 8 full runs, a third failure unnamed.)"""
    argv = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    try:
        done = subprocess.run([preloaded_python(), "-m", "hsdp.cli", *argv], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=cwd)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise subprocess.TimeoutExpired(["hsdp", *argv], timeout, exc.output, exc.stderr) from RuntimeError(
            f"hsdp {' '.join(argv)[:300]} timed out after {timeout:g}s; the end of its stderr:\n{tail}"
        )
    done.args = ["hsdp", *argv]
    if check:
        done.check_returncode()
    return done


_RANK_SERVER: list = []
"""The fork server behind :func:`preloaded_python` (started once per process) and its folder."""


def preloaded_python() -> str:
    """A ``python`` that runs ``python -m torch.distributed.run ...`` and the ranks that torchrun starts forked from a
    server with torch, diffusers, transformers and hsdp imported (tests/docs_forkserver.py: its shim), or
    ``sys.executable`` where this platform has no fork to use, ``HSDP_TEST_SUBPROCESS=1``, or the server failed.
    A command whose environment differs from this process's in what is read at import runs plain (the shim then
    exec's the real interpreter)."""
    if not _FORKED:
        return sys.executable
    if not _RANK_SERVER:
        _RANK_SERVER.append(_start_rank_server())
    server, shim = _RANK_SERVER[0]
    return shim if server is not None and server.poll() is None else sys.executable


def command_process(pid: int) -> int:
    """The process running the command that process ``pid`` (a shim of :func:`preloaded_python`) stands in for:
    the child forked from the rank fork server; ``pid`` itself for a command that runs plain (its shim became it)."""
    if not _RANK_SERVER or _RANK_SERVER[0][0] is None:
        return pid
    from tests.docs_forkserver import command_process as forked

    return forked(Path(_RANK_SERVER[0][1]).parents[1] / "server.sock", pid)


def _start_rank_server() -> tuple[subprocess.Popen | None, str]:
    import shutil
    import time

    from tests.docs_forkserver import write_shims

    folder = Path(tempfile.mkdtemp(prefix="hsdp-rank-fork-"))  # short: a unix socket path has ~100 bytes
    socket_path = folder / "server.sock"
    write_shims(folder / "bin", socket_path)
    log = open(folder / "server.log", "w")  # noqa: SIM115 (the server's, closed at exit)
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("docs_forkserver.py")), str(socket_path), str(folder / "record")],
        env=dict(os.environ), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not socket_path.exists() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # bound before it imports: a shim's connect waits for the imports
    if not socket_path.exists():
        server.kill()
        return None, sys.executable

    def stop() -> None:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)
    return server, str(folder / "bin" / "python")
