"""An unformatted ``datasets.Dataset`` readied as transformers' Trainer readies one: the model's input columns as
tensors, the rest dropped, said once (docs/internals.md#columns).
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
