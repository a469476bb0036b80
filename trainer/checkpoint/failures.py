"""A checkpoint's failures agreed on by every rank: which rank failed first and why, so that no rank goes on into a
collective while another has stopped, DCP's wrapped failure told as the one exception that matters, and a part's
failed read said in one line naming the checkpoint.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

from trainer.checkpoint.safe_dcp import refused_pickle
from trainer.errors import CheckpointError, Refusal

if TYPE_CHECKING:
    from trainer.launch.run import Run


def root_cause(err: BaseException) -> tuple[Optional[int], BaseException]:
    """The first failing rank and its own exception, for a torch.distributed.checkpoint failure (which wraps every
    failed rank's exception with its traceback: ten lines no one needs); ``(None, err)`` for any other."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return None, err
    rank = min(failures)
    cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    return rank, cause


class Failure(NamedTuple):
    """A failure every rank agreed on: the first failing rank, its error, and whether some rank did not fail."""

    rank: int
    error: BaseException
    alone: bool


def agreed_failure(run: Run, attempt: Callable[[], None]) -> Optional[Failure]:
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
        return Failure(run.rank, mine, alone)
    return Failure(failing[0], CheckpointError(said[failing[0]]), alone)


def read_part(path: Path, attempt: Callable[[], None], *, refused: Optional[CheckpointError]) -> None:
    """``attempt()``, a part's read, its failure said as one line naming the checkpoint."""
    try:
        attempt()
    # torch.load(weights_only=True) refused it, or it ends early.
    except (pickle.UnpicklingError, EOFError) as err:
        detail = refused_pickle(err)
        raise CheckpointError(
            f"checkpoint {path} holds a file that cannot be loaded safely (nothing in it was "
            f"run): {type(err).__name__}: {detail}. Resume from another checkpoint "
            f"(resume=<path>), or delete this one"
        ) from None
    except (RuntimeError, LookupError, ValueError, OSError) as err:
        if isinstance(err, Refusal):
            raise
        # A part that does not load for the reason the refusal names (the schedule of another optimizer).
        if refused is not None:
            raise refused from err
        # torch's size-mismatch report spans many lines.
        detail = " ".join(str(err).split())[:2000]
        raise CheckpointError(f"checkpoint {path} does not fit this run: {detail}") from err
    # A callback's own load_state_dict, say: one line all the same.
    except Exception as err:
        if isinstance(err, Refusal):
            raise
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(err).__name__}: {err}") from err
