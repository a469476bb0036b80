"""Several runs of a job script in one process: ``python tests/jobs.py '[[SCRIPT, ARG, ...], ...]'``.

Each run is what ``python SCRIPT ARG ...`` does (the script run as ``__main__``), one after another. The point is
the start-up: importing torch, accelerate and torch's compiler (which torch's optimizers import) costs about 4 s of
CPU a process, most of a small test job, so tests that need many small jobs run them here in one process (or, under
``accelerate launch`` / torchrun, in one launch: every process runs the same list in the same order, so each run is
one job of all the processes, as the Trainer's jobs are when a script builds several).

Before each run ``=== job N ===`` goes to stdout and stderr; ``split_jobs()`` (tests/conftest.py) cuts the output
there. For runs that should succeed: the first that fails ends the process with its error, as it would alone.
"""

from __future__ import annotations

import json
import runpy
import sys


def main() -> None:
    for number, (script, *args) in enumerate(json.loads(sys.argv[1])):
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
