"""Training records and their token masks: plain text, prompt / completion, and chat conversations.

A record becomes ``(token ids, trained)``: ``trained[i]`` says whether token ``i`` is a target of the loss.

* ``{"text": ...}`` (or the ``--text-key`` field): every token, then the end-of-sequence token.
* ``{"prompt": ..., "completion": ...}``: the completion's tokens and the end-of-sequence token are trained.
* ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the tokenizer's chat template; only the
  assistant turns are trained (their content and whatever the template closes a turn with, such as an
  end-of-turn token, so the model learns to stop). The assistant spans are found by rendering the conversation up
  to each assistant turn with and without that turn: the template must render a conversation's prefix as a prefix
  of its full rendering (true of the common templates; an error says so when it is not).

Files: ``.txt`` / ``.md`` (one text document), ``.jsonl`` (read here, so errors name the line), and ``.json`` /
``.parquet`` through the ``datasets`` library.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["DatasetError", "read_records", "tokenize_record"]

Record = dict[str, Any]


class DatasetError(ValueError):
    """A training file that cannot be read, or that is too short for one batch."""


def _read_jsonl(path: Path, flag: str) -> list[Record]:
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{flag} {path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{flag} {path}:{lineno}: expected a JSON object per line")
        records.append({**record, "_where": f"{path}:{lineno}"})
    return records


def _read_with_datasets(path: Path, flag: str) -> list[Record]:
    try:
        import datasets
    except ImportError as exc:
        raise DatasetError(
            f"{flag} {path}: .json and .parquet files are read with the datasets library; pip install 'hsdp[train]'"
        ) from exc
    builder = "parquet" if path.suffix == ".parquet" else "json"
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for an unreadable file; all mean the same to a user
        raise DatasetError(f"{flag} {path}: could not be read as {builder} ({exc})") from exc
    return [{**row, "_where": f"{path} row {i}"} for i, row in enumerate(table)]


def read_records(path: str | Path, flag: str = "--data") -> list[Record]:
    """The records of a training file; each carries ``_where`` (file and line) for error messages."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{flag} {path}: no such file")
    if path.suffix == ".jsonl":
        return _read_jsonl(path, flag)
    if path.suffix in (".json", ".parquet"):
        return _read_with_datasets(path, flag)
    if path.suffix in (".txt", ".md", ""):
        return [{"text": path.read_text(encoding="utf-8"), "_where": str(path)}]
    raise DatasetError(
        f"{flag} {path}: unsupported file type {path.suffix!r}; use .txt, .jsonl, .json or .parquet"
    )


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def _render(tokenizer, messages: list[Record], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _assistant_spans(tokenizer, messages: list[Record], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1])
        if not (through.startswith(before) and full.startswith(through)):
            raise DatasetError(
                f"--data {where}: the tokenizer's chat template does not render the conversation up to turn {i} "
                "as a prefix of the whole, so the assistant tokens cannot be located; use prompt/completion records"
            )
        spans.append((len(before), len(through)))
    return full, spans


def _chat(tokenizer, messages: Any, where: str) -> tuple[list[int], list[bool]]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DatasetError(
            f'--data {where}: "messages" must be a list of {{"role": ..., "content": ...}} objects'
        )
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise DatasetError(
            f"--data {where}: the conversation has no assistant turn (roles: {roles}), so it has nothing to train "
            "on; add the assistant's reply or drop the record"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f'--data {where}: "messages" records need a tokenizer with a chat template (tokenizer_config.json '
            '"chat_template"); this model has none. Use prompt/completion or text records'
        )
    full, spans = _assistant_spans(tokenizer, messages, where)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(lo <= start < hi for lo, hi in spans) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), trained


def tokenize_record(record: Record, tokenizer, text_key: str = "text") -> tuple[list[int], list[bool]]:
    """Token ids of one record and which of them the loss trains on (see the module docstring)."""
    where = record.get("_where", "?")
    if "messages" in record:
        return _chat(tokenizer, record["messages"], where)
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise DatasetError(f'--data {where}: "prompt" and "completion" must be strings')
        head, tail = _ids(tokenizer, prompt), _ids(tokenizer, completion) + _eos(tokenizer)
        return head + tail, [False] * len(head) + [True] * len(tail)
    if isinstance(record.get(text_key), str):
        ids = _ids(tokenizer, record[text_key]) + _eos(tokenizer)
        return ids, [True] * len(ids)
    fields = ", ".join(sorted(k for k in record if k != "_where"))
    raise DatasetError(
        f'--data {where}: expected a string "{text_key}" field (set --text-key to use another field), '
        f'"prompt" and "completion", or "messages"; found: {fields or "no fields"}'
    )
