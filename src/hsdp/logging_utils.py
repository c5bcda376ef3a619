"""Log format shared by the caller and the worker ranks: ``INFO 11-21 23:58:01 [rank0] message``."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
import warnings


class _Stderr(logging.StreamHandler):
    """A handler on ``sys.stderr`` as it is when a record is written, not when logging was set up: a process that
    swaps it later (pytest's capture, a caller redirecting it) would otherwise get "I/O operation on closed file"."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the current sys.stderr is always used
        pass


def configure_logging(rank: int | None = None, level: str | None = None) -> None:
    """Send the ``hsdp`` logger to stderr with a rank tag; level from ``HSDP_LOG_LEVEL`` (default INFO)."""
    logger = logging.getLogger("hsdp")
    logger.setLevel((level or os.environ.get("HSDP_LOG_LEVEL") or "INFO").upper())
    tag = "main" if rank is None else f"rank{rank}"
    formatter = logging.Formatter(f"%(levelname)s %(asctime)s [{tag}] %(message)s", datefmt="%m-%d %H:%M:%S")
    for handler in logger.handlers:
        if getattr(handler, "_hsdp", False):
            handler.setFormatter(formatter)
            return
    handler = _Stderr()
    handler._hsdp = True  # type: ignore[attr-defined]
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    logger.propagate = False
    quiet_known_warnings()


# Third-party warnings hsdp's own use makes every run, each shown harmless, filtered by its exact message and the
# module that issues it (never a category or a whole library: the same library's other warnings still show).
KNOWN_WARNINGS: tuple[tuple[str, str, str], ...] = (
    # (message regex, issuing module, why it is harmless here)
    (
        r"Should have tb<=t1 but got tb=",
        r"torchsde\._brownian\.brownian_interval",
        "diffusers' BrownianTreeNoiseSampler (CosineDPMSolverMultistepScheduler: Stable Audio) queries the last step "
        "at sigma_max as a float a rounding error past the tree's t1, which torchsde clamps to t1: the query meant",
    ),
    (
        r"Already found a `peft_config` attribute in the model\. This will lead to having multiple adapters in the "
        r"model\. Make sure to know what you are doing!",
        r"peft\.tuners\.tuners_utils",
        "several adapters on one model is what hsdp composes on purpose (--lora a=... --lora b=..., a served LoRA "
        "beside another), each under its own name (tests/test_lora_multi.py compares them with peft in one process)",
    ),
    (
        r"FSDP2-wrapped module \(FSDPChromaTransformer2DModel\) returned a view tensor\.",
        r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state",
        "Chroma's transformer returns its proj_out's output, which torch makes a view (nn.Linear on a 3-D input "
        "reshapes a 2-D product); nothing writes to it in place, "
        "so the root's pre-backward hook stays and its gradients are right: Chroma trained at HSDP 2 equals one "
        "process, LoRA and full fine-tuning (tests/test_train_families.py::test_heldout_family_lora_hsdp2_equals_"
        "one_process[chroma] and ::test_heldout_family_full_finetune_hsdp2_equals_one_process[chroma], 1e-5)",
    ),
)

TRANSFORMERS_TORCHVISION_FALLBACK = re.compile(
    r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to `\w+ImageProcessorPil` "
)
"""transformers' notice (``transformers.utils.import_utils``, a logger record, not a warning) that an image
processor without torchvision is its PIL class, on every ``hsdp train`` that loads a pipeline with one: the PIL
class is what the name meant before transformers' image-processor refactor (its backward-compatible path), and
hsdp's training and inference never ask for torchvision's."""


class _KnownRecord(logging.Filter):
    """Drops the one transformers record of :data:`TRANSFORMERS_TORCHVISION_FALLBACK` from its logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not TRANSFORMERS_TORCHVISION_FALLBACK.match(record.getMessage())


def quiet_known_warnings() -> None:
    """Filter :data:`KNOWN_WARNINGS` and the transformers record above, in this process (the CLI and each rank
    call it through :func:`configure_logging`); idempotent."""
    for message, module, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module + r"\Z")
    source = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _KnownRecord) for f in source.filters):
        source.addFilter(_KnownRecord())


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""What ``--log-level`` takes (``HSDP_LOG_LEVEL`` takes the same names, any case)."""


def process_age_s() -> float:
    """Seconds since this process started (the interpreter's own start-up included), from ``/proc``; since this
    module was imported where ``/proc`` is missing."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


class StartupProgress:
    """The start-up of a command (imports, checks, the ranks' start and rendezvous, loading), phase by phase.

    Every phase is logged at debug with its time and the time since the process started (``--log-level debug``:
    the per-phase timer). A user also sees where a slow start-up is: on a terminal a bar over the phases, whose
    description names the running one; elsewhere (a log file, a service manager) an info line for each phase
    that took at least :attr:`LONG_S`. Only the caller shows it (ranks log their own lines), and it makes no
    thread: ranks forked from the caller must find it with one (:func:`hsdp.launch.group.fork_problem`)."""

    LONG_S = 3.0

    def __init__(self) -> None:
        self._bar = None
        self._done = 0

    def _show_bar(self) -> bool:
        return sys.stderr.isatty() and logging.getLogger("hsdp").isEnabledFor(logging.INFO)

    def begin(self, phase: str) -> None:
        """``phase`` starts now (the bar shows it)."""
        if not self._show_bar():
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(desc="start-up", total=None, unit="phase", leave=False, file=sys.stderr)
        self._bar.set_description_str(f"start-up: {phase}")

    def end(self, phase: str, seconds: float) -> None:
        """``phase`` took ``seconds``."""
        logger = logging.getLogger("hsdp")
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)
        long = seconds >= self.LONG_S and self._bar is None
        logger.log(
            logging.INFO if long else logging.DEBUG,
            "start-up: %s took %.2fs (%.2fs since the process started)",
            phase,
            seconds,
            process_age_s(),
        )

    def part(self, what: str, seconds: float) -> None:
        """A part of the running phase is done (a component loaded on the ranks, ``what``): the bar shows it; off a
        terminal a part of :attr:`LONG_S` or more is an info line, as a long phase is."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"{what} in {seconds:.1f}s", refresh=True)
        long = seconds >= self.LONG_S and self._bar is None
        logging.getLogger("hsdp").log(logging.INFO if long else logging.DEBUG, "  %s in %.2fs", what, seconds)

    def close(self) -> None:
        """Start-up is over: the bar goes (what follows has its own)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


STARTUP = StartupProgress()
"""This process's start-up (the caller's)."""


@contextlib.contextmanager
def phase(name: str):
    """Time a start-up phase of the caller: :class:`StartupProgress` shows and logs it."""
    STARTUP.begin(name)
    started = time.monotonic()
    try:
        yield
    finally:
        STARTUP.end(name, time.monotonic() - started)
