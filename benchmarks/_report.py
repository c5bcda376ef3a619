"""The JSON report every benchmark script writes beside its table: the command that made it, the machine's load and
the rows. Imported by the scripts from their own folder (``sys.path``), as ``_training`` is."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def write_report(script: str, args: argparse.Namespace, started: float, rows: list, output: Path, **extra) -> None:
    """Write ``rows`` (and ``extra`` fields) to ``output`` as JSON, with the command line that reproduces them."""
    report = {
        "command": f"python benchmarks/{script} " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        **extra,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output} ({report['seconds']:.0f}s)")
