"""Functions the core tests run on every rank (module level, so worker processes can import them)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hsdp.config import ParallelConfig
from hsdp.loading import load_pretrained
from hsdp.models.tiny import build_tiny_llama, build_tiny_wan_transformer
from hsdp.sharding import apply_hsdp_to_model


def hsdp_config(shard: int, replicate: int = 1) -> ParallelConfig:
    return ParallelConfig(use_hsdp=True, hsdp_shard_size=shard, hsdp_replicate_size=replicate)


def llama_inputs() -> torch.Tensor:
    return torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(1))


def wan_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(1, 4, 5, 8, 8, generator=g), torch.tensor([500]), torch.randn(1, 7, 32, generator=g)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def shard_and_compare(shard: int, replicate: int) -> dict:
    """Shard tiny Wan and Llama models; compare outputs, generated tokens and held bytes with one process."""
    capture = _Capture()
    logging.getLogger("hsdp").addHandler(capture)
    config = hsdp_config(shard, replicate)
    out: dict = {}
    try:
        reference, model = build_tiny_llama(), build_tiny_llama()
        ids = llama_inputs()
        with torch.no_grad():
            want = reference(ids).logits
            want_tokens = reference.generate(ids[:1], max_new_tokens=8, do_sample=False)
        report = apply_hsdp_to_model(model, config)
        with torch.no_grad():
            out["llama_diff"] = (model(ids).logits - want).abs().max().item()
            out["llama_diff_second_call"] = (model(ids).logits - want).abs().max().item()
            out["tokens_equal"] = torch.equal(
                model.generate(ids[:1], max_new_tokens=8, do_sample=False), want_tokens
            )
        out["llama_report"] = report
        out["llama_row_bytes"] = sum(
            p[0].numel() * p.element_size() for p in reference.parameters() if p.dim()
        )
        out["unsharded_after_forward"] = [
            n for n, p in model.named_parameters() if not isinstance(p, torch.distributed.tensor.DTensor)
        ]
        reference, model = build_tiny_wan_transformer(), build_tiny_wan_transformer()
        x, t, context = wan_inputs()
        with torch.no_grad():
            want = reference(x, t, context).sample
            out["wan_report"] = apply_hsdp_to_model(model, config)
            out["wan_diff"] = (model(x, t, context).sample - want).abs().max().item()
        try:
            with torch.inference_mode():
                model(x, t, context)
        except RuntimeError as exc:
            out["inference_mode_error"] = str(exc)
    finally:
        logging.getLogger("hsdp").removeHandler(capture)
    out["logs"] = capture.messages
    return out


def load_and_compare(paths: dict, shard: int, replicate: int) -> dict:
    """Load tiny checkpoints sharded and compare with the models that were saved (or from_pretrained for bf16)."""
    from diffusers import WanTransformer3DModel
    from transformers import AutoModelForCausalLM

    config = hsdp_config(shard, replicate)
    ids = llama_inputs()
    x, t, context = wan_inputs()
    out = {}
    with torch.no_grad():
        want = build_tiny_llama()(ids).logits
        for key in ("llama-fp32", "llama-sharded"):
            out[key] = (load_pretrained(paths[key], config)(ids).logits - want).abs().max().item()
        offload = dataclasses.replace(config, cpu_offload=True)
        out["llama-offload"] = (
            (load_pretrained(paths["llama-fp32"], offload)(ids).logits - want).abs().max().item()
        )
        layerwise = load_pretrained(paths["llama-fp32"], dataclasses.replace(config, offload_layers=1))
        out["llama-offload-layers"] = (layerwise(ids).logits - want).abs().max().item()
        out["offload-layers-placement"] = offload_placement(layerwise)
        model = load_pretrained(paths["llama-bf16"], config, dtype=torch.float32)
        reference = AutoModelForCausalLM.from_pretrained(paths["llama-bf16"], dtype=torch.float32)
        out["llama-bf16-as-fp32"] = (model(ids).logits - reference(ids).logits).abs().max().item()
        model = load_pretrained(paths["llama-bf16"], config)
        reference = AutoModelForCausalLM.from_pretrained(paths["llama-bf16"], dtype=torch.bfloat16)
        out["llama-bf16-dtype"] = str(next(model.parameters()).dtype)
        out["llama-bf16"] = (model(ids).logits.float() - reference(ids).logits.float()).abs().max().item()
        want = build_tiny_wan_transformer()(x, t, context).sample
        model = load_pretrained(paths["wan-fp32"] / "transformer", config)
        out["wan-fp32"] = (model(x, t, context).sample - want).abs().max().item()
        model = load_pretrained(paths["wan-bf16"] / "transformer", config)
        reference = WanTransformer3DModel.from_pretrained(
            paths["wan-bf16"] / "transformer", torch_dtype=torch.bfloat16
        )
        args = (x.bfloat16(), t, context.bfloat16())
        out["wan-bf16"] = (model(*args).sample.float() - reference(*args).sample.float()).abs().max().item()
    return out


def offload_placement(model: torch.nn.Module) -> dict:
    """Per FSDP unit: whether FSDP2 offloads it, and the devices of its sharded parameters; and the report."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from hsdp.sharding import fsdp_units

    units = {}
    for name, unit in fsdp_units(model):
        group = unit._get_fsdp_state()._fsdp_param_group
        units[name] = (
            isinstance(group.offload_policy, CPUOffloadPolicy),
            sorted({str(p.sharded_param.device) for p in group.fsdp_params}),
        )
    report = model.hsdp_report
    return {"units": units, "offloaded": report.offloaded_modules, "host_bytes": report.host_param_bytes,
            "local_bytes": report.local_param_bytes}


def load_expecting_error(path: str, shard: int) -> str:
    try:
        load_pretrained(path, hsdp_config(shard))
    except Exception as exc:  # the test compares the message on every rank
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def fail_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    dist.barrier()  # the healthy ranks wait here: the caller must not wait for them
    return dist.get_rank()


def die_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return dist.get_rank()


def sleep_for(seconds: float) -> None:
    time.sleep(seconds)


def resolve_builtin_on_rank(writer_rank: int, name: str, cache_dir: str) -> str | None:
    """``resolve_model(name)`` on ``writer_rank`` only, inside the process group; its folder."""
    from hsdp.models.builtin import resolve_model

    if dist.get_rank() != writer_rank:
        return None
    return str(resolve_model(name, cache_dir=Path(cache_dir)))
