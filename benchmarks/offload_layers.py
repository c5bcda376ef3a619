"""``--offload-layers K``: device-resident parameter bytes and forward time, K = 1 against every block resident.

A Wan-architecture ``diffusers`` transformer (width 512, 8 blocks, as ``benchmarks/residency.py``) sharded over 2
ranks (FSDP2, one block of forward prefetch, as the engine shards a denoiser) runs one denoising forward per step
under ``torch.no_grad()``, in two variants built on every rank:

* ``all resident``: every block's shards on the device (hsdp without the flag);
* ``offload-layers 1``: block 0's shards on the device, blocks 1-7's in host memory (FSDP2's ``CPUOffloadPolicy`` on
  their units), copied in as part of each block's all-gather, which the prefetch starts one block ahead.

On a CPU-only machine the "device" is the host too: the copies are host-to-host and pinning is off, so the
time ratio is the cost of FSDP2's offload bookkeeping and the extra copy, not of a PCIe transfer. The bytes are the
accounted ones: per rank, the parameter bytes FSDP2 keeps outside host-offloaded units (``ShardReport``:
``local_param_bytes - host_param_bytes``), which on a GPU are what stays allocated on the device between blocks,
and the planner's predicted peak per rank (``hsdp plan``'s estimate: weights, gathered working set and the staged
copies, activations). On an accelerator (one per rank, from :func:`hsdp.distributed.local_device`) the variant's
device memory is also measured: what building it left allocated, and its peak during a forward (``max_memory_allocated``
above what was allocated before the forward, plus what the variant holds), as if it were alone on the device. Each
round times both variants once (round-robin, so host load hits them alike); the table gives the median per-round
ratio, slowest rank per round. The outputs are compared: they must be equal.

    python benchmarks/offload_layers.py      # about 1 minute on 2 cores; writes benchmarks/results/offload_layers.json
    python benchmarks/offload_layers.py --world 1 --width 1536 --blocks 30   # Wan 2.1 1.3B's blocks on one GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _report import write_report

MIB = 2**20
VARIANTS = {"all resident": None, "offload-layers 1": 1}


def _model_config(width: int, layers: int) -> dict:
    return dict(num_attention_heads=width // 64, attention_head_dim=64, in_channels=16, out_channels=16,
                text_dim=256, freq_dim=64, ffn_dim=4 * width, num_layers=layers, rope_max_seq_len=1024)  # fmt: skip


def _inputs(side: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 16, 1, side, side, generator=g), torch.tensor([500]), torch.randn(1, 16, 256, generator=g)


def _build(offload_layers: int | None, width: int, layers: int):
    """The variant sharded over every rank, and what building it left allocated on the device (0 on the CPU)."""
    import torch.distributed as dist
    from diffusers import WanTransformer3DModel

    from hsdp.config import ParallelConfig
    from hsdp.distributed import local_device
    from hsdp.sharding import apply_hsdp_to_model

    device = local_device()
    before = _allocated(device)
    torch.manual_seed(0)
    model = WanTransformer3DModel(**_model_config(width, layers)).eval()
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=dist.get_world_size(), offload_layers=offload_layers)
    report = apply_hsdp_to_model(model, config, forward_prefetch=1)
    return model, report, _allocated(device) - before


def _allocated(device: torch.device) -> int:
    return 0 if device.type == "cpu" else int(torch.accelerator.memory_allocated(device))


def _forward(model: torch.nn.Module, inputs: tuple) -> torch.Tensor:
    out = model(*inputs).sample
    if out.device.type != "cpu":
        torch.accelerator.synchronize()  # the kernels and the copies, not just their launch
    return out


def _measured_peak(model: torch.nn.Module, inputs: tuple, held: int) -> int | None:
    """The variant's device peak during one forward as if alone on the device (None on the CPU, where the
    accounted bytes stand in)."""
    device = inputs[0].device
    if device.type == "cpu":
        return None
    torch.accelerator.synchronize()
    torch.accelerator.reset_peak_memory_stats(device)
    before = torch.accelerator.memory_allocated(device)
    _forward(model, inputs)
    return int(torch.accelerator.max_memory_allocated(device) - before + held)


def _predicted_peak(offload_layers: int | None, width: int, layers: int, tokens: int, world: int) -> int:
    """``hsdp plan``'s per-rank peak for the variant (meta-device profile; the same estimate the planner ranks by)."""
    from diffusers import WanTransformer3DModel

    from hsdp.config import ParallelConfig
    from hsdp.planning import Hardware, Layout, Workload, estimate, profile_module

    with torch.device("meta"):
        profile = profile_module(WanTransformer3DModel(**_model_config(width, layers)))
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=world, offload_layers=offload_layers).resolved()
    return estimate([profile], Layout(config, 1), Workload(seq_len=tokens, guidance=False), Hardware(1)).total


def run_rank(width: int, layers: int, side: int, repeats: int) -> dict:
    """This rank's per-round times, accounted bytes and (rank 0) the largest output difference."""
    from hsdp.distributed import local_device

    torch.set_num_threads(1)
    built = {name: _build(k, width, layers) for name, k in VARIANTS.items()}
    inputs = tuple(t.to(local_device()) for t in _inputs(side))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    outputs = {}
    with torch.no_grad():
        for name, (model, _, _) in built.items():  # warm-up (lazy init, first all-gathers)
            outputs[name] = _forward(model, inputs).cpu()
        peaks = {name: _measured_peak(model, inputs, held) for name, (model, _, held) in built.items()}
        for _ in range(repeats):
            for name, (model, _, _) in built.items():
                torch.distributed.barrier()
                started = time.perf_counter()
                _forward(model, inputs)
                times[name].append(time.perf_counter() - started)
    reports = {name: report for name, (_, report, _) in built.items()}
    return {
        "times": times,
        "held_bytes": {name: held for name, (_, _, held) in built.items()},
        "peak_bytes": peaks,
        "local_bytes": {n: r.local_param_bytes for n, r in reports.items()},
        "host_bytes": {n: r.host_param_bytes for n, r in reports.items()},
        "offloaded": {n: r.offloaded_modules for n, r in reports.items()},
        "max_diff": (outputs["offload-layers 1"] - outputs["all resident"]).abs().max().item(),
    }


def _mib(values: list[int | None]) -> list[float] | None:
    return None if None in values else [v / MIB for v in values]


def summarize(ranks: list[dict], width: int, layers: int, side: int) -> list[dict]:
    tokens = (side // 2) ** 2  # patch 1 x 2 x 2 over one latent frame
    base = "all resident"
    slowest = {name: [max(r["times"][name][i] for r in ranks) for i in range(len(ranks[0]["times"][name]))]
               for name in VARIANTS}  # fmt: skip
    rows = []
    for name, k in VARIANTS.items():
        device = [r["local_bytes"][name] - r["host_bytes"][name] for r in ranks]
        rows.append(
            dict(
                variant=name,
                width=width,
                blocks=layers,
                tokens=tokens,
                offloaded_blocks=len(ranks[0]["offloaded"][name]),
                device_param_mib_per_rank=[b / MIB for b in device],
                host_param_mib_per_rank=[r["host_bytes"][name] / MIB for r in ranks],
                device_params_vs_all_resident=max(device)
                / max(r["local_bytes"][base] - r["host_bytes"][base] for r in ranks),
                predicted_peak_mib_per_rank=_predicted_peak(k, width, layers, tokens, len(ranks)) / MIB,
                measured_held_mib_per_rank=_mib([r["held_bytes"][name] if r["peak_bytes"][name] else None
                                                 for r in ranks]),  # fmt: skip
                measured_peak_mib_per_rank=_mib([r["peak_bytes"][name] for r in ranks]),
                median_forward_s=statistics.median(slowest[name]),
                time_vs_all_resident=statistics.median(
                    a / b for a, b in zip(slowest[name], slowest[base], strict=True)
                ),
                max_abs_diff_vs_all_resident=max(r["max_diff"] for r in ranks),
            )
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| variant | blocks offloaded | device params MiB per rank | host params MiB per rank | device params vs all "
             "resident | predicted peak MiB per rank | forward s | time vs all resident | max diff |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        device = " / ".join(f"{b:.1f}" for b in row["device_param_mib_per_rank"])
        host = " / ".join(f"{b:.1f}" for b in row["host_param_mib_per_rank"])
        lines.append(f"| {row['variant']} | {row['offloaded_blocks']} of {row['blocks']} | {device} | {host} "
                     f"| {row['device_params_vs_all_resident']:.2f}x | {row['predicted_peak_mib_per_rank']:.1f} "
                     f"| {row['median_forward_s']:.3f} | {row['time_vs_all_resident']:.2f}x "
                     f"| {row['max_abs_diff_vs_all_resident']:.1g} |")  # fmt: skip
    measured = [row for row in rows if row["measured_peak_mib_per_rank"]]
    lines += [f"measured on the device, {row['variant']}: held {_per_rank(row['measured_held_mib_per_rank'])} MiB, "
              f"peak in a forward {_per_rank(row['measured_peak_mib_per_rank'])} MiB per rank" for row in measured]  # fmt: skip
    return "\n".join(lines)


def _per_rank(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def main() -> None:
    from hsdp.launch import WorkerGroup

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (one accelerator each where there are any)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--side", type=int, default=64, help="latent side (tokens = (side / 2) ** 2)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/offload_layers.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    with WorkerGroup(args.world) as group:
        ranks = group.run(run_rank, args.width, args.blocks, args.side, args.repeats, timeout_s=3600)
    rows = summarize(ranks, args.width, args.blocks, args.side)
    print(table(rows), flush=True)
    if torch.accelerator.is_available():
        device = f"{torch.accelerator.current_accelerator().type}: {torch.cuda.get_device_name() if torch.cuda.is_available() else ''}"
    else:
        device = "CPU only: the 'device' is the host too; bytes are the accounted device-side parameter bytes"
    write_report("offload_layers.py", args, started, rows, args.output, device=device)


if __name__ == "__main__":
    main()
