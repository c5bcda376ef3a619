"""Fault injection for the server resilience tests, loaded by Python at start-up when this folder is on
PYTHONPATH (only the test's server and its workers have it).

``HSDP_TEST_POISON=1``: a request whose prompt contains "poison" makes the rank that runs it exit, every time, as
a job that crashes its workers would.

``HSDP_TEST_FAULTS=1``: a prompt containing "raise-valueerror" makes the pipeline raise a ``ValueError`` on every
rank (a deterministic error of the request); one containing "slow-decode" makes each module of the VAE sleep
``HSDP_TEST_SLOW_MODULE_S`` (default 0.08 s) before its forward, so the decode takes far longer than
``--step-timeout`` while the ranks keep computing.

``HSDP_TEST_DISK_FULL=<path>``: while the file ``<path>`` exists, the server's disk is "full": writing a job record
or a video fails with ENOSPC (a video leaves a partial staging file behind, as a real full disk does).

``HSDP_TEST_HOLD_FILE=<path>:<step>``: ``hsdp train``'s rank 0 waits before training step ``<step>`` until the file
``<path>`` exists (tests/test_train_report.py reads the run page of a run that is still going).
"""

import os
import time

if os.environ.get("HSDP_TEST_POISON") == "1":
    from hsdp.engine import diffusion

    _generate = diffusion.DiffusionRunner.generate

    def _generate_or_die(self, requests, *args, **kwargs):
        if any("poison" in request.prompt for request in requests):
            os._exit(3)
        return _generate(self, requests, *args, **kwargs)

    diffusion.DiffusionRunner.generate = _generate_or_die

if os.environ.get("HSDP_TEST_FAULTS") == "1":
    from hsdp.engine import diffusion

    _plain_generate = diffusion.DiffusionRunner.generate
    _SLOW_S = float(os.environ.get("HSDP_TEST_SLOW_MODULE_S", "0.08"))

    def _sleep(module, args):
        time.sleep(_SLOW_S)

    def _generate_with_faults(self, requests, *args, **kwargs):
        prompts = " ".join(request.prompt for request in requests)
        if "raise-valueerror" in prompts:
            raise ValueError(f"injected: the pipeline refuses {prompts!r}\nsecond line of the message")
        if "slow-decode" not in prompts:
            return _plain_generate(self, requests, *args, **kwargs)
        handles = [module.register_forward_pre_hook(_sleep) for module in self.pipe.vae.modules()]
        try:
            return _plain_generate(self, requests, *args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

    diffusion.DiffusionRunner.generate = _generate_with_faults

if os.environ.get("HSDP_TEST_DISK_FULL"):
    import errno
    from pathlib import Path

    from hsdp.serve import jobs, runner

    _FLAG = Path(os.environ["HSDP_TEST_DISK_FULL"])
    _write_json = jobs._write_json_atomic
    _save_frames = runner.save_frames

    def _no_space() -> OSError:
        return OSError(errno.ENOSPC, "No space left on device (injected)")

    def _write_json_or_full(path, data):
        if _FLAG.exists():
            raise _no_space()
        _write_json(path, data)

    def _save_frames_or_full(frames, path, fps):
        if _FLAG.exists():
            Path(path).write_bytes(b"partial")
            raise _no_space()
        return _save_frames(frames, path, fps=fps)

    jobs._write_json_atomic = _write_json_or_full
    runner.save_frames = _save_frames_or_full

if os.environ.get("HSDP_TEST_HOLD_FILE"):
    # HSDP_TEST_HOLD_FILE=<path>:<step>: rank 0 holds the run before training step <step> until <path> exists (the
    # other ranks wait in that step's collectives), so a test sees the run page of a run that is still going.
    from hsdp.train import trainer as _trainer

    _gate, _hold_at = os.environ["HSDP_TEST_HOLD_FILE"].rsplit(":", 1)
    _guarded_step = _trainer.Trainer._guarded_step

    def _held_step(self):
        if self.rank == 0 and self.step + 1 == int(_hold_at):
            while not os.path.exists(_gate):
                time.sleep(0.05)
        return _guarded_step(self)

    _trainer.Trainer._guarded_step = _held_step
