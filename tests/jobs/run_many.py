"""Several runs of a job script in one process: ``python tests/jobs/run_many.py '[[SCRIPT, ARG, ...], ...]'``.

Each run is what ``python SCRIPT ARG ...`` does (the script run as ``__main__``), one after another. The point is
the start-up: importing torch, accelerate and torch's compiler (which torch's optimizers import) costs about 4 s of
CPU a process, most of a small test job, so tests that need many small jobs run them here in one process (or, under
``accelerate launch`` / torchrun, in one launch: every process runs the same list in the same order, so each run is
one job of all the processes, as the Trainer's jobs are when a script builds several).

Before each run ``=== job N ===`` goes to stdout and stderr, once every process has finished the run before (a
barrier), and ``split_jobs()`` (tests/conftest.py) cuts the output there. A run that raises ends as it would
alone: the interpreter's ``sys.excepthook`` prints it (the trainer's one ``trainer:`` line for a refusal, else the
traceback). Each run's end, ``=== job N exit 0 ===`` (1 for a raise, or a ``SystemExit``'s status), goes to stderr,
read by ``job_exits()`` (a run begun with no such line ended the process), and the next run starts. The process
exits 1 when any run failed. Runs that fail must fail alike on every process (a refusal, or an error every rank
meets at the same place), as they do when run alone.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys


def finished_together() -> None:
    """Under a launch, every process finishes run N (its last lines written) before any writes run N+1's line."""
    import torch.distributed as dist

    sys.stdout.flush(), sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    elif "RANK" in os.environ:
        raise RuntimeError(
            "tests/jobs/run_many.py: the process group is gone after a run; the runs' output cannot be cut"
        )


def run(script: str, args: list[str]) -> int:
    """``python script args``, here: its exit status."""
    sys.argv = [script, *map(str, args)]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:  # argparse's --help, a script's sys.exit(...), a launch the trainer refuses
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except Exception as err:  # what the interpreter would do with it, uncaught
        sys.excepthook(type(err), err, err.__traceback__)
        return 1
    return 0


def main() -> None:
    failed = False
    for number, (script, *args) in enumerate(json.loads(sys.argv[1])):
        if number:
            finished_together()
        for stream in (sys.stdout, sys.stderr):
            stream.write(f"=== job {number} ===\n")
            stream.flush()
        status = run(script, args)
        # What a failed run held (its Trainer, the output_dir's lock) goes, as its process would; frozen objects too
        # (tests/support/startup/sitecustomize.py freezes what exists when a job begins), and what is left, frozen.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        sys.stderr.write(f"=== job {number} exit {status} ===\n")
        sys.stderr.flush()
        failed = failed or bool(status)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
