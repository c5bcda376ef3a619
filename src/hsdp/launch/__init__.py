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

Ranks start from a multiprocessing *forkserver* (``HSDP_START_METHOD``, default ``forkserver`` where the platform
has it, else ``spawn``): a helper process, started once per caller, imports torch and the libraries the caller
has already imported (transformers, diffusers, ...; see :func:`preload_modules`), then forks each rank, so a rank
does not pay those imports again (about 3 s of CPU per rank on a 2-core host). The forkserver only imports, it
never touches a device, so forked ranks initialize CUDA and NCCL themselves as spawned ones do (torch's own
``torch.multiprocessing`` accepts ``spawn`` and ``forkserver`` for CUDA, not ``fork``). What a fork would inherit
from the forkserver rather than from the caller at the time of the start -- environment, working directory,
standard output and error -- is passed with each rank and applied first. Environment variables that a library
reads once at import (``HF_HUB_OFFLINE``, say) are those of the caller's first launch: set them before it, or use
``HSDP_START_METHOD=spawn`` (every rank a fresh interpreter, as torchrun's ranks are).
"""

from hsdp.launch.group import (
    START_METHOD_ENV,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerRaised,
    WorkerTimeout,
    preload_modules,
)
from hsdp.launch.rank import emit_event, error_report, event_sink, heartbeat, worker_state

__all__ = [
    "WorkerGroup",
    "WorkerError",
    "WorkerRaised",
    "WorkerDiedError",
    "WorkerTimeout",
    "worker_state",
    "emit_event",
    "event_sink",
    "heartbeat",
    "error_report",
    "preload_modules",
    "START_METHOD_ENV",
]
