"""Per-rank peak memory while loading a >1 GB checkpoint: sharded loading vs load-then-shard.

Sharded loading (``hsdp.load_pretrained``) builds the model on meta, shards it, and reads only this rank's slices.
Load-then-shard is what vLLM-Omni does today: every rank materialises the whole model and its state dict, then
FSDP2 shards it (on an accelerator the full weights land in device memory first). A third row uses transformers'
own ``from_pretrained`` before sharding: on CPU it keeps the weights as views of the memory-mapped file, so its
anonymous memory stays low until FSDP2 copies the shards, but every rank still maps and touches the whole file. Memory is sampled from /proc/self/status every 5 ms: anonymous memory (RssAnon, what the process
really owns) and file-backed pages (RssFile: safetensors maps the checkpoint, and those pages are shared page
cache), each relative to the process baseline after imports.

    .venv/bin/python benchmarks/load_memory.py            # world 1, 2, 4; writes bench_results/load_memory.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

MIB = 2**20
MODES = ("sharded", "load-then-shard", "from_pretrained")


def _status() -> dict[str, int]:
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            values[key] = int(rest.split()[0]) * 1024
    return values


class PeakSampler:
    """Track the peak of RssAnon and RssFile in a background thread."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.baseline = _status()
        self.peak = dict(self.baseline)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, value in _status().items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def benchmark_config():
    from transformers import LlamaConfig

    # About 300M parameters: 1.2 GB of fp32 weights; the largest tensors are the 49M-element embedding and head.
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )


def write_checkpoint(folder: Path) -> dict:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(benchmark_config())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.save_pretrained(folder)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return {"total_bytes": sum(sizes), "largest_tensor_bytes": max(sizes)}


def measure(path: str, mode: str, world: int) -> dict:
    """Runs on every rank: load the model one way and report peak memory relative to the baseline."""
    import gc

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hsdp.config import ParallelConfig
    from hsdp.loading import load_pretrained
    from hsdp.sharding import apply_hsdp_to_model, parameter_bytes

    gc.collect()
    config = ParallelConfig(use_hsdp=world > 1, hsdp_shard_size=world if world > 1 else -1)
    started = time.perf_counter()
    with PeakSampler() as sampler:
        if mode == "sharded":
            model = load_pretrained(path, config, dtype=torch.float32)
        else:
            if mode == "load-then-shard":
                model = AutoModelForCausalLM.from_config(benchmark_config(), dtype=torch.float32)
                model.load_state_dict(load_file(Path(path) / "model.safetensors"))
            else:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            if world > 1:
                apply_hsdp_to_model(model, config)
        seconds = time.perf_counter() - started
        gc.collect()
        time.sleep(0.05)
        after = _status()
    local, _ = parameter_bytes(model)
    base = sampler.baseline
    return {
        "seconds": seconds,
        "peak_anon": sampler.peak["RssAnon"] - base["RssAnon"],
        "peak_file": sampler.peak["RssFile"] - base["RssFile"],
        "after_anon": after["RssAnon"] - base["RssAnon"],
        "local_param_bytes": local,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--output", default="bench_results/load_memory.json")
    return parser


def main() -> None:
    from hsdp.launch import WorkerGroup

    args = build_parser().parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        info = write_checkpoint(Path(tmp))
        for world in args.worlds:
            for mode in MODES:
                with WorkerGroup(world) as group:
                    results = group.run(measure, tmp, mode, world, timeout_s=900)
                budget = info["total_bytes"] / world + info["largest_tensor_bytes"]
                for rank, r in enumerate(results):
                    rows.append({"world": world, "mode": mode, "rank": rank, "budget": budget, **r})
    print(
        f"\nmodel: {info['total_bytes'] / MIB:.0f} MiB of fp32 weights, largest tensor "
        f"{info['largest_tensor_bytes'] / MIB:.0f} MiB; memory relative to each process's baseline after imports"
    )
    header = (
        f"{'world':>5} | {'mode':<16} | {'rank':>4} | {'peak anon MiB':>13} | {'target MiB':>10} | "
        f"{'ok':>3} | {'peak file-backed MiB':>20} | {'after load anon MiB':>19} | {'params held MiB':>15} | {'s':>5}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ok = "yes" if row["peak_anon"] <= row["budget"] else "no"
        print(
            f"{row['world']:>5} | {row['mode']:<16} | {row['rank']:>4} | {row['peak_anon'] / MIB:>13.0f} | "
            f"{row['budget'] / MIB:>10.0f} | {ok:>3} | {row['peak_file'] / MIB:>20.0f} | "
            f"{row['after_anon'] / MIB:>19.0f} | {row['local_param_bytes'] / MIB:>15.0f} | {row['seconds']:>5.1f}"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": info, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
