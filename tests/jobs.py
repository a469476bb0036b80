"""Several runs of a job script in one process: ``python tests/jobs.py '[[SCRIPT, ARG, ...], ...]'``.

Each run is what ``python SCRIPT ARG ...`` does (the script run as ``__main__``), one after another. The point is
the start-up: importing torch, accelerate and torch's compiler (which torch's optimizers import) costs about 4 s of
CPU a process, most of a small test job, so tests that need many small jobs run them here in one process (or, under
``accelerate launch`` / torchrun, in one launch: every process runs the same list in the same order, so each run is
one job of all the processes, as the Trainer's jobs are when a script builds several).

Before each run ``=== job N ===`` goes to stdout and stderr, once every process has finished the run before (a
barrier), and ``split_jobs()`` (tests/conftest.py) cuts the output there. For runs that should succeed: the first that fails ends the process with its error, as it would alone.
"""

from __future__ import annotations

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
        raise RuntimeError("tests/jobs.py: the process group is gone after a run; the runs' output cannot be cut")


def main() -> None:
    for number, (script, *args) in enumerate(json.loads(sys.argv[1])):
        if number:
            finished_together()
        for stream in (sys.stdout, sys.stderr):
            stream.write(f"=== job {number} ===\n")
            stream.flush()
        sys.argv = [script, *map(str, args)]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:  # argparse's --help, or a script's sys.exit(0)
            if stop.code not in (None, 0):
                raise


if __name__ == "__main__":
    main()
