"""``hsdp_defaults.json``: generation defaults a model folder may carry beside its weights (size, steps, guidance).

The engine reads them over the pipeline's ``__call__`` defaults (:func:`hsdp.engine.model_info.inspect_model`); the
built-in tiny models write theirs so the docs' commands produce small outputs. Below both, so neither imports the
other for it.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DEFAULTS_FILE", "write_generation_defaults"]

DEFAULTS_FILE = "hsdp_defaults.json"


def write_generation_defaults(folder: str | Path, defaults: dict) -> None:
    (Path(folder) / DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2) + "\n")
