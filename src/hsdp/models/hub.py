"""Hugging Face Hub names (``org/name``) resolved to a local snapshot through ``huggingface_hub`` itself.

Everything a user already set for diffusers and transformers applies: ``HF_HOME`` / ``HF_HUB_CACHE`` (the same cache
folder, so a model ``from_pretrained`` downloaded is not fetched again), ``HF_TOKEN`` (or ``hf auth login``),
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE=1`` (the cached snapshot, no network). Only the files the pipeline loads are
fetched: for a diffusers pipeline, its index (:data:`hsdp.models.description.INDEX_FILE`) and the folders of the components it names (their configs,
tokenizer files and ``*.safetensors`` weights without a variant infix, or with ``--variant`` that variant's where a
component has it); for a transformers model, the top-level
configs, tokenizer files and safetensors. A repository's other formats (``.bin``, ``.ckpt``, ``.onnx``, other
variants, single-file ``*.safetensors`` at a pipeline's root, ``original/``) are never downloaded; a folder with no
safetensors at all falls back to its ``.bin`` files, which diffusers and transformers load.

One process per node downloads: the download holds a file lock in the cache (``filelock``, as ``huggingface_hub``
uses), and any other process of the node waits for it (``HSDP_DOWNLOAD_TIMEOUT`` seconds, default 3600) and then
finds the files in the cache. A shared cache folder makes that once per cluster. An interrupted download resumes
(``huggingface_hub`` keeps the ``.incomplete`` blobs).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from hsdp.models.description import INDEX_FILE, is_pipeline, pipeline_index
from hsdp.models.tiny import default_cache_dir
from hsdp.safetensors_index import variant_of

__all__ = ["HubError", "download_model", "is_hub_name", "pipeline_files", "plan_snapshot"]

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TEXT_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py")
"""Configs, tokenizers and vocabularies a component folder may hold (``.py``: a custom-code model's own modules)."""
_WEIGHTS = (".safetensors", ".bin")
DEFAULT_TIMEOUT_S = 3600.0


class HubError(FileNotFoundError):
    """A hub name that cannot be resolved: no access, no such revision, offline and not cached, no network."""

    unreachable = False
    """The hub could not be reached (no network, a dead mirror): the cached snapshot may still serve."""


_NETWORK_ERRORS = ("ConnectError", "ConnectTimeout", "TimeoutException", "NetworkError", "ConnectionError")
"""Class names of the connection errors of the HTTP clients huggingface_hub uses (httpx, requests)."""
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
"""No space left, a file over the process's size limit (``RLIMIT_FSIZE``), a quota exceeded."""


def is_hub_name(name: str) -> bool:
    """``org/name``: the form of a Hugging Face repository id (a path that exists is taken as a path first)."""
    return bool(_HUB_NAME.match(name)) and ".." not in name


def download_model(
    repo_id: str, revision: str | None = None, *, progress: bool = True, variant: str | None = None
) -> Path:
    """The local snapshot folder of ``repo_id`` at ``revision``, downloading what the pipeline loads (once per
    node: other processes wait on the lock; ``variant``: that variant's weights where a component has them,
    :mod:`hsdp.models.variant`). Raises :class:`HubError` with what to do."""
    from filelock import FileLock, Timeout
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return _cached_snapshot(repo_id, revision, variant)
    timeout = float(os.environ.get("HSDP_DOWNLOAD_TIMEOUT", DEFAULT_TIMEOUT_S))
    lock_path = Path(constants.HF_HUB_CACHE) / ".locks" / "hsdp" / f"{repo_id.replace('/', '--')}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(lock_path), timeout=timeout):
            commit, files = _repo_files(repo_id, revision)
            return _snapshot(repo_id, revision, pipeline_files(files, _model_index(repo_id, commit, files), variant),
                             local_only=False, progress=progress)
    except HubError as exc:
        if not exc.unreachable:
            raise
        try:  # as diffusers and transformers do without a network: the cached snapshot, if it is complete
            return _cached_snapshot(repo_id, revision, variant)
        except HubError:
            raise exc from None
    except Timeout:
        raise HubError(
            f"model {repo_id!r}: another process on this machine has held the download lock {lock_path} for "
            f"{timeout:.0f} s (it is downloading the model); wait for it, raise HSDP_DOWNLOAD_TIMEOUT, or fetch "
            f"ahead of time with `hsdp download {repo_id}`"
        ) from None


def plan_snapshot(repo_id: str, revision: str | None = None, variant: str | None = None) -> Path:
    """A folder with ``repo_id``'s configs and tokenizer files and, for each safetensors file the pipeline loads,
    a stand-in of the same size holding its header and no data (a sparse file: no disk used for the data), so a
    planner reads shapes and dtypes without the weights being downloaded. Offline: the cached snapshot."""
    from huggingface_hub import HfApi, constants

    if constants.is_offline_mode():
        try:
            return _cached_snapshot(repo_id, revision, variant)
        except HubError:  # weights not cached: the header stand-ins an online plan left, if any
            snapshot = _cached_folder(repo_id, revision)
            stand_ins = snapshot and _headers_folder(repo_id, snapshot.name)
            if stand_ins and (stand_ins / ".complete").exists():
                return stand_ins
            raise
    commit, files = _repo_files(repo_id, revision)
    chosen = pipeline_files(files, _model_index(repo_id, commit, files), variant)
    weights = [f for f in chosen if f.endswith(".safetensors")]
    text = [f for f in chosen if f not in weights and not f.endswith(".bin")]
    snapshot = _snapshot(repo_id, revision, text, local_only=False, progress=False)
    folder = _headers_folder(repo_id, snapshot.name)
    for name in text:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():  # copied beside, then renamed: a full disk leaves no half file taken later
            partial = target.with_name(target.name + ".partial")
            shutil.copyfile(snapshot / name, partial)
            partial.rename(target)
    api = HfApi()
    for name in weights:
        if not (folder / name).exists():
            with _hub_errors(repo_id, revision):
                header = api.parse_safetensors_file_metadata(repo_id, name, revision=snapshot.name)
            _write_header_stand_in(folder / name, header)
    (folder / ".complete").write_text("")
    return folder


def _headers_folder(repo_id: str, commit: str) -> Path:
    return default_cache_dir() / "hub-headers" / repo_id.replace("/", "--") / commit


def _cached_folder(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of ``revision`` (as far as any of its configs is cached), or None."""
    from huggingface_hub import try_to_load_from_cache

    for probe in (INDEX_FILE, "config.json"):
        found = try_to_load_from_cache(repo_id, probe, revision=revision)
        if isinstance(found, str):
            return Path(found).parent
    return None


def _cached_snapshot(repo_id: str, revision: str | None, variant: str | None = None) -> Path:
    """Offline: the cached snapshot, checked by ``huggingface_hub`` against the repository listing it cached for
    the files the pipeline loads (a component folder missing altogether is named here)."""
    snapshot = _cached_folder(repo_id, revision)
    if snapshot is None:  # huggingface_hub's own error for a snapshot not cached, with our message
        return _snapshot(repo_id, revision, None, local_only=True, progress=False)
    files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    index = pipeline_index(snapshot) if is_pipeline(snapshot) else None
    chosen = pipeline_files(files, index, variant)
    folders = [k for k, v in index.items() if _is_component(v)] if index else [""]
    missing = [k or "." for k in folders if not _has_weights_if_a_model([f for f in chosen if _parent(f) == k])]
    if missing:
        raise HubError(
            f"model {repo_id!r}: the cached snapshot {snapshot} lacks {missing} or their weights (an interrupted or "
            f"partial download, or only what `hsdp plan` fetched); run `hsdp download {repo_id}` where the hub can "
            "be reached"
        )
    return _snapshot(repo_id, revision, chosen, local_only=True, progress=False)


def _parent(file: str) -> str:
    parent = str(PurePosixPath(file).parent)
    return "" if parent == "." else parent


def _has_weights_if_a_model(files: list[str]) -> bool:
    """A folder holds something, and a model's folder (its ``config.json``) holds weights too (tokenizers and
    schedulers have none)."""
    names = {PurePosixPath(f).name for f in files}
    return bool(names) and ("config.json" not in names or any(n.endswith(_WEIGHTS) for n in names))


def _write_header_stand_in(path: Path, header: object) -> None:
    """A safetensors file with ``header``'s tensors (dtype, shape, offsets) and holes for their data."""
    entries: dict[str, object] = {"__metadata__": header.metadata} if header.metadata else {}
    end = 0
    for key, info in header.tensors.items():
        entries[key] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
        end = max(end, info.data_offsets[1])
    encoded = json.dumps(entries).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        f.truncate(8 + len(encoded) + end)
    partial.rename(path)


def pipeline_files(files: list[str], model_index: dict | None, variant: str | None = None) -> list[str]:
    """The files of a repository (``files``: its paths) that the pipeline or model loads (with ``variant``: that
    variant's weights in each folder that has them)."""
    if model_index is None:
        return _folder_files(files, "", variant)
    components = [k for k, v in model_index.items() if not k.startswith("_") and _is_component(v)]
    chosen = [f for f in _folder_files(files, "") if f.endswith(".json") and not _is_weight_index(f)]
    for component in components:
        chosen += _folder_files(files, component, variant)
    return chosen


def _is_component(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(v is not None for v in value)


def _folder_files(files: list[str], folder: str, variant: str | None = None) -> list[str]:
    """The configs, tokenizer files and weights directly in ``folder`` ("" for the root): ``variant``'s weights
    where the folder has some, else the default ones."""
    here = [f for f in files if str(PurePosixPath(f).parent) == (folder or ".")]
    names = {f: PurePosixPath(f).name for f in here}
    text = [f for f in here if any(fnmatch.fnmatch(names[f], p) for p in _TEXT_FILES) and not _is_weight_index(names[f])]
    for suffix in _WEIGHTS:  # safetensors when there are any, else the .bin files
        weights = [f for f in here if _is_weights(names[f], suffix) and variant_of(names[f]) is None]
        if variant and any(variant_of(names[f]) == variant and names[f].endswith(suffix) for f in here):
            weights = [f for f in here if _is_weights(names[f], suffix) and variant_of(names[f]) == variant]
        if folder == "" and suffix == ".safetensors":
            weights = [w for w in weights if names[w].startswith("model")]  # not a single-file checkpoint beside
        if any(w.endswith(suffix) for w in weights):
            return text + weights
    return text


def _is_weight_index(name: str) -> bool:
    return name.endswith((".safetensors.index.json", ".bin.index.json")) or (
        name.endswith(".json") and variant_of(name) is not None
    )


def _is_weights(name: str, suffix: str) -> bool:
    """A weight file or weight index of ``suffix`` (``.safetensors``, ``.bin``), of any variant."""
    return name.endswith(suffix) or (_is_weight_index(name) and f"{suffix}.index" in name)


def _repo_files(repo_id: str, revision: str | None) -> tuple[str, list[str]]:
    """The commit ``revision`` names (so every later request reads that one commit) and its files."""
    from huggingface_hub import HfApi

    with _hub_errors(repo_id, revision):
        info = HfApi().model_info(repo_id, revision=revision)
    return info.sha, [s.rfilename for s in info.siblings or []]


def _model_index(repo_id: str, revision: str | None, files: list[str]) -> dict | None:
    from huggingface_hub import hf_hub_download

    if INDEX_FILE not in files:
        return None
    with _hub_errors(repo_id, revision):
        return pipeline_index(Path(hf_hub_download(repo_id, INDEX_FILE, revision=revision)).parent)


def _snapshot(repo_id: str, revision: str | None, allow: list[str] | None, *, local_only: bool, progress: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        with _hub_errors(repo_id, revision):
            return Path(
                snapshot_download(repo_id, revision=revision, allow_patterns=allow, local_files_only=local_only)
            )
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """Turn ``huggingface_hub``'s errors into :class:`HubError` messages that say what to do."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            from huggingface_hub import constants

            raise HubError(
                f"model {repo_id!r}: writing into the Hugging Face cache {constants.HF_HUB_CACHE} failed "
                f"({exc.strerror}: the disk or a size limit is full). Nothing half-written is kept: huggingface_hub "
                "writes each file beside its place and moves it in only when complete. Free space there (or point "
                f"HF_HOME / HF_HUB_CACHE at a larger disk) and run `hsdp download {repo_id}` again: the files "
                "already complete are not fetched again"
            ) from exc
        if any(c.__name__ in _NETWORK_ERRORS for c in type(exc).__mro__):
            from huggingface_hub import constants

            error = HubError(
                f"model {repo_id!r}: cannot reach the hub at {constants.ENDPOINT} ({exc}) and the model is not in "
                f"the Hugging Face cache {constants.HF_HUB_CACHE}; run `hsdp download {repo_id}` where the hub can "
                "be reached, with the same HF_HOME / HF_HUB_CACHE"
            )
            error.unreachable = True
            raise error from exc
        message = _message(repo_id, revision, exc)
        if message is None:
            raise
        raise HubError(message) from exc


def _message(repo_id: str, revision: str | None, exc: BaseException) -> str | None:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = constants.HF_HUB_CACHE
    name = f"model {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    if isinstance(exc, GatedRepoError):
        return (
            f"{name} is gated: the hub refused access ({_status(exc)}); accept its license on "
            f"https://huggingface.co/{repo_id} and set HF_TOKEN (or run `hf auth login`) with that account's token"
        )
    if isinstance(exc, RepositoryNotFoundError):
        token = "with the HF_TOKEN given" if _has_token() else "and no HF_TOKEN is set"
        return (
            f"{name} is not a local folder, and the hub has no such repository, or it is private {token} "
            f"({_status(exc)}); check the path or name, "
            "or set HF_TOKEN (or run `hf auth login`) with a token that can read it"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"{name}: the repository has no revision {revision!r}; pass --revision a branch, tag or commit of it"
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        why = "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else "the hub cannot be reached"
        return (
            f"{name} is not in the Hugging Face cache {cache} and {why}; run `hsdp download {repo_id}` where the "
            "hub can be reached, with the same HF_HOME / HF_HUB_CACHE (or copy that cache here)"
        )
    if isinstance(exc, HfHubHTTPError):
        return f"{name}: the hub answered {_status(exc)}: {exc}"
    return None


def _status(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(exc).__name__


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None
