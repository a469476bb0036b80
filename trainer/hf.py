"""What the trainer asks of Hugging Face objects (transformers models, datasets), without importing either library
until one is in hand: a job that uses neither never pays for their imports (about a second each)."""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Callable, Iterator, Optional

import torch


def is_transformers_model(model: torch.nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (or a subclass of one)."""
    return any(cls.__module__.split(".")[0] == "transformers" for cls in type(model).__mro__)


def peft_model(model: torch.nn.Module) -> bool:
    """A PEFT model (``get_peft_model``: LoRA and the like): a transformers model inside, which computes the loss."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def loss_owner(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The transformers model whose ``loss_function`` computes ``model``'s own loss (a PEFT model's base model), or
    None for a model of another kind."""
    owner = model.get_base_model() if peft_model(model) else model
    return owner if is_transformers_model(owner) and hasattr(type(owner), "loss_function") else None


def is_dataset(data: Any) -> bool:
    """A ``datasets.Dataset`` (map-style, arrow-backed)."""
    return type(data).__module__.startswith("datasets.") and type(data).__name__ == "Dataset"


def is_stream(data: Any) -> bool:
    """A ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``)."""
    return type(data).__module__.startswith("datasets.") and type(data).__name__ == "IterableDataset"


def generates(model: torch.nn.Module) -> bool:
    """A transformers language model (causal or sequence-to-sequence), whose loss is a per-token cross-entropy."""
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate and can_generate())


def causal_lm(model: torch.nn.Module) -> bool:
    """A decoder-only language model: its loss shifts the labels, so each row's first label is never a target."""
    return generates(model) and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether forward takes ``num_items_in_batch`` (transformers' own rule: the class says, else ``**kwargs``)."""
    said = getattr(model, "accepts_loss_kwargs", None)
    if said is not None:
        return bool(said)
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def forward_inputs(model: torch.nn.Module) -> Optional[set[str]]:
    """The argument names ``model.forward`` takes by name; None when it names none (``forward(*args, **kwargs)``)."""
    parameters = inspect.signature(model.forward).parameters.values()
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named or None


class LossFunctionProbe:
    """Stands in for a transformers model's ``loss_function`` and notes whether forward passed it
    ``num_items_in_batch``: only then is the returned loss sum / count rather than a mean. One attribute write per
    forward, and it stays in place (removing it would make a compiled model compile again)."""

    def __init__(self, loss_function: Callable):
        self.loss_function = loss_function
        self.passed = False

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("num_items_in_batch") is not None:
            self.passed = True
        return self.loss_function(*args, **kwargs)

    @classmethod
    def install(cls, model: torch.nn.Module) -> "LossFunctionProbe":
        # A PEFT wrapper only forwards the call.
        owner = loss_owner(model) or model
        current = owner.loss_function
        if not isinstance(current, cls):
            # Transformers' setter: the model's for the rest of its life.
            current = owner.loss_function = cls(current)
        return current


@contextlib.contextmanager
def no_progress_bars_off_a_terminal() -> Iterator[None]:
    """transformers' progress bars (datasets' and tokenizers' loading, "Writing model shards") off while the output
    is a log file rather than a terminal (in a file they are lines of carriage returns)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if was_on and not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
