"""``--vae-parallel``: a VAE decode split over 2 ranks against one rank decoding alone.

Two decodes, each on every variant:

* ``video``: tiny-Wan's ``AutoencoderKLWan``, 33 frames of 256 x 256 (latents 9 x 32 x 32), with 128-pixel tiles
  at a 96-pixel stride (``enable_tiling``'s arguments: Wan's default 256-pixel tile makes such a frame one tile);
* ``image``: an ``AutoencoderKL`` of tiny-FLUX's layout 4x wider (channels 32, 64, 64, 64), 1024 x 1024, with
  SD's 512-pixel tiles (``sample_size``).

Variants: ``one rank`` (rank 0 decodes whole while rank 1 waits: hsdp without the flag), ``one rank tiled``
(diffusers' ``enable_tiling``: the output ``--vae-parallel --vae-tiling`` equals), ``2 ranks split`` (the tiles split,
:func:`hsdp.vae_parallel.enable_vae_parallel`) and ``2 ranks exact`` (``--vae-parallel``: the whole decode's rows
split, :func:`hsdp.vae_parallel.enable_exact_split`, its output the ``one rank`` one within float rounding).
One thread per rank, so two ranks use the 2 cores one rank leaves idle, as two GPUs would. Each round times every
variant once (round-robin, so host load hits them alike); the table gives the median. Peak memory is the most
tensor storage alive at once during one decode, per rank, among the tensors the decode creates (activations, tiles,
gathered buffers, output; ``_LivePeak``): what ``max_memory_allocated`` adds to the weights and latents on a GPU. CPU seconds per rank (``process_time``) show
the work each rank did whatever other work shares the host; ``host_parallelism`` measures what two ranks can gain
on it at all.

    python benchmarks/vae_parallel.py      # about 5 minutes on 2 cores; writes benchmarks/results/vae_parallel.json
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref
from pathlib import Path

import torch
from _report import write_report
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MIB = 2**20
VARIANTS = ("one rank", "one rank tiled", "2 ranks split", "2 ranks exact")
CASES = {
    "video": {"frames": 33, "size": 256,
              "tiling": {"tile_sample_min_height": 128, "tile_sample_min_width": 128,
                         "tile_sample_stride_height": 96, "tile_sample_stride_width": 96}},
    "image": {"frames": 1, "size": 1024, "tiling": {}},
    # diffusers' default AutoencoderKLWan is Wan 2.1's VAE (channels 96-384; random weights): an accelerator's case
    "wan-vae": {"frames": 33, "size": 512, "tiling": {}},
}  # fmt: skip


def _vae(case: str) -> torch.nn.Module:
    """The case's VAE on this rank's device (:func:`hsdp.distributed.local_device`)."""
    from hsdp.distributed import local_device

    if case == "video":
        from hsdp.models.tiny_wan import build_tiny_wan_pipeline

        vae = build_tiny_wan_pipeline().vae
    elif case == "wan-vae":
        from diffusers import AutoencoderKLWan

        torch.manual_seed(0)
        vae = AutoencoderKLWan()
    else:
        from hsdp.models.tiny_flux import tiny_flux_vae

        vae = tiny_flux_vae(4, seed=3, block_out_channels=[32, 64, 64, 64], norm_num_groups=8, sample_size=512)
    return vae.eval().to(local_device())


def _latents(vae: torch.nn.Module, case: str) -> torch.Tensor:
    spec = CASES[case]
    side = spec["size"] // 8
    video = spec["frames"] > 1
    channels = vae.config.z_dim if video else vae.config.latent_channels
    shape = (1, channels, 1 + (spec["frames"] - 1) // 4, side, side) if video else (1, channels, side, side)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(next(vae.parameters()).device)


def _variant(case: str, variant: str):
    import torch.distributed as dist

    from hsdp.vae_parallel import enable_exact_split, enable_vae_parallel

    vae = _vae(case)
    if variant == "2 ranks exact":
        if (whole := enable_exact_split(vae, dist.group.WORLD)) is not None:
            raise RuntimeError(f"{case}: the row split decodes whole: {whole}")
        return vae
    if variant == "2 ranks split":
        enable_vae_parallel(vae, dist.group.WORLD)
    if variant != "one rank":
        vae.enable_tiling(**CASES[case]["tiling"])
    return vae


def _runs_here(variant: str) -> bool:
    import torch.distributed as dist

    return variant.startswith("2 ranks") or dist.get_rank() == 0


def _timed(vae, z) -> tuple[float, float, torch.Tensor]:
    """Wall seconds, this process's CPU seconds (all its threads: gloo's included) and the output."""
    import torch.distributed as dist

    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    out = vae.decode(z).sample
    if z.device.type != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter() - started, time.process_time() - cpu, out


def host_parallelism(rounds: int = 3) -> float:
    """How much faster two ranks finish two equal matrix-product loops than one rank finishes one: 2.0 with two
    free cores, about 1.0 when other work holds them (the ceiling of any wall-time gain in this run)."""
    import torch.distributed as dist

    a = torch.randn(384, 384, generator=torch.Generator().manual_seed(0))

    def loop() -> float:
        started = time.perf_counter()
        for _ in range(150):
            a @ a
        return time.perf_counter() - started

    ratios = []
    for _ in range(rounds):
        dist.barrier()
        both = loop()
        dist.barrier()
        alone = torch.tensor([loop() if dist.get_rank() == 0 else 0.0])
        dist.broadcast(alone, 0)
        both_max = torch.tensor([both])
        dist.all_reduce(both_max, dist.ReduceOp.MAX)
        ratios.append(2 * alone.item() / both_max.item())
    return statistics.median(ratios)


class _LivePeak(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those the ops under it create (not the weights or the
    latents, which exist before): what ``max_memory_allocated`` adds over them on a GPU. torch's ``MemTracker``
    refuses a module called several times in one region, which a video VAE's decoder is."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._seen:
                    self._seen.add(key)
                    self.live += nbytes
                    weakref.finalize(storage, self._free, key, nbytes)
                    self.peak = max(self.peak, self.live)
        return out


def _peak(vae, z) -> int:
    with _LivePeak() as tracker:
        vae.decode(z)
    return tracker.peak


def run_rank(case: str, repeats: int) -> dict:
    """This rank's times, peaks and, on rank 0, the split output's largest difference from the tiled one."""
    import os

    import torch.distributed as dist

    from hsdp.vae_parallel import TileSplit

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    vaes = {v: _variant(case, v) for v in VARIANTS}
    z = _latents(vaes["one rank"], case)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks, outputs = {}, {}
    with torch.no_grad():
        for r in range(repeats):
            for variant in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
                if _runs_here(variant):
                    seconds, cpu_seconds, outputs[variant] = _timed(vaes[variant], z)
                    times[variant].append(seconds)
                    cpu[variant].append(cpu_seconds)
                else:
                    dist.barrier()
                dist.barrier()  # the slowest rank ends the round
        for variant in VARIANTS:
            peaks[variant] = _peak(vaes[variant], z) if _runs_here(variant) else None
            dist.barrier()
    split: TileSplit = vaes["2 ranks split"].tiled_decode.last_split
    result = {"times": times, "cpu": cpu, "peaks": peaks, "tiles": split.tiles, "computed": split.computed,
              "meta_runs": split.meta_runs, "host_parallelism": host_parallelism(),
              "load_average": [load_before, os.getloadavg()[0]]}  # fmt: skip
    if dist.get_rank() == 0:
        result["max_diff_split_vs_tiled"] = (outputs["2 ranks split"] - outputs["one rank tiled"]).abs().max().item()
        result["max_diff_tiled_vs_whole"] = (outputs["one rank tiled"] - outputs["one rank"]).abs().max().item()
        result["max_diff_exact_vs_whole"] = (outputs["2 ranks exact"] - outputs["one rank"]).abs().max().item()
        result["output_shape"] = list(outputs["one rank"].shape)
    return result


def summarize(case: str, ranks: list[dict]) -> list[dict]:
    rows = []
    base = statistics.median(ranks[0]["times"]["one rank"])
    tiled = statistics.median(ranks[0]["times"]["one rank tiled"])
    base_peak = ranks[0]["peaks"]["one rank"]
    tiled_cpu = statistics.median(ranks[0]["cpu"]["one rank tiled"])
    for variant in VARIANTS:
        seconds = max(statistics.median(r["times"][variant]) for r in ranks if r["times"][variant])
        peaks = [r["peaks"][variant] for r in ranks if r["peaks"][variant] is not None]
        cpu = [statistics.median(r["cpu"][variant]) for r in ranks if r["cpu"][variant]]
        rows.append(
            dict(
                case=case,
                variant=variant,
                seconds=seconds,
                first_round_seconds=max(r["times"][variant][0] for r in ranks if r["times"][variant]),
                speedup_vs_one_rank=base / seconds,
                speedup_vs_one_rank_tiled=tiled / seconds,
                peak_mib_per_rank=[p / MIB for p in peaks],
                peak_vs_one_rank=max(peaks) / base_peak,
                cpu_s_per_rank=cpu,
                cpu_vs_one_rank_tiled=max(cpu) / tiled_cpu,
                host_parallelism=ranks[0]["host_parallelism"],
                tiles_computed=[r["computed"] for r in ranks] if variant == "2 ranks split" else None,
            )
        )
    rows[2]["tiles"] = ranks[0]["tiles"]
    rows[2]["meta_runs_per_rank"] = [r["meta_runs"] for r in ranks]
    rows[2]["max_diff_vs_tiled"] = ranks[0]["max_diff_split_vs_tiled"]
    rows[1]["max_diff_vs_whole"] = ranks[0]["max_diff_tiled_vs_whole"]
    rows[3]["max_diff_vs_whole"] = ranks[0]["max_diff_exact_vs_whole"]
    for row in rows:
        row["load_average_1min"] = ranks[0]["load_average"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| decode | variant | s | vs one rank | vs one rank tiled | CPU s per rank | CPU vs one rank tiled "
             "| peak MiB per rank | peak vs one rank |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        peaks = " / ".join(f"{p:.0f}" for p in row["peak_mib_per_rank"])
        cpu = " / ".join(f"{c:.1f}" for c in row["cpu_s_per_rank"])
        lines.append(f"| {row['case']} | {row['variant']} | {row['seconds']:.2f} | {row['speedup_vs_one_rank']:.2f}x "
                     f"| {row['speedup_vs_one_rank_tiled']:.2f}x | {cpu} | {row['cpu_vs_one_rank_tiled']:.2f}x | {peaks} "
                     f"| {row['peak_vs_one_rank']:.2f}x |")  # fmt: skip
    lines.append(f"host parallelism (2 ranks' matrix products vs one): {rows[0]['host_parallelism']:.2f}x; 1-minute "
                 f"load average before / after: {' / '.join(f'{x:.1f}' for x in rows[0]['load_average_1min'])}")
    lines += [f"{row['case']} {row['variant']}: largest difference from one rank's whole decode "
              f"{row['max_diff_vs_whole']:.2g}" for row in rows if "max_diff_vs_whole" in row]  # fmt: skip
    lines += [f"{row['case']}: {row['tiles']} tiles, computed per rank {row['tiles_computed']}; decoder calls sized on "
              f"meta per rank in the last decode {row['meta_runs_per_rank']} (the first decode sizes, later ones reuse); "
              f"first round {row['first_round_seconds']:.2f} s" for row in rows if "meta_runs_per_rank" in row]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    from hsdp.launch import WorkerGroup

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=["video", "image"],
                        help="wan-vae (Wan 2.1's VAE at 33 x 512 x 512) is for accelerators: minutes per decode on a CPU")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per case")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/vae_parallel.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    with WorkerGroup(2) as group:
        for case in args.cases:
            rows += summarize(case, group.run(run_rank, case, args.repeats, timeout_s=3600))
            print(table(rows), flush=True)
    write_report("vae_parallel.py", args, started, rows, args.output, cases=CASES)


if __name__ == "__main__":
    main()
