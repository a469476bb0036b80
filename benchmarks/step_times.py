"""What the step-time benchmarks share: a GPT-2 of 5.3M parameters (4 layers, width 256, vocab 8192) on random
128-token rows, and a callback noting when each optimizer step ends."""

from __future__ import annotations

import statistics
import time


def small_gpt2(rows: int) -> tuple:
    """The model (seed 0) and ``rows`` training examples of 128 tokens."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=128, n_embd=256, n_layer=4, n_head=4))
    ids = torch.randint(0, 8192, (rows, 128))
    return model, [{"input_ids": row, "labels": row} for row in ids]


class StepEnds:
    """A callback: the time each optimizer step ends; ``median(warmup)``: the median step after ``warmup`` steps."""

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, trainer) -> None:
        self.ends.append(time.perf_counter())

    def median(self, warmup: int) -> float:
        timed = self.ends[warmup:]
        return statistics.median(b - a for a, b in zip(timed[:-1], timed[1:], strict=True))
