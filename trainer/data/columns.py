"""A ``datasets.Dataset`` made ready for the trainer's loaders: the model's input columns, as torch tensors.

A Dataset straight from ``.map(tokenize)`` holds python lists and strings; passed as is, its rows reach the model as
lists (``'list' object has no attribute 'size'`` deep inside it). So, as transformers' Trainer does
(``remove_unused_columns``), the columns that ``model.forward`` does not name are left out (``text``, ``idx``; the
label columns stay), and then:

- without a ``collate_fn``, the rest are formatted as torch tensors, and ``label`` becomes ``labels`` where that is
  what ``forward`` takes. Lists of different lengths cannot be stacked into a batch: they are refused, naming the
  columns and the fix (dynamic padding through ``collate_fn``, or ``padding="max_length"``);
- with a ``collate_fn`` (``DataCollatorWithPadding`` pads, and renames ``label`` itself) the rows stay python.

Only an unformatted Dataset is touched. One already formatted (``with_format("torch", columns=[...])``, numpy...)
is the user's choice and used as is: the way to keep a column that a ``loss_fn`` reads but ``forward`` does not.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from trainer.errors import DataError
from trainer.hf import forward_inputs, is_dataset

LABEL_COLUMNS = ("label", "labels", "label_ids")


def ready_columns(data: Any, model: torch.nn.Module, collate: bool, *, name: str) -> tuple[Any, Optional[str]]:
    """``data`` ready for a DataLoader, and a line saying what changed (None when nothing did).

    Args:
        collate: the user gave a ``collate_fn``, which batches the rows itself.
        name: how the user passed ``data`` (``train_data``), for the messages.
    """
    if not is_dataset(data) or data.format["type"] is not None:
        return data, None
    columns = list(data.format["columns"])
    inputs = forward_inputs(model)
    kept = [c for c in columns if inputs is None or c in inputs or c in LABEL_COLUMNS]
    dropped = [c for c in columns if c not in kept]
    changes = [f"left out {', '.join(dropped)} (not inputs of model.forward)"] if dropped else []
    if collate:
        data = data.with_format(None, columns=kept)
        return data, (f"{name}: {'; '.join(changes)}" if changes else None)

    ragged = [c for c in kept if _lengths_differ(data, c)]
    if ragged:
        raise DataError(
            f"{name}: column(s) {', '.join(ragged)} hold lists of different lengths, which cannot be stacked into a "
            "batch. Pad them per batch: Trainer(..., collate_fn=DataCollatorWithPadding(tokenizer)) (from "
            "transformers), or tokenize with padding='max_length', truncation=True"
        )
    if inputs is not None and "label" in kept and "labels" in inputs and "label" not in inputs and "labels" not in kept:
        data = data.rename_column("label", "labels")
        kept[kept.index("label")] = "labels"
        changes.append("label renamed labels")
    changes.insert(0, f"{', '.join(kept)} as torch tensors")
    return data.with_format("torch", columns=kept), f"{name} (a datasets.Dataset): {'; '.join(changes)}"


def _lengths_differ(data: Any, column: str) -> bool:
    """Whether a list column's rows differ in length (read from the arrow lengths, no row is decoded)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = data.data.column(column)
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)) or len(values) == 0:
        return False
    lengths = pc.min_max(pc.list_value_length(values)).as_py()
    return lengths["min"] != lengths["max"]
