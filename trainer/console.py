"""What a job prints: a line from the main process (``say``) or any rank (``warn``), the banner, the step line,
each library warning once per job, and a progress bar no line breaks into (docs/internals.md#the-console).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Optional, TextIO

from tqdm.auto import tqdm

if TYPE_CHECKING:
    from trainer.parallel.strategy import Described

LIBRARIES = ("transformers", "accelerate", "datasets", "torch")
# What the libraries say to one another, nothing a user's code can change: transformers falling back to its one
# causal-LM loss for a model class its loss table does not name (GPT2LMHeadModel), as it would anyway.
NOT_FOR_USERS = ("`loss_type=None` was set in the config but it is unrecognized",)
# PEFT reading a property transformers renamed, once on every rank (PeftModel's own __init__).
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


class _Unactionable(logging.Filter):
    """Drops a logger's records that start with one of ``openings``."""

    def __init__(self, *openings: str):
        super().__init__()
        self.openings = openings

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.openings)


# Said at import by torchao (which transformers imports with any model class), once per rank: its kernels built for
# another Python or GPU failing to load (the trainer's fp8 uses none of them), and torch deprecating a call torchao
# makes. Filtered on their loggers, so only where trainer is imported before transformers.
logging.getLogger("torchao").addFilter(_Unactionable("Failed to load "))
logging.getLogger("torch.utils._pytree").addFilter(_Unactionable("<enum "))
# The rest: a callback's.
STEP_FIGURES = ("step", "epoch", "train_loss", "lr", "examples_per_s", "tokens_per_s", "mfu")
# This process's place in the job, set once it has joined.
_process = {"main": True, "quieted": False}
# Lines said once per process.
_said_once: set[str] = set()


def say(text: str, once: bool = False) -> None:
    """A line from the main process, as one write (print() writes the newline apart, and other ranks' lines could
    land between); while the progress bar is up it goes around it. ``once``: once per process, however many
    Trainers it builds."""
    if _process["main"] and not (once and text in _said_once):
        _said_once.add(text)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def warn(text: str, main_only: bool = False) -> None:
    """``trainer: <text>`` on stderr, from whichever rank calls it (``main_only``: the main process alone, for what
    every rank meets alike)."""
    if main_only and not _process["main"]:
        return
    sys.stderr.write(f"trainer: {text}\n")
    sys.stderr.flush()


class OncePerProcess(logging.Filter):
    """Lets each distinct (logger, level, message) through once, and none of NOT_FOR_USERS."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen or key[2].startswith(NOT_FOR_USERS):
            return False
        self.seen.add(key)
        return True


def joined(process_index: int) -> None:
    """This process joined the job as ``process_index``: ``say`` speaks from process 0 alone, and library
    warnings come once per job (below ERROR from the main process only, each distinct one once)."""
    _process["main"] = process_index == 0
    if _process["quieted"]:
        return
    _process["quieted"] = True
    once = OncePerProcess()
    # Where accelerate's records go when nobody configured logging.
    logging.lastResort.addFilter(once)
    if process_index != 0:
        # Read when transformers sets up its logger.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        for library in LIBRARIES:
            logging.getLogger(library).setLevel(logging.ERROR)
    # Its handler exists already; importing it here would cost half a second.
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        if process_index != 0:
            hf_logging.set_verbosity_error()
        # The library's root logger and its own handler.
        for handler in hf_logging.get_logger().handlers:
            handler.addFilter(once)


def step_line(metrics: dict[str, Any], total_steps: int) -> str:
    """``step 300/300 | loss 4.746 | lr 0.0002 | 53.4 examples/s | 6,834 tokens/s``, then any figure logged with
    ``trainer.log`` or added to ``metrics`` in ``on_log``; ``| MFU 41.5%`` where it is known
    (``trainer.telemetry.mfu``); ``grad_norm`` is in the logs only."""
    line = (
        f"step {metrics['step']}/{total_steps} | loss {metrics['train_loss']:.6g} | lr {metrics['lr']:.4g} | "
        f"{metrics['examples_per_s']:.1f} examples/s"
    )
    if "tokens_per_s" in metrics:
        line += f" | {metrics['tokens_per_s']:,.0f} tokens/s"
    # Model FLOPs utilisation (trainer.mfu), a fraction.
    if "mfu" in metrics:
        line += f" | MFU {100 * metrics['mfu']:.1f}%"
    for key, value in metrics.items():
        # Logged, not said: the line stays short.
        if key not in STEP_FIGURES and key != "grad_norm":
            line += f" | {key} {value:.4g}" if isinstance(value, float) else f" | {key} {value}"
    return line


def banner(
    launch: Described,
    config: Any,
    state: Any,
    *,
    total_steps: int,
    share: Optional[int],
    weighs: bool,
    words: str,
    callbacks: Any = (),
) -> str:
    """What a run is about to do, said once at the start of ``fit()``: the launch and what sharding did
    (``Strategy.describe``), the global batch and how its loss is weighed (``share``: the examples a process
    reads per epoch; fewer than a step takes, each step takes them all), the steps, the optimizer and schedule
    (``words``), and what else changes what the run ends with (``what_else``); or that there is nothing to train."""
    batch, accumulation = config.batch_size, config.gradient_accumulation_steps
    processes, reader = launch.readers, launch.reader
    global_batch, short = batch * processes * accumulation, ""
    if share is not None and share < batch * accumulation:
        global_batch = share * processes
        short = (
            f"an epoch has {share} examples per process in {state.batches_per_epoch} batch(es), fewer than "
            f"batch x accumulation: each step takes them all, {global_batch} global"
        )
    chunks = f", computed {config.loss_chunk_tokens} tokens at a time (chunked_loss)" if config.chunked_loss else ""
    weighs = f"; the loss weighs every counted token alike{chunks}" if weighs else ""
    until = f"max_steps={config.max_steps}" if config.max_steps else f"{config.epochs} epochs"
    readers = "processes" if reader == "process" else f"{reader.split(' of ')[0]}s"
    lines = (
        launch.launch,
        launch.placed,
        f"batch {batch} per {reader} x {processes} {readers} x {accumulation} accumulation "
        f"= {global_batch} global{weighs}",
        short,
        f"{state.steps_per_epoch or 'unknown'} optimizer steps per epoch, {total_steps} in all ({until}); {words}",
        what_else(config, callbacks),
        state.step >= total_steps
        and f"already finished at step {state.step} of {total_steps}: nothing to train; raise max_steps (or epochs)",
    )
    return "trainer | " + "\n        | ".join(line for line in lines if line)


def what_else(config: Any, callbacks: Any) -> str:
    """The banner's words for what makes final/ differ from the last step's weights, or the run end early:
    an average of the weights, keep_best, spike rollbacks, early stopping ('' when none is on)."""
    said = []
    if config.ema_decay is not None:
        start = f" from step {config.ema_start_step}" if config.ema_start_step else ""
        uses = " and ".join(use for use, on in (("evaluations", config.ema_eval), ("final/", config.ema_final)) if on)
        uses = uses or "neither evaluations nor final/"
        said.append(f"EMA of the weights (decay {config.ema_decay:g}{start}) in {uses}")
    if config.keep_best:
        ends = "; final/ holds that checkpoint's weights" if config.load_best_at_end is not False else ""
        said.append(f"keep_best {config.keep_best} ({config.keep_best_mode}){ends}")
    if config.spike_policy:
        lowered = f", the lr x {config.spike_lr_factor:g} each time" if config.spike_lr_factor else ""
        said.append(f"a loss over {config.spike_threshold:g} x the last 10 steps' mean rolled back{lowered}")
    # EarlyStopping, or any callback that watches a figure with a patience.
    for callback in callbacks:
        if isinstance(getattr(callback, "monitor", None), str) and hasattr(callback, "patience"):
            said.append(f"early stopping on {callback.monitor} (patience {callback.patience} evaluations)")
    return "; ".join(said)


class AroundTheBar:
    """A text stream that writes whole lines only, each time clearing the bar first and redrawing it after."""

    def __init__(self, stream: TextIO, bar: tqdm):
        self.stream, self.bar = stream, bar
        self.pending = ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.pending += text
            if "\n" in self.pending:
                lines, _, self.pending = self.pending.rpartition("\n")
                self._write_clear_of_the_bar(lines + "\n")
        return len(text)

    def flush(self) -> None:
        with self.lock:
            if self.pending:
                self._write_clear_of_the_bar(self.pending)
                self.pending = ""
        self.stream.flush()

    def _write_clear_of_the_bar(self, text: str) -> None:
        with tqdm.get_lock():
            self.bar.clear(nolock=True)
            self.stream.write(text)
            self.stream.flush()
            self.bar.refresh(nolock=True)

    # Isatty, fileno, encoding...: the real stream's.
    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def progress_bar(total: int, initial: int, show: Optional[bool]) -> Iterator[tqdm]:
    """A tqdm bar (``show=None``: only on a terminal); while it is drawn, every line written goes around it."""
    bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, disable=None if show else True)
    if bar.disable:
        try:
            yield bar
        finally:
            bar.close()
        return
    real = {"stdout": sys.stdout, "stderr": sys.stderr}
    safe = {name: AroundTheBar(stream, bar) for name, stream in real.items()}
    handlers = [h for h in _stream_handlers() if h.stream in real.values()]
    held = [(h, h.stream) for h in handlers]
    sys.stdout, sys.stderr = safe["stdout"], safe["stderr"]
    for handler, stream in held:
        handler.setStream(safe["stdout"] if stream is real["stdout"] else safe["stderr"])
    try:
        yield bar
    finally:
        for stream in safe.values():
            stream.flush()
        sys.stdout, sys.stderr = real["stdout"], real["stderr"]
        for handler, stream in held:
            handler.setStream(stream)
        bar.close()


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in LIBRARIES]
    return [h for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler]
