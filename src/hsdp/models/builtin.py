"""Built-in model names (``tiny-llama``, ...) materialised once into a local cache as real checkpoints.

``resolve_model("tiny-llama")`` returns a folder laid out exactly like a downloaded Hugging Face model
(``config.json``, ``model.safetensors``, tokenizer files), so everything downstream uses the normal loading path.
A path that exists is returned as is; anything else is an error that lists the built-in names.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from hsdp.models.tiny import build_byte_tokenizer, build_tiny_llama, default_cache_dir

__all__ = ["BUILTIN_MODELS", "resolve_model", "register_builtin"]

BUILTIN_MODELS: dict[str, Callable[[Path], None]] = {}
"""name -> function that writes the model into an empty folder."""


def register_builtin(name: str) -> Callable[[Callable[[Path], None]], Callable[[Path], None]]:
    def decorator(writer: Callable[[Path], None]) -> Callable[[Path], None]:
        BUILTIN_MODELS[name] = writer
        return writer

    return decorator


@register_builtin("tiny-llama")
def _write_tiny_llama(folder: Path) -> None:
    build_tiny_llama().save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)


def resolve_model(name_or_path: str | os.PathLike, cache_dir: Path | None = None) -> Path:
    """A local folder for a model path or a built-in name, writing the built-in model on first use."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    name = str(name_or_path)
    if name not in BUILTIN_MODELS:
        raise FileNotFoundError(
            f"model {name!r} is neither an existing path nor a built-in model ({', '.join(sorted(BUILTIN_MODELS))}); "
            "pass a local Hugging Face or diffusers folder (there is no model hub download)"
        )
    folder = (cache_dir or default_cache_dir()) / name
    if (folder / ".complete").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so an interrupted write is never taken as the model.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        BUILTIN_MODELS[name](staging)
        (staging / ".complete").touch()
        try:
            staging.rename(folder)
        except OSError:  # another process finished first
            if not (folder / ".complete").exists():
                shutil.rmtree(folder, ignore_errors=True)
                staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# Built-ins defined in their own modules register themselves on import (after register_builtin exists).
from hsdp.models import tiny_flux, tiny_sdxl, tiny_wan, tiny_wan_i2v  # noqa: E402,F401
