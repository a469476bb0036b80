"""Naming the rank a stalled job waits for (trainer/telemetry/stall.py's report), in-process;
tests/launch/test_cluster.py stalls a real rank of a 2-process job and reads the line the others print."""

from __future__ import annotations

from trainer.telemetry.stall import report, speaker


def note(step: int, phase: str, since: float, host: str = "node-a", blocks: int = 0) -> dict:
    return {"step": step, "phase": phase, "host": host, "since": since, "blocks": blocks}


def test_the_rank_furthest_behind_in_the_step_is_the_one_waited_for():
    notes = {0: note(7, "backward", 70.0), 1: note(7, "forward", 69.0, "node-b"), 2: note(7, "backward", 70.0)}
    line = report(notes, 3, now=100.0, stalled_s=30)
    assert line.startswith(
        "stalled for 30 s: rank 0 (node-a) backward at step 7 since 30 s, rank 1 (node-b) forward at step 7 since 31 s"
    )
    assert line.endswith("Waiting for rank(s) 1 (forward at step 7).")
    behind = report({0: note(8, "data", 70.0), 1: note(7, "checkpoint", 70.0)}, 2, now=100.0, stalled_s=30)
    assert behind.endswith("Waiting for rank(s) 1 (checkpoint at step 7)."), "an earlier step is further behind"


def test_a_rank_never_heard_from_is_named_and_a_shared_place_is_said_to_be_the_network():
    silent = report({0: note(3, "backward", 10.0)}, 2, now=40.0, stalled_s=30)
    assert silent.endswith("Never heard from rank(s) 1: waiting for them.")
    alike = report({0: note(3, "backward", 10.0), 1: note(3, "backward", 10.0)}, 2, now=40.0, stalled_s=30)
    assert alike.endswith(
        "Every rank is at the same place (backward at step 3): a long backward or a slow "
        "collective (network?), rather than one rank."
    )


def test_under_fsdp2_the_rank_inside_an_earlier_block_is_the_one_waited_for():
    """Every rank is in the forward pass, where FSDP2 gathers each block's weights: the one that entered fewer
    blocks holds the others at the next block's all-gather."""
    notes = {0: note(5, "forward", 70.0, blocks=3), 1: note(5, "forward", 70.0, "node-b", blocks=2)}
    line = report(notes, 2, now=100.0, stalled_s=30)
    assert "rank 0 (node-a) forward at step 5 (sharded block 3) since 30 s" in line
    assert line.endswith("Waiting for rank(s) 1 (forward at step 5 (sharded block 2)).")


def test_one_rank_reports_a_stall_whichever_rank_waited_first():
    """Each rank's thread looks at every rank's note when it has waited ``stall_warning_s`` itself: the stalled rank
    first (rank 1 here), or the rank waiting for a straggler that then stopped. Nobody speaks until every rank has
    waited; then the lowest does, whoever looks."""
    stalled_first = {0: note(5, "backward", 98.5), 1: note(5, "forward", 97.9)}  # rank 1 has waited 2.1 s, rank 0 1.5
    assert speaker(stalled_first, now=100.0, warning_s=2) is None
    assert speaker(stalled_first, now=101.0, warning_s=2) == 0
    straggler = {0: note(5, "backward", 97.5), 1: note(5, "data", 98.5)}  # rank 0 has waited 2.5 s, rank 1 1.5
    assert speaker(straggler, now=100.0, warning_s=2) is None
    assert speaker(straggler, now=100.5, warning_s=2) == 0
    assert speaker({1: note(5, "forward", 90.0)}, now=100.0, warning_s=2) == 1, "rank 0 never heard from"
