"""hsdp.signals (SIGTERM raises Stopped where a command has no handling of its own) and the suite's own signal state
(issue 37 item 5: a command a test starts must receive the Ctrl-C the test sends it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hsdp.errors import exit_code, format_problem
from hsdp.signals import STOP_EXIT, Stopped, sigterm_raises


def test_sigterm_raises_once_and_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as caught, sigterm_raises():
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            signal.raise_signal(signal.SIGTERM)  # a second one (SLURM signals every process) leaves the clean-up be
    assert signal.getsignal(signal.SIGTERM) is before
    assert isinstance(caught.value, KeyboardInterrupt)  # whatever stops ranks at once on Ctrl-C does so here too
    assert exit_code(caught.value) == STOP_EXIT == 143
    assert format_problem("generate", caught.value) == "hsdp generate: stopped by SIGTERM"
    assert format_problem("generate", KeyboardInterrupt()) == "hsdp generate: interrupted"


def test_a_command_the_suite_starts_receives_ctrl_c():
    """Started in the background by a non-interactive shell, the suite inherits SIGINT ignored, and so did every
    command it started (tests/conftest.py restores a terminal's SIGINT)."""
    status = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    masks = {k: int(v, 16) for k, v in (line.split(":\t") for line in status.splitlines() if line.startswith(("SigIgn", "SigBlk")))}
    sigint = 1 << (signal.SIGINT - 1)
    assert not masks["SigIgn"] & sigint and not masks["SigBlk"] & sigint, masks


_FORKSERVER_START = """
import multiprocessing as mp, os, signal, time
from hsdp.launch import start_forkserver
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
mp.forkserver.ensure_running = lambda real=mp.forkserver.ensure_running: (real(), os.kill(os.getpid(), signal.SIGTERM))
start_forkserver()
time.sleep(0.2)
pid = mp.forkserver._forkserver._forkserver_pid
deadline = time.monotonic() + 60
while not int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("SigIgn")).split()[1], 16) & (1 << 14):
    assert time.monotonic() < deadline, "the forkserver never ignored SIGTERM"
    time.sleep(0.05)
print(got, int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("SigIgn")).split()[1], 16))
"""


def test_a_sigterm_while_the_forkserver_starts_reaches_the_caller_and_spares_the_forkserver():
    """The caller used to ignore SIGINT and SIGTERM while it started the forkserver (so that the forkserver inherited
    that): a SIGTERM in that window was lost and `hsdp train` trained on. Now the caller holds them and receives them
    after, and the forkserver ignores them itself (hsdp.forkserver_signals)."""
    out = subprocess.run([sys.executable, "-c", _FORKSERVER_START], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HSDP_START_METHOD": "forkserver"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    got, ignored = out.stdout.split("]")
    assert got == f"[{int(signal.SIGTERM)}"  # the caller's handler ran, once
    assert int(ignored) & (1 << (signal.SIGINT - 1)) and int(ignored) & (1 << (signal.SIGTERM - 1))
