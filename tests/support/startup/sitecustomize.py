"""What every Python process a test starts runs first: tests/conftest.py's ``clean_env()`` puts this folder on
PYTHONPATH. It spares each process the garbage collections of its start-up and of its end, about a second of CPU
in a process that imports torch (most of the suite's CPU is processes starting), and writes its output in whole lines.

**Start-up.** While the main module runs its import statements (and, under ``python -m``, while runpy imports the
module's packages), the cyclic collector is off: importing torch, accelerate and transformers makes some 400,000
long-lived objects, and the collector walked them over and over as they came (0.6 s a process). At the first import
made inside the main module's code rather than by one of its import statements (a lazy import: the job has begun),
what exists is frozen (``gc.freeze()``: never walked again, so the job's own collections are as cheap as
they would be in a process without those modules) and the collector is on again for the job, as Python runs it. The
import-time garbage frozen with it (reference cycles the imports left, about 8 MB) is never freed; the objects the
job had made by then are kept until the process ends, unless it unfreezes them (tests/jobs/run_many.py does, between
its runs, so that a failed run's Trainer and output_dir lock go as they would with its process).

**End.** ``gc.freeze()`` runs after every other atexit handler (it is registered first, and they run last in, first
out), so the collections that tear the interpreter down find nothing to walk (0.8 s of CPU a process). By then the
job's own code and atexit handlers (wandb's, torch's) have finished, written and closed what they own, and the exit
status is set; only objects caught in reference cycles go unfinalized, as the kernel reclaims the process.

**Output.** Standard output is line-buffered: each line is written whole as soon as it ends. Unbuffered
(PYTHONUNBUFFERED), ``print()`` writes its text and its newline apart, and two ranks sharing a launcher's stdout
could run their lines together ("...}REDUCED {..."): a test then misreads both.

With ``FAKE_GPUS`` set, torch.cuda also reports that many GPUs (fake_gpu.py, ``pretend_gpus()``).
"""

import _thread
import atexit
import dis
import gc
import os
import sys

_IMPORT_NAME = dis.opmap["IMPORT_NAME"]
_MAIN_THREAD = _thread.get_ident()
_held = True  # the collector is off because this module turned it off
_begun = False  # the main module's code has run an import of its own


def _main_module_importing() -> bool | None:
    """Whether the main module is running an import statement; None before it begins (runpy importing its
    packages) and after it ends."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return frame.f_code.co_code[frame.f_lasti] == _IMPORT_NAME
        frame = frame.f_back
    return None


def _on_import(event: str, args: tuple) -> None:
    """An audit hook: Python raises ``import`` before it loads a module not yet in ``sys.modules``."""
    global _held, _begun
    if event != "import" or _thread.get_ident() != _MAIN_THREAD:
        return
    importing = _main_module_importing()
    if importing is False and _held:
        _held, _begun = False, True
        gc.freeze()
        gc.enable()
    elif (importing or (importing is None and not _begun)) and gc.isenabled():
        gc.disable()  # a later main module starts up (tests/jobs/run_many.py runs one after another)
        _held = True


if hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
gc.disable()
sys.addaudithook(_on_import)
atexit.register(gc.freeze)

if "FAKE_GPUS" in os.environ:
    import fake_gpu  # noqa: F401
