"""The preflight inside a real launch (``accelerate launch ... -m trainer.check``): every rank joins the job and
reports its host, local rank and device; then whether the world came out as configured, every rank can be reached,
``output_dir`` is one filesystem shared by all nodes, and each node can reach wandb (docs/clusters.md).
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Optional

Problems = list[str]


def check_launch(
    output_dir: Optional[str],
    expected_processes: Optional[int],
    timeout_s: float,
    *,
    uses_wandb: bool = False,
    storage: Optional[str] = None,
) -> Problems:
    """Run on every rank of a launched job; return the problems (the same list on every rank). wandb is asked
    only of a job that uses it: one that does not should not fail its preflight over a missing API key. With a
    ``storage`` bucket (checkpoint_storage), every rank must write there, and output_dir need not be shared."""
    from accelerate.utils import broadcast_object_list, gather_object

    from trainer.launch.host import launched_world_size
    from trainer.launch.run import distributed_state

    state = distributed_state(collective_timeout_s=timeout_s)
    rank, world = state.process_index, state.num_processes
    me = {
        "rank": rank,
        "local_rank": state.local_process_index,
        "host": socket.gethostname(),
        "device": str(state.device),
    }
    problems: Problems = []
    if world != launched_world_size():
        problems.append(
            f"rank {rank} joined a world of {world}, but the launcher said WORLD_SIZE={launched_world_size()}"
        )
    if expected_processes is not None and world != expected_processes:
        problems.append(f"the job has {world} processes, the config asks for {expected_processes}")
    if output_dir:
        token = [secrets.token_hex(4) if state.is_main_process else None]
        if world > 1:
            broadcast_object_list(token)
        me["sees"], me["cannot_write"] = _probe_shared(Path(output_dir), token[0], rank=rank, state=state)
    me["wandb"] = _wandb_problem() if uses_wandb and state.local_process_index == 0 else None
    me["bucket"] = _bucket_problem(storage) if storage else None
    # Every rank answering is the reachability check.
    everyone = gather_object([me]) if world > 1 else [me]
    if state.is_main_process:
        for other in everyone:
            print(f"rank {other['rank']:>3} | local rank {other['local_rank']} | {other['host']} | {other['device']}")
    hosts = sorted({other["host"] for other in everyone})
    if output_dir:
        unwritable = [o for o in everyone if o["cannot_write"]]
        for other in unwritable:
            problems.append(
                f"output_dir {output_dir} is not writable from rank {other['rank']} ({other['host']}): "
                f"{other['cannot_write']}"
            )
        blind = [o for o in everyone if o["sees"] < world and not unwritable and not storage]
        for other in blind:
            problems.append(
                f"output_dir {output_dir} is not one shared filesystem: rank {other['rank']} "
                f"({other['host']}) sees {other['sees']} of the {world} ranks' files. Checkpoints are "
                "written by one process and read by every rank: use a path all nodes share"
            )
        if not blind and not unwritable and state.is_main_process:
            print(f"output_dir {output_dir}: one filesystem, shared by all {len(hosts)} host(s)")
    problems += [f"{o['host']}: wandb: {o['wandb']}" for o in everyone if o["wandb"]]
    problems += [f"rank {o['rank']} ({o['host']}): {o['bucket']}" for o in everyone if o["bucket"]]
    if storage and not any(o["bucket"] for o in everyone) and state.is_main_process:
        print(f"checkpoint_storage {storage}: every rank can write there")
    if state.is_main_process:
        print(f"job: {world} process(es) on {len(hosts)} host(s), every rank answered")
    return problems


def _probe_shared(output_dir: Path, token: str, rank: int, *, state) -> tuple[int, Optional[str]]:
    """Each rank writes a file into ``output_dir``; how many ranks' files can this rank see, and why this rank
    could not write its own (None when it could). Every rank meets every barrier, whatever failed."""
    probe = output_dir / f".trainer-check-{token}"
    try:
        probe.mkdir(parents=True, exist_ok=True)
        (probe / f"rank{rank}").write_text(socket.gethostname())
        failed = None
    except OSError as err:
        failed = f"{type(err).__name__}: {err.strerror or err}"
    state.wait_for_everyone()
    seen = len(list(probe.glob("rank*"))) if probe.is_dir() else 0
    state.wait_for_everyone()
    if failed is None:
        (probe / f"rank{rank}").unlink()
    state.wait_for_everyone()
    try:
        # One rank per filesystem succeeds.
        probe.rmdir()
    except OSError:
        pass
    return seen, failed


def _bucket_problem(storage: str) -> Optional[str]:
    """None when this rank can write to the bucket, else why not (credentials, the endpoint, no such bucket)."""
    from trainer.checkpoint.bucket import Bucket
    from trainer.errors import Refusal

    try:
        Bucket.checked(storage)
    except Refusal as err:
        return str(err)
    return None


def _wandb_problem() -> Optional[str]:
    """None when wandb is reachable (or switched off on purpose), else what goes wrong."""
    mode = os.environ.get("WANDB_MODE", "")
    if mode in ("offline", "disabled", "dryrun"):
        return None
    try:
        import wandb

        wandb.Api(timeout=15).viewer  # noqa: B018 - asks the server who we are
    except Exception as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"unreachable ({first_line}); runs would log offline (WANDB_MODE=offline to silence this)"
    return None
