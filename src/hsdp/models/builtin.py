"""Built-in model names (``tiny-llama``, ...) materialised once into a local cache as real checkpoints.

``resolve_model("tiny-llama")`` returns a folder laid out exactly like a downloaded Hugging Face model
(``config.json``, ``model.safetensors``, tokenizer files), so everything downstream uses the normal loading path.
A path that exists is returned as is; an ``org/name`` that is neither is a Hugging Face Hub name
(:mod:`hsdp.models.hub`); anything else is an error that lists the built-in names.

A cached folder is complete when its ``.complete`` marker holds the model's version (:data:`BUILTIN_VERSIONS`); a
folder written by an older version of a built-in (another tokenizer, another size) is written again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hsdp.models.hub import download_model, is_hub_name
from hsdp.models.registry import BUILTIN_MODELS, BUILTIN_VERSIONS, register_builtin
from hsdp.models.tiny import build_byte_tokenizer, build_tiny_llama, default_cache_dir

__all__ = ["BUILTIN_MODELS", "BUILTIN_VERSIONS", "builtin_names", "resolve_model", "register_builtin"]


TINY_LLAMA_CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
"""Each turn as ``<s>ROLE\nCONTENT</s>``: a conversation's prefix renders as a prefix of the whole (what chat
training needs to find the assistant's tokens), and an assistant turn ends with EOS, so a tuned model stops."""


@register_builtin("tiny-llama", version="2: chat template")
def _write_tiny_llama(folder: Path) -> None:
    build_tiny_llama().save_pretrained(folder)
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = TINY_LLAMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def builtin_names() -> str:
    """The built-in model names, for help texts and messages (every registered one: nothing to keep in sync)."""
    return ", ".join(sorted(BUILTIN_MODELS))


def resolve_model(
    name_or_path: str | os.PathLike,
    cache_dir: Path | None = None,
    *,
    revision: str | None = None,
    variant: str | None = None,
) -> Path:
    """A local folder for a model path, a built-in name (written on first use) or a Hugging Face Hub name
    (``org/name``: its snapshot in the Hugging Face cache, downloading only what the pipeline loads; ``revision``:
    a branch, tag or commit, default ``main``; :mod:`hsdp.models.hub`). ``variant`` (``fp16``): a hub download
    fetches that variant's weights instead of the default ones where a component has them; the folder returned
    still holds them under their variant names (:func:`hsdp.models.variant.with_variant` reads them)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    name = str(name_or_path)
    if name not in BUILTIN_MODELS:
        if is_hub_name(name):
            return _hub_snapshot(name, revision, variant)
        raise FileNotFoundError(
            f"model {name!r} is neither an existing path nor a built-in model ({builtin_names()}) nor a Hugging "
            "Face Hub name (org/name); pass a local Hugging Face or diffusers folder, or a hub repository id"
        )
    folder = (cache_dir or default_cache_dir()) / name
    if _is_current(folder, name):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so an interrupted write is never taken as the model.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        _write_builtin(name, staging)
        (staging / ".complete").write_text(BUILTIN_VERSIONS[name])
        _replace(folder, staging, name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


_SNAPSHOTS: dict[tuple[str, str | None, str | None], Path] = {}
"""Hub names this process resolved: one lookup per process, whichever command asks again."""


def _hub_snapshot(name: str, revision: str | None, variant: str | None) -> Path:
    key = (name, revision, variant)
    if key not in _SNAPSHOTS:
        _SNAPSHOTS[key] = download_model(name, revision, variant=variant)
    return _SNAPSHOTS[key]


def _write_builtin(name: str, folder: Path) -> None:
    """Run the built-in's writer; in a fresh interpreter when this process is a rank of a process group.

    transformers' ``save_pretrained`` writes weights only on global rank 0 of an initialized group, so any other
    rank would install a folder whose text encoders hold no weights (and no rank 0 writes another node's cache).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        BUILTIN_MODELS[name](folder)
        return
    subprocess.run(
        [sys.executable, "-c", _WRITER, name, str(folder)],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


_WRITER = "import sys, pathlib; from hsdp.models.builtin import BUILTIN_MODELS as M; M[sys.argv[1]](pathlib.Path(sys.argv[2]))"


def _is_current(folder: Path, name: str) -> bool:
    marker = folder / ".complete"
    return marker.exists() and marker.read_text().strip() == BUILTIN_VERSIONS[name]


def _replace(folder: Path, staging: Path, name: str) -> None:
    """Move ``staging`` to ``folder``, setting aside a folder an older version wrote."""
    try:
        staging.rename(folder)
        return
    except OSError:  # the folder exists: another process finished first, or an older version
        if _is_current(folder, name):
            return
    old = Path(tempfile.mkdtemp(prefix=f".{name}-old-", dir=folder.parent))
    with contextlib.suppress(FileNotFoundError):
        folder.rename(old / name)
    try:
        staging.rename(folder)
    except OSError:  # another process put a current version there meanwhile
        if not _is_current(folder, name):
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


# Built-ins defined in their own modules register themselves on import (in hsdp.models.registry, which they
# import instead of this module, so importing one of them first makes no import circle).
from hsdp.models import tiny_flux, tiny_sdxl, tiny_stable_audio, tiny_wan, tiny_wan_i2v  # noqa: E402,F401
