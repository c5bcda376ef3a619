"""Measurements a run reports: this rank's memory (:mod:`hsdp.measure.memory`)."""

from hsdp.measure.memory import MemoryReading, peak_memory, reset_peak_memory, resident_memory

__all__ = ["MemoryReading", "peak_memory", "reset_peak_memory", "resident_memory"]
