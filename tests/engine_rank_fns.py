"""Rank-side probes of a loaded engine (sent through the test session's worker group)."""

from __future__ import annotations

from hsdp.launch import worker_state


def cfg_parallel_steps() -> list[int]:
    """Steps each CFG-parallel denoiser wrapper ran with its two branches split across the cfg ranks."""
    runner = worker_state()["hsdp.engine.runner"][0]
    return [w.parallel_steps for w in runner.cfg_wrappers]
