"""What a job prints: each library warning once per job, and a progress bar that no line of output breaks into.

Every process of a job runs the same code, so a library warning (transformers' ``loss_type=None ...``) comes once
per process, and one issued per save (accelerate's ``Removed shared tensor``) once per checkpoint. So: the
libraries' log records below ERROR are left to the main process (errors still come from every rank), and each
distinct record prints once per process. transformers' own progress bars are off when the output is not a terminal
(in a log file they are lines of carriage returns).

In a terminal the main process draws a progress bar on stderr; anything else written meanwhile (our step lines, a
user's ``print``, a library's warning) would land in the middle of it. While the bar is up, stdout and stderr
(and the logging handlers that hold them) go through a writer that collects whole lines, clears the bar, writes
them, and redraws it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Iterator, Optional, TextIO

from tqdm.auto import tqdm

LIBRARIES = ("transformers", "accelerate", "datasets", "torch")
_quieted = False


class OncePerProcess(logging.Filter):
    """Lets each distinct (logger, level, message) through once."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def quiet_library_logs(process_index: int) -> None:
    """Library warnings once per job: below ERROR from the main process only, each distinct one once."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    once = OncePerProcess()
    logging.lastResort.addFilter(once)  # where accelerate's records go when nobody configured logging
    if process_index != 0:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers sets up its logger
        for library in LIBRARIES:
            logging.getLogger(library).setLevel(logging.ERROR)
    if "transformers" in sys.modules:  # its handler exists already; importing it here would cost half a second
        from transformers.utils import logging as hf_logging

        if process_index != 0:
            hf_logging.set_verbosity_error()
        for handler in hf_logging.get_logger().handlers:  # the library's root logger and its own handler
            handler.addFilter(once)


@contextlib.contextmanager
def no_library_progress_bars_off_a_terminal() -> Iterator[None]:
    """transformers' progress bars (save_pretrained's "Writing model shards") off, when the output is a log file
    rather than a terminal."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if was_on and not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


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

    def __getattr__(self, name: str):  # isatty, fileno, encoding...: the real stream's
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
