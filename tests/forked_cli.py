"""``hsdp`` commands for tests, run as their own process without paying the imports again.

``subprocess.run([sys.executable, "-m", "hsdp.cli", ...])`` spends 4-5 s per command importing torch, diffusers
and transformers before the command's first line: most of the time of a test that checks a refusal or runs a
tiny model. :func:`run_hsdp` runs the command in a child of hsdp's own forkserver (the one a pytest worker's
engines start ranks from, :func:`hsdp.launch.start_forkserver`), which has those modules imported: the command
still runs in a process of its own (its exit code, its stdout and stderr, its working folder and environment, its
signal dispositions and atexit handlers as a fresh ``python`` has them, ranks it starts by fork from it), only
without the imports. Where the platform has no forkserver, or ``HSDP_TEST_SUBPROCESS=1``, it is a subprocess.

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
import io
import multiprocessing as mp
import os
import signal
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
    :class:`subprocess.TimeoutExpired` after ``timeout`` seconds, the command killed)."""
    argv = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    done = _forked(argv, timeout, env, cwd) if _FORKED else None
    if done is None:
        done = subprocess.run(
            [sys.executable, "-m", "hsdp.cli", *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
        )
    if check:
        done.check_returncode()
    return done


def _forked(argv: list[str], timeout: float, env: dict[str, str], cwd: str) -> subprocess.CompletedProcess | None:
    """The command forked from hsdp's forkserver; None where this process has none to use (a test killed it,
    hsdp's launcher gave up on it): the caller runs a subprocess instead."""
    from hsdp.launch import group, start_forkserver

    if group._FORKSERVER_FAILED:
        return None
    start_forkserver(("diffusers", "transformers"))
    with tempfile.TemporaryDirectory(prefix="hsdp-cli-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        out.touch()
        err.touch()
        process = mp.get_context("forkserver").Process(
            target=_command, args=(argv, env, cwd, str(out), str(err)), name="hsdp-cli", daemon=False
        )
        try:
            process.start()
        except (OSError, EOFError):  # the forkserver this process knew is gone (reaped elsewhere, or killed)
            return None
        process.join(timeout)
        if process.exitcode is None:
            _kill_group(process.pid)
            process.join()
            raise subprocess.TimeoutExpired(["hsdp", *argv], timeout, out.read_text(), err.read_text())
        # A signal's death reads -N, as subprocess reports it.
        return subprocess.CompletedProcess(["hsdp", *argv], process.exitcode, out.read_text(), err.read_text())


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


def _kill_group(pid: int) -> None:
    """The command and the ranks it started (its own process group, as a shell gives a command)."""
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            target()


def _command(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked child: become the fresh process ``hsdp ARGV`` would be, run it, exit with its code."""
    os.setpgid(0, 0)  # its own process group, so a timeout kills its ranks too
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    streams = ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY))
    for fd, path, flags in streams:
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    # A fresh interpreter's dispositions (the forkserver ignores SIGINT and SIGTERM: hsdp.forkserver_signals).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    atexit._clear()  # the forkserver's own; the command registers its own
    sys.argv = ["hsdp", *argv]
    code = 1
    try:
        from hsdp.cli import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - what an uncaught exception prints and exits with
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
