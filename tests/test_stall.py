"""Naming the rank a stalled job waits for (trainer/stall.py's report), in-process; tests/test_cluster.py stalls a
real rank of a 2-process job and reads the line the others print."""

from __future__ import annotations

from trainer.stall import report


def note(step: int, phase: str, since: float, host: str = "node-a") -> dict:
    return {"step": step, "phase": phase, "host": host, "since": since}


def test_the_rank_furthest_behind_in_the_step_is_the_one_waited_for():
    notes = {0: note(7, "backward", 70.0), 1: note(7, "forward", 69.0, "node-b"), 2: note(7, "backward", 70.0)}
    line = report(notes, 3, now=100.0, stalled_s=30)
    assert line.startswith("stalled for 30 s: rank 0 (node-a) backward at step 7 since 30 s, rank 1 "
                           "(node-b) forward at step 7 since 31 s")  # fmt: skip
    assert line.endswith("Waiting for rank(s) 1 (forward at step 7).")
    behind = report({0: note(8, "data", 70.0), 1: note(7, "checkpoint", 70.0)}, 2, now=100.0, stalled_s=30)
    assert behind.endswith("Waiting for rank(s) 1 (checkpoint at step 7)."), "an earlier step is further behind"


def test_a_rank_never_heard_from_is_named_and_a_shared_place_is_said_to_be_the_network():
    silent = report({0: note(3, "backward", 10.0)}, 2, now=40.0, stalled_s=30)
    assert silent.endswith("Never heard from rank(s) 1: waiting for them.")
    alike = report({0: note(3, "backward", 10.0), 1: note(3, "backward", 10.0)}, 2, now=40.0, stalled_s=30)
    assert alike.endswith("Every rank is at the same place: a slow collective (network?) rather than one rank.")
