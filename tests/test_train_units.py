"""Training settings checked without a process group: schedules, data formats, plan selection."""

from __future__ import annotations

import pytest

from hsdp.train import TrainConfig


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(model="tiny-llama", data="unused.txt", **kw)


def test_warmup_longer_than_the_run_is_refused_with_the_fix():
    (problem,) = _cfg(steps=10, warmup_steps=20).problems()
    assert "--warmup-steps=20" in problem and "--steps 10" in problem and "--warmup-steps 1" in problem


def test_unknown_scheduler_is_refused():
    (problem,) = _cfg(lr_scheduler="polynomial").problems()
    assert "--lr-scheduler='polynomial'" in problem and "cosine" in problem


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_schedules_follow_transformers(name):
    import torch
    from transformers import get_scheduler

    from hsdp.train.schedule import build_scheduler

    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedulers = [
        build_scheduler(ours, name, 3, 12),
        get_scheduler(f"{name}_with_warmup" if name == "constant" else name, theirs, 3, 12),
    ]
    for _ in range(12):
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
        for scheduler in schedulers:
            scheduler.optimizer.step()
            scheduler.step()


def test_log_lines_follow_the_current_stderr(monkeypatch):
    """The hsdp log handler writes to ``sys.stderr`` as it is now: a run in a process whose stderr was swapped since
    logging was set up (pytest's capture between tests) logged 'I/O operation on closed file' tracebacks."""
    import io
    import logging

    from hsdp.logging_utils import configure_logging

    configure_logging()
    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    logging.getLogger("hsdp").info("one")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    logging.getLogger("hsdp").info("two")
    assert second.getvalue().endswith("] two\n")


def test_ctrl_c_during_a_checkpoint_takes_effect_once_it_is_complete(tmp_path, monkeypatch):
    """A SIGINT that lands inside DCP's file writes used to surface as a RuntimeError from torch.save's writer
    ("unexpected pos"): the checkpoint was lost and the run ended as a crash (exit 1), not an interruption (130)."""
    import os
    import signal

    import torch
    import torch.distributed.checkpoint as dcp

    from hsdp.checkpoint import COMPLETE, Checkpointer, latest_checkpoint

    real_save = dcp.save

    def save_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode: inside the write below
        return real_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", save_interrupted)
    # Python's own SIGINT, unblocked, as in a command run from a terminal (a test process may hold it otherwise)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    try:
        with pytest.raises(KeyboardInterrupt):
            Checkpointer(tmp_path).save(1, model, optimizer, {})
        assert (latest_checkpoint(tmp_path) / COMPLETE).read_text() == "1\n"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def test_a_checkpoint_leaves_an_ignored_ctrl_c_ignored(tmp_path):
    """A process started with SIGINT ignored (a background job of a shell) keeps ignoring it through a save."""
    import signal

    import torch

    from hsdp.checkpoint import Checkpointer, latest_checkpoint

    model = torch.nn.Linear(3, 2)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        Checkpointer(tmp_path).save(1, model, torch.optim.AdamW(model.parameters()), {})
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert latest_checkpoint(tmp_path) is not None


def test_a_stop_signal_is_recorded_passed_on_and_the_handler_restored():
    """hsdp.train.stop: SIGTERM inside the block is recorded (the process goes on), passed on to the pids given, and
    the previous handler is back afterwards; outside the block nothing is recorded."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from hsdp.train.stop import requested, stop_requests

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    before = signal.getsignal(signal.SIGTERM)
    try:
        with stop_requests() as stop:
            stop.forward_to([child.pid])
            assert requested() is None
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread
            assert requested() == stop.signum == signal.SIGTERM
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        child.kill()
    assert requested() is None and signal.getsignal(signal.SIGTERM) is before
