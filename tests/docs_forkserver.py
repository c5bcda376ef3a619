"""The docs tier's fork server: each documented ``hsdp ...`` command and ``python`` snippet runs in a child forked
from one process that has torch, diffusers, transformers and hsdp's command modules imported, instead of a fresh
interpreter that imports them again (about 4.5 s of a 6 s ``hsdp generate --model tiny-wan``, paid ~100 times by
the tier).

How a command gets here: the tier puts a folder first on ``PATH`` holding three shims, ``hsdp``, ``python`` and
``torchrun`` (:func:`write_shims`). A shim is a small stdlib-only script: it connects to this server's unix socket and
sends its argv, working directory, environment, ignored and blocked signals, with its standard input, output and
error as descriptors (``SCM_RIGHTS``). The server either forks a child that becomes the command, or answers why it
will not, and the shim then ``exec`` s the real program (``.venv/bin/NAME``): the plain path, a fresh interpreter.

The child is the command's own process, as a fresh one would be, minus the imports: it takes the shim's three
descriptors as 0, 1 and 2, its working directory and environment, Python's default signal handlers (the ones its
starter ignored stay ignored), its ``sys.argv`` and ``sys.path[0]``; it runs the real console script (or the
snippet: ``python FILE``, ``-c CODE``, ``-m MODULE``, ``-`` for stdin) as ``__main__``; at the end it joins its
threads, runs the ``atexit`` handlers and flushes, as the interpreter's exit does. The shim stays as the command's
stand-in: it forwards the signals it gets (Ctrl-C, ``kill -TERM``, the tier stopping a ``background`` server) to the
child and exits with the child's exit code, or dies by the child's signal. A shim that disappears (killed) takes its
child with it (SIGKILL). The child's own ranks still start by fork (it runs no other thread:
:func:`hsdp.launch.fork_problem`). A forked ``torchrun`` starts its ranks (``python -u SCRIPT``) through the
``python`` shim, so they are forked too.

What differs from a fresh process, knowingly: a warning printed while the server imported (transformers'
"requires torchvision" notes) is not printed again, and modules the command never imports are loaded.

The plain path, with the reason recorded, where a fork would not be the same process:

- the environment differs from the server's in a variable other than :data:`RUNTIME_ENV` and
  :data:`TORCHRUN_ENV` (libraries read ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``... once, at import);
- ``python`` with an option other than ``-u``, ``-c``, ``-m`` or ``-``;
- :func:`hsdp.launch.fork_problem` names a reason in the server (a thread; the tier starts no server where torch is
  built for an accelerator);
- the server is not up (no socket).

Each forked child is named in a folder beside the socket (:func:`command_process`): who looks for the process
running a command (a rank to kill, as :class:`hsdp.serve.local.LocalNodes` does) finds it from its shim's pid.

Every request is recorded, one line each in the record file: ``fork PROGRAM ARGV`` or ``plain (REASON) PROGRAM ARGV``,
so the tier reports which path each block took. Run as ``python tests/docs_forkserver.py SOCKET RECORD``.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL = {name: ROOT / ".venv" / "bin" / name for name in ("hsdp", "python", "torchrun")}

RUNTIME_ENV = frozenset(
    {
        *("PWD", "OLDPWD", "SHLVL", "_", "HSDP_API_KEY", "HSDP_LOG_LEVEL", "HSDP_CACHE", "HSDP_COLLECTIVE_TIMEOUT"),
        *("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"),
    }
)
"""Variables a command may set differently from the server's environment and still fork: bash's own, and hsdp's
that are read when a command runs, not when a module is imported (``HSDP_API_KEY`` is the default of
``hsdp serve --api-key``, read as the parser is built; ``HSDP_LOG_LEVEL`` by :func:`configure_logging`;
``HSDP_CACHE`` by :func:`hsdp.models.tiny.default_cache_dir`; ``HSDP_COLLECTIVE_TIMEOUT`` as a process group is
made, :func:`hsdp.distributed.collective_timeout_s`); torch's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` by
torchrun's rendezvous as it starts (:class:`hsdp.serve.local.LocalNodes` sets it); pytest's ``PYTEST_CURRENT_TEST``,
which names the running test (a fork server started by one test serves the next: tests/forked_cli.py); inductor's
``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``, which a process that compiled carries from then on and inductor writes
anew before it loads each compiled kernel (torch/_inductor/codecache.py; its commands came plain after any compile
test of their pytest worker)."""

TORCHRUN_ENV = frozenset(
    {
        *("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
        *("GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        *("TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"),
        *("TORCHELASTIC_RUN_ID", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE"),
    }
)
"""What torchrun's agent sets for each rank (``python -u SCRIPT``): read as the process group starts and by
torch's elastic error handler, not at import. ``OMP_NUM_THREADS`` (1, which torchrun sets) is read by torch as it
loads: a child whose value differs from the server's applies it with ``torch.set_num_threads``, as hsdp's own
forked ranks do (:mod:`hsdp.launch.rank`)."""

THREADS_ENV = "OMP_NUM_THREADS"

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.run",
    "numpy",
    "safetensors.torch",
    "hsdp",
    "hsdp.cli",
    "hsdp.launch",
    "hsdp.models.builtin",
    "hsdp.engine",
    "hsdp.loading",
    "hsdp.planning",
    "transformers.modeling_utils",
    "diffusers.models.modeling_utils",
    "diffusers.pipelines.pipeline_utils",
    "peft",
    "fastapi",
    "uvicorn",
    "openai",
    "soundfile",
    "gguf",
)
"""What the documented commands import (``hsdp.cli``'s command modules come with ``build_parser()``, below)."""

PRELOAD_CLASSES = {
    "diffusers": (
        "WanPipeline",
        "WanImageToVideoPipeline",
        "WanTransformer3DModel",
        "AutoencoderKLWan",
        "FluxPipeline",
        "FluxKontextPipeline",
        "StableDiffusionXLPipeline",
        "StableAudioPipeline",
    ),
    "transformers": ("LlamaForCausalLM", "GPT2LMHeadModel", "UMT5EncoderModel", "CLIPTextModel", "T5EncoderModel"),
}
"""The pipelines and models of the built-in models the docs run (diffusers and transformers import them lazily:
importing a pipeline's module is the ~3 s "checks (the model's folder and pipeline class)" phase)."""

SHIM = """#!{python} -IS
# The docs tier's {name}: runs in a child of the docs fork server (tests/docs_forkserver.py), else exec's {real}.
import sys
sys.path.insert(0, {tests!r})
from docs_forkserver import shim_main
shim_main({name!r}, {socket!r}, {real!r})
"""


# --- the shim ------------------------------------------------------------------------------------------------------


def write_shims(folder: Path, socket_path: Path) -> None:
    """``hsdp``, ``python`` and ``torchrun`` in ``folder``, which the tier puts first on ``PATH``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, real in REAL.items():
        shim = folder / name
        shim.write_text(
            SHIM.format(
                python=sys.executable, name=name, real=str(real), tests=str(Path(__file__).parent), socket=str(socket_path)
            )
        )
        shim.chmod(0o755)


def _send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    payload = struct.pack("!I", len(data)) + data
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([payload], ancillary)


def _receive_exactly(sock: socket.socket, size: int, fds: list[int]) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk, ancillary, _, _ = sock.recvmsg(size - len(data), socket.CMSG_SPACE(16 * 4))
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", raw[: len(raw) - len(raw) % 4]))
        if not chunk:
            return None
        data += chunk
    return data


def _receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    fds: list[int] = []
    head = _receive_exactly(sock, 4, fds)
    if head is None:
        return None, fds
    body = _receive_exactly(sock, struct.unpack("!I", head)[0], fds)
    return (json.loads(body) if body is not None else None), fds


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
INHERITED = (*FORWARDED, signal.SIGALRM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
"""Signals whose ignored disposition a command inherits from whoever started it (Python resets only SIGPIPE and
SIGXFSZ, and SIGINT unless it came ignored)."""


def shim_main(name: str, socket_path: str, real: str) -> None:
    """Ask the server to run this command in a forked child, stand in for it, and exit as it exits; without the
    server, or when it says no, become the real program."""
    argv = [real, *sys.argv[1:]]
    child: list[int] = []
    pending: list[int] = []
    # What the command inherits as a fresh process would: a signal ignored by its starter (SIGINT for `cmd &` in a
    # non-interactive shell) stays ignored, and the blocked ones stay blocked; the others are forwarded to it.
    ignored = [s for s in INHERITED if signal.getsignal(s) == signal.SIG_IGN]
    blocked = sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))

    def forward(signum, frame):  # before the child's pid is known, the signal waits for it
        if not child:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: its status is on its way
            os.kill(child[0], signum)

    for signum in FORWARDED:
        if signum not in ignored:
            signal.signal(signum, forward)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path)
        request = {"program": name, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "shim": sys.argv[0]}
        request |= {"ignored": [int(s) for s in ignored], "blocked": [int(s) for s in blocked]}
        _send(sock, request, (0, 1, 2))
        answer, _ = _receive(sock)
    except OSError:
        answer = None
    if not answer or "pid" not in answer:
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
        os.execv(real, argv)
    child.append(answer["pid"])
    for signum in pending:
        forward(signum, None)
    done, _ = _receive(sock)
    if done is None:  # the server went away: nothing to report but a failure
        os._exit(1)
    status = done["status"]
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status))


# --- the server -----------------------------------------------------------------------------------------------------


def _stand_ins(socket_path: str | Path) -> Path:
    """The folder where the server at ``socket_path`` names each forked child by its shim: ``SHIM_PID`` holds the
    child's pid while the child runs."""
    return Path(f"{socket_path}.pids")


def command_process(socket_path: str | Path, pid: int) -> int:
    """The process that runs the command a shim ``pid`` stands in for (a child of the server at ``socket_path``);
    ``pid`` itself where that is no shim of a forked command (a plain command's shim became the program)."""
    with contextlib.suppress(OSError, ValueError):
        return int((_stand_ins(socket_path) / str(pid)).read_text())
    return pid


def _python_target(argv: list[str]) -> tuple[str, str, list[str]] | str:
    """``(KIND, VALUE, ARGS)`` for ``python ARGV``: ``("script", PATH, ...)``, ``("code", CODE, ...)``,
    ``("module", NAME, ...)`` or ``("stdin", "", ...)``, ARGS what follows; else the reason to exec. ``-u`` (what
    torchrun passes) is the server's ``PYTHONUNBUFFERED`` already (the tier sets it; :meth:`Server._refusal`)."""
    rest = argv[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if not rest:
        return "python without a script (interactive)"
    first = rest[0]
    if first in ("-c", "-m") and len(rest) > 1:
        return ("code" if first == "-c" else "module", rest[1], rest[2:])
    if first == "-":
        return ("stdin", "", rest[1:])
    if first.startswith("-"):
        return f"python option {first}"
    return ("script", first, rest[1:])


class Server:
    def __init__(self, socket_path: str, record: str):
        self.env = dict(os.environ)
        self.record = open(record, "a", buffering=1)  # noqa: SIM115 (open for the server's life)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_path)
        self.stand_ins = _stand_ins(socket_path)
        self.stand_ins.mkdir(exist_ok=True)
        self.shims: dict[int, int] = {}  # child pid -> its shim's pid
        self.listener.listen(64)
        self.children: dict[int, socket.socket] = {}  # pid -> its shim's connection
        self.wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        os.set_blocking(self.wake_read, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_write)
        self.wake_write = wake_write
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_read, selectors.EVENT_READ)

    def preload(self) -> None:
        import importlib

        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception as exc:  # a command that needs it imports it itself (and fails there)
                print(f"docs fork server: {name} not preloaded: {exc}", file=sys.stderr)
        for package, names in PRELOAD_CLASSES.items():
            module = importlib.import_module(package)
            for name in names:
                try:
                    getattr(module, name)
                except Exception as exc:
                    print(f"docs fork server: {package}.{name} not preloaded: {exc}", file=sys.stderr)
        from hsdp.cli import build_parser

        build_parser()  # imports every command's module

    def serve(self) -> None:
        parent = os.getppid()
        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    connection, _ = self.listener.accept()
                    self._request(connection)
                elif key.fileobj == self.wake_read:
                    while True:
                        try:
                            if not os.read(self.wake_read, 512):
                                break
                        except BlockingIOError:
                            break
                else:  # a shim's connection readable: it went away (killed) before its child ended
                    self._shim_gone(key.fileobj)
            self._reap()
            if os.getppid() != parent:  # the tier is gone
                for pid in self.children:
                    os.kill(pid, signal.SIGKILL)
                return

    def _request(self, connection: socket.socket) -> None:
        request, fds = _receive(connection)
        try:
            if request is None or len(fds) != 3:
                connection.close()
                return
            reason = self._refusal(request)
            words = " ".join([request["program"], *request["argv"][1:]])[:300].replace("\n", "\\n")  # one line
            if reason:
                self.record.write(f"plain ({reason}) {words}\n")
                _send(connection, {"plain": reason})
                connection.close()
                return
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                self._become(request, fds, connection)  # never returns
            self.record.write(f"fork {words}\n")
            self.children[pid] = connection
            self._name_stand_in(pid, connection)
            self.selector.register(connection, selectors.EVENT_READ, pid)
            _send(connection, {"pid": pid})
        finally:
            for fd in fds:
                os.close(fd)

    def _refusal(self, request: dict) -> str | None:
        from hsdp.launch import fork_problem

        env = request["env"]
        runtime = RUNTIME_ENV | TORCHRUN_ENV
        changed = sorted(k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k) and k not in runtime)
        if changed == [THREADS_ENV] and env.get(THREADS_ENV, "").isdigit():
            changed = []  # applied in the child (TORCHRUN_ENV)
        if changed:
            return f"environment: {', '.join(changed)} read at import"
        if request["program"] == "python":
            target = _python_target(request["argv"])
            if isinstance(target, str):
                return target
            if "-u" in request["argv"][1:2] and not self.env.get("PYTHONUNBUFFERED"):
                return "python -u without PYTHONUNBUFFERED in the server"
        problem = fork_problem()
        return f"fork: {problem}" if problem else None

    def _name_stand_in(self, pid: int, connection: socket.socket) -> None:
        """Write ``pid`` under its shim's pid (the socket's peer), before the shim learns it: whoever can see the
        shim can find the command's process from then on."""
        creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        shim = struct.unpack("3i", creds)[0]
        staged = self.stand_ins / f".{shim}"
        staged.write_text(str(pid))
        staged.rename(self.stand_ins / str(shim))  # readers see the whole pid or nothing
        self.shims[pid] = shim

    def _forget(self, pid: int) -> socket.socket:
        """``pid`` ended: drop its entry (a later process may reuse the shim's pid)."""
        connection = self.children.pop(pid)
        self.selector.unregister(connection)
        with contextlib.suppress(OSError, KeyError):
            (self.stand_ins / str(self.shims.pop(pid))).unlink()
        return connection

    def _shim_gone(self, connection: socket.socket) -> None:
        pid = self.selector.get_key(connection).data
        try:
            if connection.recv(1):
                return  # a shim sends nothing after its request; ignore
        except OSError:
            pass
        self._forget(pid)  # a registered connection's child is running: _reap forgets both together
        connection.close()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    def _reap(self) -> None:
        for pid in list(self.children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = self._forget(pid)
                with contextlib.suppress(OSError):  # a shim killed meanwhile
                    _send(connection, {"status": status})
                connection.close()

    def _become(self, request: dict, fds: list[int], connection: socket.socket) -> None:
        """In the forked child: turn into the command's own process, run it, exit as the interpreter exits."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for signum in INHERITED:  # as the command's starter left them, Python's SIGINT handler otherwise
                default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
                signal.signal(signum, signal.SIG_IGN if signum in request["ignored"] else default)
            signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
            self.selector.close()
            for sock in (self.listener, connection, *self.children.values()):
                sock.close()
            for fd in (self.wake_read, self.wake_write):
                os.close(fd)
            self.record.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            fds.clear()
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            code = _run(request, self.env)
        except BaseException:  # noqa: BLE001 (a failure setting up the child is the command's failure)
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)


def _run(request: dict, server_env: dict[str, str]) -> int:
    """The command, as ``python`` would run it, and the interpreter's exit; its exit code."""
    import atexit
    import importlib
    import runpy
    import threading

    sys.stdin = sys.__stdin__ = open(0, encoding=sys.stdin.encoding, errors=sys.stdin.errors, closefd=False)  # noqa: SIM115
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a fresh process seeds numpy's global generator from the OS
        numpy.random.seed()
    importlib.invalidate_caches()
    threads = os.environ.get(THREADS_ENV)
    if threads != server_env.get(THREADS_ENV) and threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    argv = request["argv"]
    code = 0
    try:
        if request["program"] in ("hsdp", "torchrun"):
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            if request["program"] == "torchrun":  # its ranks (`python -u SCRIPT`) come back through the shim
                sys.executable = os.path.join(os.path.dirname(request["shim"]), "python")
            _run_file(argv[0])
        else:
            kind, value, args = _python_target(argv)
            if kind == "script":
                sys.argv = [value, *args]
                sys.path[0] = os.path.dirname(os.path.realpath(value))
                _run_file(value)
            elif kind == "module":
                if value == "torch.distributed.run":  # its ranks (`python -u ...`) come back through the shim
                    sys.executable = request["shim"]
                sys.argv = [value, *args]  # runpy puts the module's file first, as `python -m` does
                sys.path[0] = os.getcwd()
                sys.modules.pop(value, None)  # run as __main__ from its source, not the server's imported copy
                runpy.run_module(value, run_name="__main__", alter_sys=True)
            else:
                sys.argv = ["-c" if kind == "code" else "-", *args]
                sys.path[0] = ""
                source = value if kind == "code" else sys.stdin.read()
                _run_source(source, "<string>" if kind == "code" else "<stdin>")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 (uncaught: the interpreter prints it and exits 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what Python's exit does, in its order: join threads, atexit, flush
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: Python's exit goes on too
            stream.flush()
    return code


def _run_source(source: str | bytes, filename: str, **attributes) -> None:
    """``source`` as the ``__main__`` module, which stays for the ``atexit`` handlers (as in a fresh process)."""
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=__builtins__, **attributes)
    sys.modules["__main__"] = main
    exec(compile(source, filename, "exec"), main.__dict__)


def _run_file(path: str) -> None:
    """``python PATH``: ``sys.argv[0]`` as given, ``__file__`` (and the code's file name) absolute."""
    import importlib.machinery

    absolute = os.path.abspath(path)
    loader = importlib.machinery.SourceFileLoader("__main__", absolute)
    with open(absolute, "rb") as source:
        _run_source(source.read(), absolute, __file__=absolute, __loader__=loader, __cached__=None, __spec__=None)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def main(socket_path: str, record: str) -> None:
    started = time.monotonic()
    server = Server(socket_path, record)
    server.preload()
    print(f"docs fork server: ready in {time.monotonic() - started:.1f}s, {len(sys.modules)} modules imported", file=sys.stderr, flush=True)
    server.serve()


if __name__ == "__main__":
    main(*sys.argv[1:3])
