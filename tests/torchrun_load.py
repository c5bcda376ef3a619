"""Run under torchrun: join from the environment, load a checkpoint sharded, compare with the saved model."""

import json
import sys

import torch

from hsdp import ParallelConfig, destroy_distributed, init_distributed, load_pretrained
from hsdp.models.tiny import build_tiny_llama


def main(path: str) -> None:
    init_distributed()  # RANK / WORLD_SIZE / MASTER_ADDR from torchrun
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(1))
    model = load_pretrained(path, ParallelConfig(use_hsdp=True, hsdp_shard_size=2))
    with torch.no_grad():
        diff = (model(ids).logits - build_tiny_llama()(ids).logits).abs().max().item()
    report = model.hsdp_report
    # One write per line: both ranks share torchrun's stdout, and print() writes the newline separately.
    sys.stdout.write(json.dumps({"rank": report.rank, "diff": diff, "fraction": report.fraction}) + "\n")
    sys.stdout.flush()
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
