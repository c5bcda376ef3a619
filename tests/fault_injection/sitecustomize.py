"""Fault injection for the server resilience tests, loaded by Python at start-up when this folder is on
PYTHONPATH (only the test's server and its workers have it): a request whose prompt contains "poison" makes the
rank that runs it exit, every time, as a job that crashes its workers would."""

import os

if os.environ.get("HSDP_TEST_POISON") == "1":
    from hsdp.engine import diffusion

    _generate = diffusion.DiffusionRunner.generate

    def _generate_or_die(self, requests, *args, **kwargs):
        if any("poison" in request.prompt for request in requests):
            os._exit(3)
        return _generate(self, requests, *args, **kwargs)

    diffusion.DiffusionRunner.generate = _generate_or_die
