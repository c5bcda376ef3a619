"""LTX-2: diffusers' context-parallel plan for ``LTX2VideoTransformer3DModel`` splits the video tokens only. The
audio stream, which the video attends to and which attends to the video in every block, stays whole on each rank,
and the rotary embedding of ``rope_type="split"`` (``batch, heads, tokens, dim / 2``) is split along its heads:
diffusers itself fails under a context-parallel config ("The size of tensor a (2) must match the size of tensor b
(4)"). Sequence parallelism is refused before loading until that plan covers the audio stream."""

from __future__ import annotations

from hsdp.families.family import Family, register_family

LTX2 = register_family(
    Family(
        "LTX-2",
        pipelines=r"LTX2.*Pipeline",
        denoisers=r"LTX2VideoTransformer3DModel",
        ulysses_problem="is split by diffusers' context-parallel plan in its video tokens only, not in the audio "
        "stream its blocks attend to (diffusers fails on it too)",
    )
)
