"""Token datasets for causal-LM training: records tokenized once, packed into fixed blocks or padded to one row each.

Packing (the default) joins the records (see :mod:`hsdp.train.records`) and cuts them into ``seq_len`` blocks,
dropping the tail, so no token is padding. Attention must not cross records: when a dataset has several records,
each batch carries ``position_ids`` restarting at 0 for each record and no ``attention_mask``, from which
transformers builds the block-diagonal causal mask itself in the form each attention implementation reads
(``masking_utils``' packed-sequence detection: eager, SDPA, flex attention; flash attention's varlen kernels take
the position ids), so a packed record is computed as if it stood alone. (An explicit 4-D mask is read differently
by each implementation: eager attention adds a boolean one to the scores.) :func:`packing_problem` refuses a model
whose attention implementation transformers builds no such mask for. The first token of each record is never a target, so the last token of one record does not learn to predict the
next record. A single document (a ``.txt`` file) needs neither and is fed plainly. Without packing each record is
one row, truncated to ``seq_len`` and right-padded, with a 2-D padding mask.

Loss normalisation: when labels are masked (chat, prompt / completion, padding, record starts), rows hold different
numbers of targets; the trainer divides each rank's summed token losses by the step's global number of targets
(:meth:`TokenDataset.step_targets`, computed locally from the step's rows), so the loss and gradient are the
token mean over the whole step at every world size.

The order of rows is a pure function of ``(seed, step)``: epoch ``e`` is a permutation drawn from a generator
seeded with ``seed + e``. A resumed run therefore sees exactly the rows the uninterrupted run would have seen,
whatever the world size, with no sampler state to save.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hsdp.distributed import copy_ahead
from hsdp.train.records import DatasetError, read_records, tokenize_record

__all__ = [
    "Batch",
    "TokenDataset",
    "PackedDataset",
    "DatasetError",
    "IGNORE",
    "tokenize_file",
    "split_records",
    "packing_problem",
    "check_packing",
]

IGNORE = -100
"""Label of a token the loss skips (transformers' ``ignore_index``)."""

Encoded = list[tuple[list[int], list[bool]]]


@dataclass
class Batch:
    """One rank's micro-batch: model inputs and labels (``IGNORE`` where not trained)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        """On ``device``, copied without making the host wait (:func:`hsdp.distributed.copy_ahead`), so a batch
        made ahead of its step overlaps the compute before it."""
        move = lambda t: None if t is None else copy_ahead(t, device)  # noqa: E731
        return Batch(
            move(self.input_ids), move(self.labels), move(self.attention_mask), move(self.position_ids)
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward; call it with ``use_cache=False`` too (transformers looks for
        packed records in ``position_ids`` only when no cache is made)."""
        out = {"input_ids": self.input_ids, "labels": self.labels}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids
        return out

    @property
    def targets(self) -> int:
        """Tokens the loss is computed on (labels are shifted: position 0 is never a target)."""
        return int((self.labels[:, 1:] != IGNORE).sum())


def tokenize_file(path: str | Path, tokenizer, text_key: str = "text", flag: str = "--data") -> Encoded:
    return [tokenize_record(r, tokenizer, text_key) for r in read_records(path, flag)]


def split_records(encoded: Encoded, fraction: float, seed: int) -> tuple[Encoded, Encoded]:
    """(train, eval): a seeded random ``fraction`` of the records (at least one) held out for evaluation."""
    if len(encoded) < 2:
        raise DatasetError(
            f"--eval-split {fraction}: the file has {len(encoded)} record(s); a split needs at least 2 (pass a "
            "separate --eval-data file, or a .jsonl with one record per line)"
        )
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(seed)).tolist()
    held = max(1, round(fraction * len(encoded)))
    return [encoded[i] for i in sorted(order[held:])], [encoded[i] for i in sorted(order[:held])]


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why packed records would not be computed as if alone in ``model`` (None when they would): it must take
    ``position_ids`` and run an attention implementation whose mask transformers builds from them (a model with
    its own mask code or another implementation would let records attend to each other)."""
    import inspect

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = type(model).__name__
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return (
            f"--packing: {name} takes no position_ids, so records packed into one row would attend to each other; "
            "use --no-packing"
        )
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        return (
            f"--packing: {name} runs attention with {implementation!r}, for which transformers builds no per-record "
            f"mask from position_ids, so packed records would attend to each other; use --no-packing, or an "
            f"implementation among {', '.join(sorted(ALL_MASK_ATTENTION_FUNCTIONS))}"
        )
    return None


def check_packing(model_dir: Path) -> None:
    """:func:`packing_problem` of the model in ``model_dir`` (built on meta), as a :class:`DatasetError`."""
    from hsdp.loading import build_empty_model, model_class_for

    problem = packing_problem(build_empty_model(model_class_for(model_dir), model_dir, None))
    if problem:
        raise DatasetError(problem)


def _position_ids(segments: torch.Tensor) -> torch.Tensor:
    """Index of each token within its record in its row."""
    index = torch.arange(segments.shape[1]).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


class TokenDataset:
    """Rows of token ids and labels, served as global batches by step.

    ``segments`` gives each token's record index (packed) or -1 for padding (padded rows); None when every row is
    one plain stretch of one document (no mask needed).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        segments: torch.Tensor | None = None,
        *,
        padded: bool = False,
        seed: int = 0,
        source: str = "data",
        source_tokens: int | None = None,
    ):
        self.seq_len = tokens.shape[1]
        # Tokens the records hold; packing keeps only full blocks, so these may be more than the rows hold.
        self.source_tokens = tokens.numel() if source_tokens is None else source_tokens
        self.blocks = tokens.long()
        self.labels = labels.long()
        self.segments = segments
        self.padded = padded
        self.positions = None if segments is None or padded else _position_ids(segments)
        # Every row has the same number of targets (one plain document): the plain mean loss is exact.
        self.uniform = segments is None and bool((self.labels[:, 1:] != IGNORE).all())
        self.seed = seed
        self.source = source
        self._epoch_order: tuple[int, torch.Tensor] = (-1, torch.empty(0, dtype=torch.long))

    @classmethod
    def pack(cls, encoded: Encoded, seq_len: int, *, seed: int = 0, source: str = "data") -> TokenDataset:
        if seq_len < 2:
            raise DatasetError(f"--seq-len={seq_len} must be at least 2 (the model predicts the next token)")
        ids = torch.tensor([t for tokens, _ in encoded for t in tokens], dtype=torch.long)
        trained = torch.tensor([m for _, mask in encoded for m in mask], dtype=torch.bool)
        segment = torch.repeat_interleave(
            torch.arange(len(encoded)), torch.tensor([len(tokens) for tokens, _ in encoded], dtype=torch.long)
        )
        labels = torch.where(trained, ids, IGNORE)
        starts = torch.ones_like(segment, dtype=torch.bool)
        starts[1:] = segment[1:] != segment[:-1]
        labels[starts] = IGNORE  # a record's first token is not predicted from the record before it
        rows = ids.numel() // seq_len
        cut = lambda t: t[: rows * seq_len].view(rows, seq_len)  # noqa: E731
        segments = cut(segment) if len(encoded) > 1 else None
        return cls(cut(ids), cut(labels), segments, seed=seed, source=source, source_tokens=ids.numel())

    @classmethod
    def pad(
        cls, encoded: Encoded, seq_len: int, pad_id: int, *, seed: int = 0, source: str = "data"
    ) -> TokenDataset:
        tokens = torch.full((len(encoded), seq_len), pad_id, dtype=torch.long)
        labels = torch.full_like(tokens, IGNORE)
        segments = torch.full_like(tokens, -1)
        for row, (ids, mask) in enumerate(encoded):
            n = min(len(ids), seq_len)
            tokens[row, :n] = torch.tensor(ids[:n])
            labels[row, :n] = torch.where(torch.tensor(mask[:n], dtype=torch.bool), tokens[row, :n], IGNORE)
            segments[row, :n] = 0
        return cls(tokens, labels, segments, padded=True, seed=seed, source=source)

    @classmethod
    def from_file(
        cls, path: str | Path, tokenizer, seq_len: int, *, seed: int = 0, text_key: str = "text"
    ) -> TokenDataset:
        """A packed dataset of a file (the format of ``hsdp train --data``)."""
        return cls.pack(tokenize_file(path, tokenizer, text_key), seq_len, seed=seed, source=str(path))

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def require(self, rows: int) -> None:
        """Raise a :class:`DatasetError` unless one batch of ``rows`` rows fits and something is trained."""
        if len(self) < rows and self.padded:
            raise DatasetError(
                f"--data {self.source}: {len(self)} records, but one batch needs {rows} rows (--batch-size x "
                "--grad-accum); use more records or a smaller --batch-size"
            )
        if len(self) < rows:
            raise DatasetError(
                f"--data {self.source}: the records hold {self.source_tokens} tokens; packing keeps only full "
                f"blocks of --seq-len {self.seq_len}, which makes {len(self)} block(s), but one batch needs {rows} "
                f"(--batch-size x --grad-accum); use --no-packing (one padded row per record), a --seq-len of at "
                f"most {self.source_tokens // rows}, a smaller --batch-size or more data"
            )
        if not (self.labels[:, 1:] != IGNORE).any():
            raise DatasetError(
                f"--data {self.source}: no token is a training target (every label is masked); check that the "
                "records have completions or assistant turns within --seq-len"
            )

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch_order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch_order = (epoch, torch.randperm(len(self), generator=generator))
        return self._epoch_order[1]

    def _indices(self, start: int, count: int) -> torch.Tensor:
        """Indices of rows ``start .. start + count`` of the endless epoch-by-epoch shuffled stream."""
        n = len(self)
        out = []
        for index in range(start, start + count):
            epoch, offset = divmod(index, n)
            out.append(self._order(epoch)[offset])
        return torch.stack(out)

    def rows(self, start: int, count: int) -> torch.Tensor:
        """Token ids of rows ``start .. start + count`` of the shuffled stream."""
        return self.blocks[self._indices(start, count)]

    def batch_of(self, index: torch.Tensor) -> Batch:
        """The model inputs of rows ``index`` (in storage order, not shuffled)."""
        batch = Batch(self.blocks[index], self.labels[index])
        if self.segments is None:
            return batch
        segments = self.segments[index]
        if self.padded:
            batch.attention_mask = (segments >= 0).long()
            return batch
        batch.position_ids = self.positions[index]
        return batch

    def _start(
        self, step: int, micro: int, batch_size: int, grad_accum: int, dp_rank: int, dp_size: int
    ) -> int:
        if batch_size % dp_size:
            raise DatasetError(
                f"--batch-size={batch_size} must be a multiple of the data-parallel size {dp_size} "
                "(each rank takes an equal share)"
            )
        return (step * grad_accum + micro) * batch_size + dp_rank * (batch_size // dp_size)

    def micro_batch(
        self, step: int, micro: int, *, batch_size: int, grad_accum: int, dp_rank: int, dp_size: int
    ) -> torch.Tensor:
        """Token ids of this data-parallel rank's slice of micro-batch ``micro`` of optimizer step ``step``.

        Step ``s`` consumes global rows ``[s * B * A, (s + 1) * B * A)``; micro-batch ``m`` is the ``m``-th run of
        ``B`` rows, split evenly over the ``dp_size`` ranks. So ``B=2, A=2`` sees the same rows as ``B=4, A=1``.
        """
        start = self._start(step, micro, batch_size, grad_accum, dp_rank, dp_size)
        return self.rows(start, batch_size // dp_size)

    def batch(
        self, step: int, micro: int, *, batch_size: int, grad_accum: int, dp_rank: int, dp_size: int
    ) -> Batch:
        """:meth:`micro_batch` with labels, attention mask and position ids."""
        start = self._start(step, micro, batch_size, grad_accum, dp_rank, dp_size)
        return self.batch_of(self._indices(start, batch_size // dp_size))

    def step_targets(self, step: int, batch_size: int, grad_accum: int) -> int:
        """Targets in all rows of optimizer step ``step`` over all ranks (the loss's denominator)."""
        index = self._indices(step * grad_accum * batch_size, grad_accum * batch_size)
        return int((self.labels[index][:, 1:] != IGNORE).sum())


PackedDataset = TokenDataset  # the name benchmarks and older callers use
