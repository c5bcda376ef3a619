"""Token datasets for causal-LM training: a text or JSONL file, tokenized once and packed into fixed blocks.

Packing (documents joined by the end-of-sequence token, cut into ``seq_len`` blocks, the tail dropped) makes
every row the same length with no padding, so each data-parallel rank's mean loss has the same weight and the
FSDP gradient average equals the single-process gradient of the whole batch.

The order of rows is a pure function of ``(seed, step)``: epoch ``e`` is a permutation drawn from a generator
seeded with ``seed + e``. A resumed run therefore sees exactly the rows the uninterrupted run would have seen,
whatever the world size, with no sampler state to save.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["PackedDataset", "read_documents", "DatasetError"]


class DatasetError(ValueError):
    """A training file that cannot be read, or that is too short for one batch."""


def read_documents(path: Path, text_key: str = "text") -> list[str]:
    """The documents of a ``.txt`` file (one document) or a ``.jsonl`` file (one ``{"text": ...}`` per line)."""
    if not path.is_file():
        raise DatasetError(f"--data {path}: no such file")
    if path.suffix == ".jsonl":
        docs = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"--data {path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise DatasetError(
                    f'--data {path}:{lineno}: expected an object with a string "{text_key}" field '
                    f"(set --text-key to use another field)"
                )
            docs.append(record[text_key])
        return docs
    if path.suffix in (".txt", ".md", ""):
        return [path.read_text(encoding="utf-8")]
    raise DatasetError(f"--data {path}: unsupported file type {path.suffix!r}; use a .txt or .jsonl file")


class PackedDataset:
    """Fixed-length blocks of token ids, served as global batches by step."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, seed: int = 0, source: str = "data"):
        if seq_len < 2:
            raise DatasetError(f"--seq-len={seq_len} must be at least 2 (the model predicts the next token)")
        self.seq_len = seq_len
        self.seed = seed
        self.source = source
        rows = tokens.numel() // seq_len
        self.blocks = tokens[: rows * seq_len].view(rows, seq_len).long()
        self._epoch_order: tuple[int, torch.Tensor] = (-1, torch.empty(0, dtype=torch.long))

    @classmethod
    def from_file(
        cls, path: str | Path, tokenizer, seq_len: int, *, seed: int = 0, text_key: str = "text"
    ) -> PackedDataset:
        path = Path(path)
        ids: list[int] = []
        eos = tokenizer.eos_token_id
        for doc in read_documents(path, text_key):
            ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
            if eos is not None:
                ids.append(eos)
        return cls(torch.tensor(ids, dtype=torch.long), seq_len, seed=seed, source=str(path))

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def require(self, rows: int) -> None:
        """Raise a :class:`DatasetError` unless one batch of ``rows`` blocks fits."""
        if len(self) < rows:
            tokens = len(self) * self.seq_len
            raise DatasetError(
                f"--data {self.source}: {tokens} usable tokens make {len(self)} block(s) of --seq-len "
                f"{self.seq_len}, but one batch needs {rows} (--batch-size x --grad-accum); use a longer file, "
                f"a smaller --seq-len or a smaller --batch-size"
            )

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch_order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch_order = (epoch, torch.randperm(len(self), generator=generator))
        return self._epoch_order[1]

    def rows(self, start: int, count: int) -> torch.Tensor:
        """Rows ``start .. start + count`` of the endless epoch-by-epoch shuffled stream of blocks."""
        n = len(self)
        out = []
        for index in range(start, start + count):
            epoch, offset = divmod(index, n)
            out.append(self._order(epoch)[offset])
        return self.blocks[torch.stack(out)]

    def micro_batch(
        self, step: int, micro: int, *, batch_size: int, grad_accum: int, dp_rank: int, dp_size: int
    ) -> torch.Tensor:
        """This data-parallel rank's slice of micro-batch ``micro`` of optimizer step ``step`` (0-based).

        Step ``s`` consumes global rows ``[s * B * A, (s + 1) * B * A)``; micro-batch ``m`` is the ``m``-th run of
        ``B`` rows, split evenly over the ``dp_size`` ranks. So ``B=2, A=2`` sees the same rows as ``B=4, A=1``.
        """
        if batch_size % dp_size:
            raise DatasetError(
                f"--batch-size={batch_size} must be a multiple of the data-parallel size {dp_size} "
                "(each rank takes an equal share)"
            )
        per_rank = batch_size // dp_size
        start = (step * grad_accum + micro) * batch_size + dp_rank * per_rank
        return self.rows(start, per_rank)
