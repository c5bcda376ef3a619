"""``hsdp download ORG/NAME``: fetch a Hugging Face Hub model into the Hugging Face cache ahead of time (for
clusters whose compute nodes have no internet: run it where the hub can be reached, with the cache the nodes share,
and run the other commands there with ``HF_HUB_OFFLINE=1``). Only what the pipeline loads is fetched
(:mod:`hsdp.models.hub`); the snapshot folder is printed."""

from __future__ import annotations

import argparse

from hsdp.cli import add_source_arguments

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face Hub name (org/name)")
    add_source_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from hsdp.models.hub import download_model, is_hub_name

    if not is_hub_name(args.model):
        raise ValueError(f"{args.model!r} is not a Hugging Face Hub name (org/name); hsdp download fetches hub models")
    print(download_model(args.model, args.revision, variant=args.variant))
    return 0
