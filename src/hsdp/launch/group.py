"""The caller side of :mod:`hsdp.launch`: :class:`WorkerGroup` starts the ranks (forked from the caller where that
is safe, else from a forkserver that preloaded the libraries, or spawned), sends them functions, and turns what
comes back (results, events, heartbeats, errors, deaths, silence) into results or :class:`WorkerError` s."""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from hsdp.distributed import pid_running
from hsdp.launch.rank import _ALIVE, _CallerStream, _worker_main
from hsdp.logging_utils import phase

logger = logging.getLogger("hsdp")

__all__ = [
    "WorkerGroup",
    "WorkerError",
    "WorkerRaised",
    "WorkerDiedError",
    "WorkerTimeout",
    "preload_modules",
    "fork_forkserver_with_ranks",
    "fork_problem",
    "start_forkserver",
    "START_METHOD_ENV",
]

START_METHOD_ENV = "HSDP_START_METHOD"
"""Environment variable choosing how ranks start: ``fork``, ``forkserver`` or ``spawn`` (default: ``fork`` where
:func:`fork_problem` finds none, else ``forkserver`` where the platform has it, else ``spawn``)."""

START_METHODS = ("fork", "forkserver", "spawn")


PRELOAD_PACKAGES = (
    "torch",
    "transformers",
    "diffusers",
    "peft",
    "accelerate",
    "safetensors",
    "huggingface_hub",
)
"""Packages whose modules the forkserver imports when the caller has imported them (what the ranks will need)."""

RANK_MODULES: dict[str, tuple[str, ...]] = {
    "transformers": ("transformers.modeling_utils",),
    "diffusers": ("diffusers.models.modeling_utils", "diffusers.pipelines.pipeline_utils"),
}
"""Modules every rank imports to build a model with a package, which the caller (reading configs, tokenizing)
need not import itself: for the ``packages`` a :class:`WorkerGroup` names, the forkserver imports them once for
all ranks rather than each rank on its own (``transformers.modeling_utils``, with ``torch._dynamo`` and scipy
under it, is about 1.9 s of CPU). Only for those: a diffusers pipeline's caller has transformers imported, while
its ranks may never need transformers' model classes."""


class WorkerError(RuntimeError):
    """A function raised on one or more ranks."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class WorkerRaised(WorkerError):
    """The function raised an ordinary exception on some ranks; every rank came back and the group is intact."""

    def __init__(self, message: str, rank: int, error: str):
        super().__init__(message, rank)
        self.error = error
        """The exception as ``Type: message``, in full (the traceback is in ``str(self)``)."""


class WorkerDiedError(WorkerError):
    """A worker process exited while the group was in use."""


class WorkerTimeout(WorkerError):
    """A call did not finish within its time limit."""


def _group_check() -> None:
    """After ranks raised: a collective over every rank, proving the process group still works."""
    dist.barrier()


def _caller_streams() -> list[_CallerStream]:
    """The caller's stdout and stderr descriptors (1 and 2, where open): what a spawned rank would inherit."""
    streams = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            continue
        streams.append(_CallerStream(fd))
    return streams


PRELOAD_LIST_CHARS = 96 * 1024
"""At most this much of the preload list (its ``repr``): Python 3.11 passes the list on the forkserver's command
line, where Linux allows 128 KiB per argument (a caller with everything imported lists about 70 KiB)."""


def preload_modules(packages: Iterable[str] = ()) -> list[str]:
    """What the forkserver imports before it forks ranks: :mod:`hsdp.forkserver_signals` (first: its signals), the
    launcher (torch, torch.distributed), the
    :data:`RANK_MODULES` of ``packages`` (what the ranks will build models with), then the caller's modules of
    :data:`PRELOAD_PACKAGES` in the order the caller imported them -- what the job needs and what imported cleanly
    here (an LM job's caller never imports diffusers, so neither does its forkserver), up to
    :data:`PRELOAD_LIST_CHARS`. Imports only: none of these modules initializes a device at import (one that is
    not installed is passed over by the forkserver)."""
    wanted = set(PRELOAD_PACKAGES)
    names = ["hsdp.forkserver_signals", "hsdp.launch", *(m for p in packages for m in RANK_MODULES.get(p, ()) if m not in sys.modules)]
    chars = len(repr(names))
    for name in list(sys.modules):
        if name.partition(".")[0] in wanted:
            chars += len(repr(name)) + 2
            if chars > PRELOAD_LIST_CHARS:
                break
            names.append(name)
    return names


_FORKSERVER_FAILED: list[BaseException] = []
"""Set once the forkserver failed to start ranks in this process: later groups spawn."""


def _native_threads() -> int:
    """Threads of this process, native ones included (OpenBLAS's and OpenMP's pools, a store's server loop), which
    ``threading.active_count`` does not see; 1 where ``/proc`` is missing."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _accelerator_built() -> str | None:
    """The accelerator this torch is built for (None: a CPU-only build)."""
    import torch

    if torch.version.cuda or torch.version.hip:
        return "CUDA" if torch.version.cuda else "ROCm"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "_is_compiled", lambda: False)():
        return "XPU"
    return "MPS" if torch.backends.mps.is_built() else None


def fork_problem(rank_threads: int = 1) -> str | None:
    """Why forking ranks that run torch on ``rank_threads`` threads from this process now would be unsafe (None:
    safe). A fork copies the caller's memory, its imports included, so the ranks import nothing again (5-10 s on a
    2-core host); but it copies only the forking thread:

    * another Python thread may hold a lock the rank needs (the import lock, a logging handler's): the caller must
      run no other Python thread (a server's, a test's watcher);
    * torch's OpenMP pool, once the caller has run a parallel op, is copied as a pool whose threads do not exist:
      a rank asking for more than one thread hangs in its first parallel op (measured), one thread never uses the
      pool; so with ``OMP_NUM_THREADS`` > 1 for the ranks the caller must run no native thread either (OpenBLAS's
      pools, started by importing numpy and scipy, stop themselves around a fork);
    * a driver that the caller may have initialized (``torch.cuda.is_available`` runs CUDA's ``cuInit``) cannot be
      used in a forked child, so only a CPU-only torch build forks (torch's own multiprocessing refuses ``fork``
      for CUDA too);
    * another open :class:`WorkerGroup` of this process holds a rendezvous store whose server thread a fork copies
      as state without its thread: a rank that frees its copy aborts (seen in the combination tier, which keeps
      several engines up in one process);
    * macOS's system libraries are not fork-safe: Linux only."""
    if sys.platform != "linux" or "fork" not in mp.get_all_start_methods():
        return f"{sys.platform} is not Linux"
    accelerator = _accelerator_built()
    if accelerator:
        return f"torch is built for {accelerator}, which a forked rank cannot use once the caller has touched it"
    if _OPEN_GROUPS:
        return f"this process holds {len(_OPEN_GROUPS)} open worker group(s), whose stores a fork cannot copy"
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.current_thread())
        return f"this process runs other Python threads ({names})"
    if rank_threads > 1 and _native_threads() > 1:
        return f"the ranks run {rank_threads} threads and this process has native threads (an OpenMP pool?)"
    return None


_OPEN_GROUPS: weakref.WeakSet = weakref.WeakSet()
"""The :class:`WorkerGroup` s of this process whose rendezvous store is up (:func:`fork_problem`)."""


def _stop_progress_monitors() -> None:
    """Stop tqdm's monitor thread, which the first progress bar of this process starts and which then runs until
    the process exits (a disabled bar starts it too: the planner's recorded pipeline call in ``hsdp train``). It
    only redraws stalled bars every 10 s, and the next bar starts it again; left running, it alone made every
    ``hsdp train`` start its ranks by the forkserver, importing torch and diffusers again (:func:`fork_problem`)."""
    tqdm_monitor = sys.modules.get("tqdm._monitor")
    if tqdm_monitor is None:
        return
    for thread in threading.enumerate():
        if isinstance(thread, tqdm_monitor.TMonitor) and thread is not threading.current_thread():
            thread.exit()  # wakes it and joins it
            if getattr(thread.tqdm_cls, "monitor", None) is thread:
                thread.tqdm_cls.monitor = None


def _rank_threads(env: dict[str, str]) -> int:
    value = env.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() else os.cpu_count() or 1


def _start_method(env: dict[str, str], packages: Iterable[str] = ()) -> str:
    """How the next group's ranks start: ``HSDP_START_METHOD`` when set, else ``fork`` when :func:`fork_problem`
    finds none once the modules the ranks build with are imported here (so every rank inherits them), else the
    forkserver (spawn where the platform has none, or where the forkserver failed before)."""
    chosen = os.environ.get(START_METHOD_ENV)
    if chosen and chosen not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={chosen!r}: use one of {', '.join(START_METHODS)}")
    default = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    method = chosen
    if method is None:
        _stop_progress_monitors()
        problem = fork_problem(_rank_threads(env))
        if problem is None:
            with phase("imports (the modules the ranks build with, once for all)"):
                for name in (m for p in packages for m in RANK_MODULES.get(p, ())):
                    with contextlib.suppress(Exception):  # one that fails to import fails in the ranks, reported
                        importlib.import_module(name)  # once here, not once per rank
            problem = fork_problem(_rank_threads(env))  # an import may have started a thread
        method = "fork" if problem is None else default
        logger.debug("ranks start by %s%s", method, f" ({problem})" if problem else "")
    return "spawn" if method == "forkserver" and _FORKSERVER_FAILED else method


def _start_context(method: str, packages: Iterable[str] = ()) -> mp.context.BaseContext:
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(preload_modules(packages))  # used when the forkserver starts (once per caller)
    return ctx


_CALLER_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals that reach a whole process group (a terminal's Ctrl-C; systemd's stop, ``timeout``, ``kill -- -PGID``)
and whose meaning the caller decides, not the forkserver."""


def start_forkserver(packages: Iterable[str] = ()) -> None:
    """Start the forkserver now, preloading what this process has imported (and the :data:`RANK_MODULES` of
    ``packages``), for groups that start later from this process once it runs other threads, where ranks cannot
    fork from it (:func:`fork_problem`): a server's engine restart after a worker died then forks ranks from a
    forkserver whose imports ran while the server served, instead of waiting for them. Returns at once (the
    forkserver imports on its own); a no-op where the platform has no forkserver or ``HSDP_START_METHOD`` names
    another method."""
    if "forkserver" not in mp.get_all_start_methods() or os.environ.get(START_METHOD_ENV, "forkserver") != (
        "forkserver"
    ):
        return
    _start_context("forkserver", packages)
    try:
        with _caller_signals_deferred():  # the forkserver ignores them itself (hsdp.forkserver_signals)
            mp.forkserver.ensure_running()
    except OSError as exc:  # a forkserver of this process that died and was reaped: groups then spawn
        logger.debug("the forkserver did not start early (%s); a later group starts its ranks without it", exc)


_FORK_FORKSERVER: list[bool] = []
"""Set within :func:`fork_forkserver_with_ranks`: a group whose ranks fork forks the forkserver too."""


@contextlib.contextmanager
def fork_forkserver_with_ranks():
    """Within the block, a group that forks its ranks from this process forks the forkserver too, for groups
    that start later once this process runs other threads (a server's engine restart). Forked while nothing but the caller's
    thread runs, the forkserver has every module the caller imported, as the ranks have: it imports nothing, where
    one started by :func:`start_forkserver` imports torch and the model's library again (4.7 s of CPU for
    tiny-llama, measured while the server started answering requests), and a restart soon after the start waited
    for those imports (42 s on a loaded 2-core host). Where ranks do not fork (a CUDA build, ``HSDP_START_METHOD``),
    :func:`start_forkserver` still starts one."""
    _FORK_FORKSERVER[:] = [True]
    try:
        yield
    finally:
        _FORK_FORKSERVER.clear()


def _forkserver_protocol_known() -> bool:
    """The forkserver's entry point takes what :func:`_fork_forkserver` passes (Pythons 3.9-3.13; 3.14 adds an
    authentication key, and its forkserver is then started by :func:`start_forkserver`)."""
    import inspect

    names = list(inspect.signature(mp.forkserver.main).parameters)
    server = mp.forkserver._forkserver
    return names == ["listener_fd", "alive_r", "preload", "main_path", "sys_path"] and all(
        hasattr(server, a) for a in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")
    )


def _fork_forkserver(caller_fds: Iterable[int]) -> None:
    """Fork multiprocessing's forkserver from this process (single-threaded, just after forking ranks) and make
    it this process's forkserver, as :meth:`multiprocessing.forkserver.ForkServer.ensure_running` would after
    starting a fresh interpreter; ``caller_fds``: this process's ends of the ranks' pipes, which the forkserver
    closes (a rank reads EOF on its pipe only once every copy of the caller's end is closed)."""
    from multiprocessing import connection, resource_tracker, util

    server = mp.forkserver._forkserver
    if server._forkserver_pid is not None or threading.current_thread() is not threading.main_thread():
        return
    if not _forkserver_protocol_known():
        return
    resource_tracker.ensure_running()  # before the fork: the forkserver and its ranks share the caller's tracker
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        with _caller_signals_deferred():  # held here, ignored there from its first line
            pid = os.fork()
            if pid == 0:
                _forkserver_main(listener.fileno(), alive_r, alive_w, list(caller_fds))
        os.close(alive_r)
    with server._lock:
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    logger.debug("forkserver %d forked for later groups", pid)


def _forkserver_main(listener_fd: int, alive_r: int, alive_w: int, caller_fds: list[int]) -> None:
    """The forked forkserver: ignores the caller's signals (as :mod:`hsdp.forkserver_signals` makes an exec'd
    one), closes the caller's descriptors it must not hold, then serves fork requests until the caller is gone.
    Never returns."""
    code = 1
    try:
        for sig in _CALLER_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        for fd in (alive_w, *caller_fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
            comm.write("hsdp-forkserver")  # what ps and top show (its command line is the caller's)
        mp.forkserver.main(listener_fd, alive_r, [])
        code = 0
    except SystemExit:  # the caller and every rank are gone
        code = 0
    finally:
        os._exit(code)


@contextlib.contextmanager
def _caller_signals_deferred():
    """:data:`_CALLER_SIGNALS` held for the block and delivered after it: a rank forked in it inherits the holding
    handler, so that a signal to the whole process group does not end it before it sets its own dispositions, and
    the caller still receives its Ctrl-C or SIGTERM (ignored instead, a SIGTERM in a fork's window was lost and the
    run went on; issue 37). A process that ``exec``s (the forkserver) starts with their defaults instead, and
    sets its own (:mod:`hsdp.forkserver_signals`). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in _CALLER_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


def _deliver_event(on_event: Callable[[int, Any], None] | None, rank: int, payload: Any) -> None:
    if on_event is None:
        return
    try:
        on_event(rank, payload)
    except Exception:  # a listener's bug must not break the call it listens to
        logger.exception("on_event callback failed")


def _alive(proc: mp.process.BaseProcess) -> bool:
    """Whether a started rank still runs. A forked rank's exit status comes through its forkserver: if that
    process was killed, ``is_alive`` reads an exit code of 255 for every rank although they run on (their parent
    is gone, not they), so the pid is asked too."""
    if proc.pid is None:
        return False
    if proc.is_alive():
        return True
    return proc.exitcode == 255 and pid_running(proc.pid)


def _kill(proc: mp.process.BaseProcess, timeout_s: float = 5.0) -> None:
    """Kill a rank that still runs and wait until it is gone (by pid when its forkserver, which would report it, is
    dead: ``Process.kill`` then does nothing, believing it exited)."""
    if not _alive(proc):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    proc.join(timeout=timeout_s)
    while pid_running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


class WorkerGroup:
    """``world_size`` worker processes in one process group, driven from the caller.

    >>> with WorkerGroup(2) as group:
    ...     ranks = group.run(torch.distributed.get_rank)   # [0, 1]

    ``packages`` names the libraries the ranks will build models with (``"transformers"``, ``"diffusers"``) where
    the caller has not imported them yet, so that a forkserver this group starts preloads their
    :data:`RANK_MODULES` once instead of every rank importing them.
    """

    def __init__(
        self,
        world_size: int,
        *,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
        collective_timeout_s: float | None = None,
        poll_s: float = 0.2,
        packages: Iterable[str] = (),
        shield_sigterm: bool = False,
    ):
        from hsdp import distributed

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.poll_s = poll_s
        self.broken = False
        self.last_heard = time.monotonic()
        """When a rank last sent anything (a result, an event, a :func:`heartbeat`): a call's sign of life."""
        self._closed = False
        self.shield_sigterm = shield_sigterm
        child_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        timeout = collective_timeout_s or distributed.collective_timeout_s()
        method = _start_method(child_env, packages)
        ctx = _start_context(method, packages)
        try:
            with phase(f"process start ({world_size} ranks by {method})"):
                self._start_ranks(ctx, child_env, timeout)
        except (EOFError, OSError) as exc:
            if ctx.get_start_method() != "forkserver":
                raise
            # The forkserver died before forking (a preloaded module raised at import): spawn from now on.
            logger.warning("the forkserver could not start ranks (%s); starting them with spawn", exc)
            _FORKSERVER_FAILED.append(exc)
            self._stop_ranks()
            self._start_ranks(_start_context("spawn"), child_env, timeout)
        except BaseException:  # Ctrl-C, SIGTERM (hsdp.signals): the ranks started so far go with it
            self._stop_ranks()
            raise
        try:
            with phase("rendezvous (the ranks join the process group)"):
                self._collect(start_timeout_s, what="start")
        except BaseException as exc:
            self.close(graceful=not isinstance(exc, KeyboardInterrupt))  # Ctrl-C, SIGTERM: at once
            raise

    def _start_ranks(self, ctx: mp.context.BaseContext, child_env: dict[str, str], timeout_s: float) -> None:
        host = "127.0.0.1"
        self._conns: list[Connection] = []
        self._procs: list[mp.Process] = []
        method = ctx.get_start_method()
        if method == "forkserver":
            with _caller_signals_deferred():  # the forkserver ignores them itself (hsdp.forkserver_signals)
                mp.forkserver.ensure_running()
        forked = method == "fork"
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            # A forked rank has the caller's environment, directory and streams already, and a copy of every
            # descriptor: it closes the caller's ends of the pipes (its own and those of the ranks before it), or
            # it would never read EOF from its own pipe.
            close_fds = [c.fileno() for c in (*self._conns, parent_conn)] if forked else []
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    host,
                    child_conn,
                    child_env,
                    os.getpid(),
                    timeout_s,
                    os.getcwd(),
                    [] if forked else _caller_streams(),
                    close_fds,
                    self.shield_sigterm,
                ),
                daemon=True,
                name=f"hsdp-rank{rank}",
            )
            with _caller_signals_deferred() if forked else contextlib.nullcontext():  # a forked rank ignores it from birth
                proc.start()
                self._conns.append(parent_conn)  # before a deferred signal is delivered: its stop stops this rank too
                self._procs.append(proc)
            child_conn.close()
        if forked and _FORK_FORKSERVER:
            try:
                _fork_forkserver([c.fileno() for c in self._conns])
            except OSError as exc:  # no process or socket to spare: start_forkserver starts one later
                logger.debug("the forkserver was not forked (%s)", exc)
        # The caller owns the rendezvous store: binding port 0 picks a free port atomically. Made after the forks,
        # so that no rank holds a copy of its listening socket (nor of its server thread's state).
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True, wait_for_workers=False)
        _OPEN_GROUPS.add(self)
        for conn in self._conns:
            conn.send(self._store.port)

    @property
    def store(self) -> dist.Store:
        """The caller's end of the ranks' rendezvous store (each rank reaches it as
        :func:`hsdp.launch.rank.rendezvous_store`): flags the caller sets while a call runs (a cancellation) go
        through it, so an engine needs no second store."""
        if self._store is None:
            raise RuntimeError("this WorkerGroup is closed")
        return self._store

    def _stop_ranks(self) -> None:
        """Kill what :meth:`_start_ranks` started before it failed."""
        for proc in getattr(self, "_procs", []):
            _kill(proc)
        for conn in getattr(self, "_conns", []):
            conn.close()
        self._store = None
        _OPEN_GROUPS.discard(self)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float | None = None,
        on_event: Callable[[int, Any], None] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns the per-rank results in rank order.

        ``fn`` must be importable by name (a module-level function), since it is pickled by reference.
        ``on_event(rank, payload)`` receives what ``fn`` passes to :func:`emit_event`, as it happens.
        """
        return self.run_per_rank(
            fn, [args] * self.world_size, timeout_s=timeout_s, on_event=on_event, **kwargs
        )

    def run_per_rank(
        self,
        fn: Callable[..., Any],
        per_rank_args: list[tuple],
        *,
        timeout_s: float | None = None,
        on_event: Callable[[int, Any], None] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Like :meth:`run`, with a different positional-argument tuple for each rank."""
        if self._closed or self.broken:
            raise WorkerError("this worker group is closed or broken; start a new one")
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"need {self.world_size} argument tuples, got {len(per_rank_args)}")
        try:
            for conn, args in zip(self._conns, per_rank_args, strict=True):
                conn.send((fn, args, kwargs))
        except (BrokenPipeError, OSError) as exc:
            self._fail()
            raise WorkerDiedError(f"a worker is gone: {self._exit_report()}") from exc
        return self._collect(timeout_s, what=getattr(fn, "__name__", str(fn)), on_event=on_event)

    def _collect(
        self, timeout_s: float | None, what: str, on_event: Callable[[int, Any], None] | None = None
    ) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, dict] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = dict(enumerate(self._conns))
        while pending:
            self._receive(pending, results, errors, on_event, self.poll_s)
            if errors:
                self._raise_for(errors, pending, results, what, on_event)
            dead = self._dead_ranks(pending)
            if dead:
                self._fail()
                raise WorkerDiedError(
                    f"{what}: worker rank {dead[0]} died ({self._exit_report()})", rank=dead[0]
                )
            if deadline is not None and time.monotonic() > deadline:
                self._fail()
                raise WorkerTimeout(
                    f"{what} did not finish within {timeout_s:.0f}s on ranks {sorted(pending)}"
                )
        return [results[r] for r in range(self.world_size)]

    def _receive(
        self,
        pending: dict[int, Connection],
        results: dict[int, Any],
        errors: dict[int, dict],
        on_event: Callable[[int, Any], None] | None,
        timeout_s: float,
    ) -> None:
        """Take what the ranks in ``pending`` sent within ``timeout_s``: events go to ``on_event``; a rank that
        returned or raised leaves ``pending``."""
        for conn in wait(list(pending.values()), timeout=timeout_s):
            rank = next(r for r, c in pending.items() if c is conn)
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                continue  # reported by the liveness check
            self.last_heard = time.monotonic()
            if status == _ALIVE:
                continue
            if status == "event":
                _deliver_event(on_event, rank, payload)
                continue
            del pending[rank]
            if status == "err":
                errors[rank] = payload
            else:
                results[rank] = payload

    def _raise_for(
        self,
        errors: dict[int, dict],
        pending: dict[int, Connection],
        results: dict[int, Any],
        what: str,
        on_event: Callable[[int, Any], None] | None,
    ) -> None:
        """A rank raised. If every rank comes back within a grace second, every error is ordinary and a barrier
        still passes, the group is intact: :class:`WorkerRaised`. Otherwise the others may be stuck in a
        collective: the group is torn down, and a peer's death (which survivors see as a collective error
        first) is reported as the cause."""
        grace = time.monotonic() + 1.0
        while pending and time.monotonic() < grace:
            self._receive(pending, results, errors, on_event, 0.05)
        first = min(errors)
        report = errors[first]
        if not pending and all(e["ordinary"] for e in errors.values()) and self._still_connected():
            raise WorkerRaised(
                f"{what} failed on rank {first}:\n{report['traceback']}", first, report["error"]
            )
        dead = self._dead_ranks(pending, grace_s=1.0)
        self._fail()
        if dead:
            raise WorkerDiedError(
                f"{what}: worker rank {dead[0]} died ({self._exit_report()}); rank {first} then failed:\n"
                f"{report['traceback']}",
                rank=dead[0],
            )
        raise WorkerError(f"{what} failed on rank {first}:\n{report['traceback']}", rank=first)

    def _still_connected(self, timeout_s: float = 10.0) -> bool:
        try:
            self.run(_group_check, timeout_s=timeout_s)
        except WorkerError:
            return False
        return True

    def _dead_ranks(self, ranks: Iterable[int], grace_s: float = 0.0) -> list[int]:
        """Ranks among ``ranks`` whose process has exited, waiting up to ``grace_s`` for one to show."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [r for r in ranks if not _alive(self._procs[r])]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _exit_report(self) -> str:
        codes = [
            f"rank {r}: exit code {p.exitcode}" for r, p in enumerate(self._procs) if p.exitcode is not None
        ]
        return "; ".join(codes) or "no exit codes yet"

    def _fail(self) -> None:
        self.broken = True
        self.close(graceful=False)

    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Stop every worker; ranks that do not exit in ``timeout_s`` are killed."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            for conn in self._conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
        deadline = time.monotonic() + (timeout_s if graceful else 0.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            _kill(proc)
        for conn in self._conns:
            conn.close()
        self._store = None  # the rendezvous store holds a listening socket until it is freed
        _OPEN_GROUPS.discard(self)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Ctrl-C: stop the ranks now (they ignore SIGINT and would finish their call first)
        self.close(graceful=exc_type is None or not issubclass(exc_type, KeyboardInterrupt))

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close(graceful=False)
