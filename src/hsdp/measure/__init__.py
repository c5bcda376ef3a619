"""Measurements a run reports, each read one way everywhere (generate, serve, train, benchmarks): this rank's
memory (:mod:`hsdp.measure.memory`) and the collectives and bytes it moved (:mod:`hsdp.measure.comm`)."""

from hsdp.measure.memory import MemoryReading, peak_memory, reset_peak_memory, resident_memory

__all__ = ["MemoryReading", "peak_memory", "reset_peak_memory", "resident_memory"]
