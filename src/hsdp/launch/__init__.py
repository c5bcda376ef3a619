"""Spawn and drive a group of worker ranks from one caller process.

A :class:`WorkerGroup` starts ``world_size`` processes, each joins one process group (device
and backend chosen by :func:`hsdp.distributed.init_distributed`, rendezvous through a ``TCPStore`` the caller
owns, so no port is guessed), then runs the functions the caller sends, in lockstep on every rank. It is used
by the inference engine, the trainer and the multi-rank tests alike.

Failure handling is the point of this module:

* a function that raises an ordinary exception (``ValueError``, a shape error: not a communication failure) on
  some ranks while every rank comes back, and the ranks still complete a collective afterwards, comes back as
  :class:`WorkerRaised` with the exception and the traceback; the group stays usable (nothing to restart);
* any other exception comes back as :class:`WorkerError` with the failing rank's traceback;
* a rank that dies (killed, segfault, OOM) is noticed within ``poll_s`` and reported as :class:`WorkerDiedError`;
* a call that takes longer than ``timeout_s`` raises :class:`WorkerTimeout`;
* in these three cases the group is marked broken and torn down, so a new group can start at once;
* workers exit when the caller goes away (they watch the caller's pid), so they never outlive it.

How ranks start (``HSDP_START_METHOD``: ``fork``, ``forkserver`` or ``spawn``; by default the first that is safe):

* **fork** from the caller, where :func:`~hsdp.launch.group.fork_problem` finds nothing against it: Linux, a
  CPU-only torch build, no other Python thread in the caller (and no native one either when the ranks run torch on
  more than one thread). The ranks inherit everything the caller imported (torch, diffusers, the pipeline class
  that the checks read), so nothing is imported twice: ``hsdp generate`` on tiny-wan at HSDP 2 started its ranks in
  0.3 s where the forkserver took 7 s of imports. The ranks build with the modules the caller has not imported
  yet (:data:`~hsdp.launch.group.RANK_MODULES`) imported in the caller just before the fork, once for all. The
  rendezvous store is made after the fork, so no rank holds its listening socket.
* a **forkserver** otherwise (a server restarting its engine has uvicorn's and its engine's threads: where its
  first ranks fork, it forks the forkserver with them, :func:`fork_forkserver_with_ranks`, which so imports
  nothing; else it starts one once its first engine is up, :func:`start_forkserver`; either way a restart does not
  wait for imports; a CUDA
  build's caller may have initialized CUDA, which a forked child cannot use): a helper process, started once per
  caller, imports torch and the libraries the caller has already imported (see :func:`preload_modules`), then
  forks each rank. It only imports, never touches a device, so forked ranks initialize CUDA and NCCL themselves
  as spawned ones do. What a fork would inherit from the forkserver rather than from the caller at the time of
  the start -- environment, working directory, standard output and error -- is passed with each rank and
  applied first. Environment variables that a library reads once at import (``HF_HUB_OFFLINE``, say) are those
  of the caller's first launch: set them before it, or use ``HSDP_START_METHOD=spawn``.
* **spawn** (every rank a fresh interpreter, as torchrun's ranks are) where the platform has no forkserver or
  the forkserver failed to start ranks.

Every rank ignores SIGINT from its birth (a terminal's Ctrl-C reaches the whole process group; the caller decides
what it means) and exits when the caller is gone (it watches the caller's pid).
"""

from hsdp.launch.group import (
    START_METHOD_ENV,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerRaised,
    WorkerTimeout,
    fork_forkserver_with_ranks,
    fork_problem,
    preload_modules,
    start_forkserver,
)
from hsdp.launch.rank import emit_event, error_report, event_sink, heartbeat, rendezvous_store, worker_state

__all__ = [
    "WorkerGroup",
    "WorkerError",
    "WorkerRaised",
    "WorkerDiedError",
    "WorkerTimeout",
    "worker_state",
    "rendezvous_store",
    "emit_event",
    "event_sink",
    "heartbeat",
    "error_report",
    "preload_modules",
    "fork_problem",
    "fork_forkserver_with_ranks",
    "start_forkserver",
    "START_METHOD_ENV",
]
