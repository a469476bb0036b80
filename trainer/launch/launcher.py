"""``python -m trainer.launch``: ``accelerate launch`` with the same arguments, ending as the trainer promises.

    python -m trainer.launch --config_file accelerate_configs/multi_gpu.yaml examples/gpt2.py

``accelerate launch`` (and torchrun beneath it) ends a job whose process failed with its own 20-35-line traceback
(``ChildFailedError``; ``SignalException`` when the launcher itself is signalled) and status 1, whatever the
processes chose: a refusal's one line is lost among them, and a preemption's status 75 ("try again") is lost to the
scheduler. This launcher runs accelerate's own launch in this process and ends with what the processes said: a
refusal's line and status, a preemption's 75, a process killed by a signal named in one line
(docs/launching.md#how-a-job-ends).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from typing import Optional

from trainer.errors import PREEMPTED_EXIT


def status_of(failures: dict) -> tuple[int, list[str]]:
    """The job's exit status from torch's failures of its processes (rank -> ``ProcessFailure``, in the order they
    came), and what to add: a status a process chose (75 for a preemption, wherever one chose it; a refusal's 1,
    said by the process), else a line for each process a signal killed before it could say why (the OOM killer)."""
    chosen = [failure.exitcode for failure in failures.values() if failure.exitcode > 0]
    if chosen:
        return (PREEMPTED_EXIT if PREEMPTED_EXIT in chosen else chosen[0]), []
    lines = []
    for rank, failure in sorted(failures.items()):
        number = -failure.exitcode
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
        lines.append(f"trainer: rank {rank} (pid {failure.pid}) was killed by {name} before it could say why")
    return 128 - next(iter(failures.values())).exitcode, lines


def main(argv: Optional[list[str]] = None) -> int:
    import torch.distributed.run  # noqa: F401  (its loggers, made at import)
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    # The agent's own account of each failure ("failed (exitcode: 1) local_rank: ..."), each logger's level set by
    # torch: the processes said theirs.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        launch_command(args)
    except ChildFailedError as err:
        first = err.get_first_failure()[0]
        status, lines = status_of({first: err.failures[first], **err.failures})
    # The launcher itself was signalled (Slurm, Kubernetes): it passed the signal on, and each process wrote its
    # preemption checkpoint within preemption_grace_s, or said why not.
    except SignalException as err:
        said = f"trainer: the launcher received {signal.Signals(err.sigval).name}, and passed it to the job's processes"
        status, lines = PREEMPTED_EXIT, [f"{said}: start the job again with resume='auto' to continue"]
    # One process, started by accelerate's simple launcher.
    except subprocess.CalledProcessError as err:
        code = err.returncode
        status, lines = (128 - code if code < 0 else code), []
    else:
        return 0
    for line in lines:
        sys.stderr.write(line + "\n")
    return status
