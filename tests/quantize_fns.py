"""Rank-side functions and single-process references for ``tests/test_quantize.py`` (module-level: pickled by
reference into the worker ranks)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

WIDE_WAN = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=1, text_dim=64)
"""Wan 2.1 1.3B's block shape (width 1536, 12 heads of 128, FFN 8960), one block."""


def wan_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 4, 1, 8, 8, generator=g).bfloat16()  # 16 tokens: the test is about weights
    text = torch.randn(1, 8, WIDE_WAN["text_dim"], generator=g).bfloat16()
    return hidden, torch.tensor([500]), text


def wide_wan() -> nn.Module:
    from hsdp.models.tiny import build_tiny_wan_transformer

    model = build_tiny_wan_transformer(**WIDE_WAN)
    keep = set(model._keep_in_fp32_modules or ())  # as loading casts: norms and time embedders stay fp32
    for name, param in model.named_parameters():
        if not keep.intersection(name.split(".")):
            param.data = param.data.bfloat16()
    return model


def quantized_names(model: nn.Module) -> list[str]:
    """Parameters this rank stores as 8-bit shards."""
    from torch.distributed.tensor import DTensor

    from hsdp.quantize import QuantizedWeight

    return [
        name
        for name, p in model.named_parameters()
        if isinstance(p, DTensor) and isinstance(p.to_local(), QuantizedWeight)
    ]


def wan_gathered_bytes(weight_dtype: str | None) -> dict:
    """Shard the wide Wan block (bf16) over this group, run two forwards; the second one's all-gather bytes
    (warm: the first includes lazy init), this rank's parameter bytes, and the output."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hsdp.config import ParallelConfig
    from hsdp.measure.comm import CommCounter
    from hsdp.sharding import apply_hsdp_to_model, parameter_bytes

    torch.set_num_threads(1)
    model = wide_wan()
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=dist.get_world_size())
    apply_hsdp_to_model(model, config, weight_dtype=weight_dtype)
    with torch.no_grad():
        model(*wan_inputs(), return_dict=False)
        with CommCounter() as counter:
            [out] = model(*wan_inputs(), return_dict=False)
    local, total = parameter_bytes(model)
    sharded = [p.to_local() for p in model.parameters() if isinstance(p, DTensor)]
    return dict(
        all_gather=counter.bytes["all_gather"],
        local_bytes=local,
        sharded_bytes=sum(getattr(t, "stored_bytes", t.numel() * t.element_size()) for t in sharded),
        total_bytes=total,
        quantized=quantized_names(model),
        out=out,
    )


def fake_quantized(model: nn.Module, names: list[str]) -> nn.Module:
    """``model`` with the weights ``names`` replaced by their quantize-dequantize round trip, in place."""
    from hsdp.quantize import fake_quantize

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            params[name].copy_(fake_quantize(params[name], torch.int8))
    return model


def lm_logits_and_tokens(path: Path, weight_dtype: str | None, new_tokens: int) -> dict:
    """Load the LM sharded (int8 shards quantized as read), logits of a fixed sequence and greedy tokens."""
    import torch.distributed as dist

    from hsdp.config import ParallelConfig
    from hsdp.loading import load_pretrained
    from hsdp.sharding import parameter_bytes

    torch.set_num_threads(1)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=dist.get_world_size())
    model = load_pretrained(path, config, weight_dtype=weight_dtype)
    ids = lm_input_ids()
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(
            ids[:, :8], max_new_tokens=new_tokens, do_sample=False, synced_gpus=True, pad_token_id=0
        )
    return dict(
        logits=logits,
        tokens=tokens[0, 8:].tolist(),
        quantized=quantized_names(model),
        local_bytes=parameter_bytes(model)[0],
    )


def lm_input_ids() -> torch.Tensor:
    return torch.randint(4, 260, (1, 48), generator=torch.Generator().manual_seed(3))


def reference_lm(path: Path, names: list[str], new_tokens: int) -> dict:
    """The plain LM in this process (fresh weight copies), weights ``names`` fake-quantized."""
    from transformers import AutoModelForCausalLM

    from tests.engine_refs import one_thread

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for param in model.parameters():
        param.data = param.data.clone()
    fake_quantized(model, names)
    ids = lm_input_ids()
    with one_thread(), torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids[:, :8], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return dict(logits=logits, tokens=tokens[0, 8:].tolist())


def fake_quantize_pipeline(pipe, shardable, shard_size: int = 2) -> None:
    """The Linear weights of ``pipe``'s ``shardable`` components that ``--weight-dtype int8`` stores in 8 bits
    replaced by their quantize-dequantize round trip (the same selection rule,
    :func:`hsdp.quantize.quantize_linear_weights`), in place."""
    from hsdp.quantize import quantize_linear_weights
    from hsdp.shard_rules import resolve_plan
    from hsdp.sharding import _unshardable_params

    for name in shardable:
        component = getattr(pipe, name)
        for param in component.parameters():
            param.data = param.data.clone()
        skip = set(_unshardable_params(component, resolve_plan(component), training=False).values())
        for qualified in quantize_linear_weights(component, "int8", shard_size=shard_size, skip=skip):
            module = component.get_submodule(qualified.removesuffix(".weight"))
            module.weight = nn.Parameter(module.weight.dequantize(), requires_grad=False)


def reference_frames_fake_quantized(path: Path, shardable: list[str], prompt: str, seed: int, call: dict):
    """Frames of the plain pipeline in this process, with the Linear weights the sharded run stores in 8 bits
    fake-quantized: the same selection rule (:func:`hsdp.quantize.quantize_linear_weights`) on each component."""
    from diffusers import DiffusionPipeline

    from tests.engine_refs import one_thread

    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    fake_quantize_pipeline(pipe, shardable)
    with one_thread(), torch.no_grad():
        return pipe(
            prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **call
        ).frames[0]


# -- --device-memory (tests/test_device_memory.py) --------------------------------------------------------------
PLAN_WAN = dict(num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16, text_dim=256,
                freq_dim=64, ffn_dim=2048, num_layers=4, rope_max_seq_len=256)  # fmt: skip
PLAN_SIDE = 32  # 16 x 16 patches: 256 tokens


def plan_wan() -> nn.Module:
    from hsdp.models.tiny import build_tiny_wan_transformer

    return build_tiny_wan_transformer(**PLAN_WAN)


def stored_gathered_bytes(folder: Path, dtype: str) -> dict:
    """Load a Wan transformer folder at HSDP over this group (a converted GGUF / fp8-scaled single file keeps its
    stored bytes), run two forwards; the second one's all-gather bytes and this rank's parameter bytes."""
    import torch.distributed as dist

    from hsdp.config import ParallelConfig
    from hsdp.loading import load_pretrained
    from hsdp.measure.comm import CommCounter
    from hsdp.sharding import parameter_bytes

    torch.set_num_threads(1)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=dist.get_world_size())
    model = load_pretrained(folder, config, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 4, 1, 8, 8, generator=g).to(model.dtype), torch.tensor([500]),
              torch.randn(1, 8, model.config.text_dim, generator=g).to(model.dtype))  # fmt: skip
    with torch.no_grad():
        model(*inputs, return_dict=False)
        with CommCounter() as counter:
            model(*inputs, return_dict=False)
    return dict(all_gather=counter.bytes["all_gather"], local_bytes=parameter_bytes(model)[0])


def lora_grads_over(folder: Path) -> dict:
    """LoRA (r 4 on the attention projections) over a Wan transformer folder, loaded for training at HSDP over this
    group: one forward and backward of a fixed batch; the adapters' gradients, gathered, and how many base weights
    this rank keeps in their stored bytes (a converted GGUF / fp8-scaled single file's)."""
    import torch.distributed as dist
    from peft import LoraConfig
    from torch.distributed.tensor import DTensor

    from hsdp import lora
    from hsdp.config import ParallelConfig
    from hsdp.loading import load_pretrained, local_slices
    from hsdp.stored_quant import StoredQuantWeight

    torch.set_num_threads(1)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=dist.get_world_size())
    adapters = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    model = load_pretrained(folder, config, training=True, prepare=lora.injector(adapters))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # the adapters as the trainer leaves them uninitialised: the same values on every rank
        for _, param in sorted(model.named_parameters()):
            if param.requires_grad:
                local, region = local_slices(param)
                local.copy_(0.05 * torch.randn(param.shape, generator=generator)[region])
    model.train()
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, 4, 1, 8, 8, generator=g), torch.tensor([500, 300]),
              torch.randn(2, 8, model.config.text_dim, generator=g))  # fmt: skip
    [out] = model(*inputs, return_dict=False)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for n, p in model.named_parameters() if p.requires_grad}  # fmt: skip
    stored = sum(isinstance(p.to_local(), StoredQuantWeight) for p in model.parameters() if isinstance(p, DTensor))
    return dict(grads=grads, stored=stored)
