"""A checkpoint's failures agreed on by every rank: which rank failed first and why, so that no rank goes on into a
collective while another has stopped, and DCP's wrapped failure told as the one exception that matters.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from trainer.errors import CheckpointError, Refusal


def root_cause(err: BaseException) -> tuple[Optional[int], BaseException]:
    """The first failing rank and its own exception, for a torch.distributed.checkpoint failure (which wraps every
    failed rank's exception with its traceback: ten lines no one needs); ``(None, err)`` for any other."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return None, err
    rank = min(failures)
    cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    return rank, cause


def agreed_failure(run: Any, attempt: Callable[[], None]) -> Optional[tuple[int, BaseException, bool]]:
    """``attempt()`` on every rank, then on every rank the first failing rank, its failure (this rank's own
    exception where it failed, else a ``CheckpointError`` of the failing rank's words) and whether some rank did
    not fail; None when none failed. No rank goes on into a collective while another has stopped (a file refused
    on one rank only would otherwise hang the job)."""
    mine: Optional[BaseException] = None
    try:
        attempt()
    # torch.distributed.checkpoint's failure is a BaseException, not an Exception.
    except BaseException as err:
        # KeyboardInterrupt, SystemExit: not a failed write or read.
        if not isinstance(err, Exception) and root_cause(err)[0] is None:
            raise
        mine = err
    words = None if mine is None else str(mine) if isinstance(mine, Refusal) else f"{type(mine).__name__}: {mine}"
    said = run.gather(words)
    failing = [rank for rank, text in enumerate(said) if text is not None]
    if not failing:
        return None
    alone = len(failing) < len(said)
    if mine is not None and failing[0] == run.rank:
        return run.rank, mine, alone
    return failing[0], CheckpointError(said[failing[0]]), alone
