"""Causal-LM generation on one rank: ``transformers``' own ``generate`` on a sharded model, ranks in lockstep.

Every forward of a sharded model is a collective, so all ranks must run the same number of forwards even when
their sequences end at different tokens (request-parallel HSDP gives each rank its own prompt). ``generate`` has
exactly this mode, ``synced_gpus=True``: a rank whose sequence is done keeps running forwards (without
sampling) until every rank is done, so its tokens are the ones a single process would produce.
"""

from __future__ import annotations

import time

import torch

from hsdp.attention import set_attention_backend
from hsdp.distributed import local_device
from hsdp.distributed import world_size as current_world_size
from hsdp.engine.components import LoadSpec, load_component
from hsdp.engine.outputs import Timings
from hsdp.engine.params import Request, SamplingParams
from hsdp.launch import emit_event
from hsdp.mesh import ParallelMeshes

__all__ = ["CausalLMRunner", "generation_kwargs"]


def generation_kwargs(params: SamplingParams) -> dict:
    """``generate`` arguments for ``params``; the same on the ranks and in a single-process reference."""
    kwargs: dict = {"max_new_tokens": params.max_new_tokens, "do_sample": params.temperature > 0}
    if params.stop_token_ids:
        kwargs["eos_token_id"] = list(params.stop_token_ids)
    if params.temperature > 0:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    return kwargs


class _TokenClock:
    """A ``generate`` streamer: timestamps each new token (the first ``put`` is the prompt) and, on the rank that
    reports the request, hands each token to the caller as it is produced (progress and streaming)."""

    def __init__(self, request_id: int, total: int, *, progress: bool, report: bool):
        self.request_id = request_id
        self.total = total
        self.report = report
        self.stamps: list[float] = []
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="tokens")

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 1:  # the prompt
            return
        if self._bar is not None:
            self._bar.update()
        if self.report:
            step = len(self.stamps) - 1
            for token in value.reshape(-1).tolist():
                emit_event(
                    {"request_id": self.request_id, "step": step, "total": self.total, "token_id": token}
                )

    def end(self) -> None:
        if self._bar is not None:
            self._bar.close()


class CausalLMRunner:
    kind = "causal_lm"

    def __init__(self, spec: LoadSpec, meshes: ParallelMeshes):
        from transformers import AutoTokenizer

        self.device = local_device()
        self.model = load_component(spec, meshes, lora=spec.lora)
        if spec.attention_backend is not None:
            set_attention_backend(self.model, spec.attention_backend)
        self.sharded = ["model"] if spec.config.use_hsdp else []
        self.tokenizer = AutoTokenizer.from_pretrained(spec.path)
        self.synced = current_world_size() > 1

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def adapted(self) -> dict[str, torch.nn.Module]:
        """The models with LoRA slots, named as :func:`hsdp.engine.checks.lora_target` names them."""
        return {"model": self.model}

    def watched_modules(self) -> list[torch.nn.Module]:
        """A cancellation is checked before every forward (one per token)."""
        return [self.model]

    def generate(
        self, requests: list[Request], params: SamplingParams, *, decode: bool, progress: bool
    ) -> list[dict]:
        """One request at a time: per-request sampling seeds and exact parity need a batch of one."""
        if len(requests) != 1:
            raise ValueError("causal LMs generate one request at a time per rank (batch_size=1)")
        return [self._generate_one(requests[0], params, decode=decode, progress=progress)]

    def _generate_one(
        self, request: Request, params: SamplingParams, *, decode: bool, progress: bool
    ) -> dict:
        started = time.perf_counter()
        inputs = self.tokenizer(request.prompt, return_tensors="pt").to(self.device)
        clock = _TokenClock(request.request_id, params.max_new_tokens, progress=progress, report=decode)
        torch.manual_seed(request.seed)
        pad = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )
        output = self.model.generate(
            **inputs, **generation_kwargs(params), synced_gpus=self.synced, streamer=clock, pad_token_id=pad
        )
        finished = time.perf_counter()
        new_tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
        stamps = clock.stamps
        timings = Timings(
            total_s=finished - started,
            encode_s=stamps[1] - started if len(stamps) > 1 else 0.0,
            step_s=[b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)],
        )
        text = self.tokenizer.decode(new_tokens, skip_special_tokens=True) if decode else None
        return {"token_ids": new_tokens, "text": text, "timings": timings}
