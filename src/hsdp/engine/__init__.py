"""The inference engine: :class:`Engine`, :class:`SamplingParams` and the outputs of ``generate``."""

from hsdp.engine.engine import Engine
from hsdp.engine.outputs import GenerationOutput, Timings
from hsdp.engine.params import SamplingParams

__all__ = ["Engine", "GenerationOutput", "SamplingParams", "Timings"]
