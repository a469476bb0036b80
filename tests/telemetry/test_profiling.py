"""``profile_steps``: a torch.profiler trace of the same optimizer steps on every rank of a real 2-process job,
and nothing on the console but the one line that says where the traces are."""

from __future__ import annotations

import json

from conftest import JOBS, SCENARIOS, accelerate_launch, split_jobs


def test_every_rank_traces_the_steps_asked_each_one_span_and_the_console_stays_quiet(tmp_path):
    runs = {"3-4": tmp_path / "warm", "1-1": tmp_path / "first"}  # step 2 warms the profiler up; step 1 has none
    jobs = [[str(SCENARIOS), "job", "--output_dir", str(out), "--profile_steps", steps] for steps, out in runs.items()]
    result = accelerate_launch(JOBS, json.dumps(jobs))
    warm, first = split_jobs(result.stdout)
    assert f"profile: steps 3-4 traced on every rank, into {tmp_path}/warm/profile/rank<k>/trace.json" in warm
    assert f"profile: step 1 traced on every rank, into {tmp_path}/first/profile/rank<k>/trace.json" in first
    for out, spans in ((runs["3-4"], ["ProfilerStep#1", "ProfilerStep#2"]), (runs["1-1"], ["ProfilerStep#0"])):
        for rank in (0, 1):
            events = json.loads((out / "profile" / f"rank{rank}" / "trace.json").read_text())["traceEvents"]
            steps = sorted({event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")})
            assert steps == spans, (rank, steps)  # torch numbers the steps it saw: the warm-up's is not traced
            assert any("all_reduce" in event.get("name", "") for event in events), "the gradients' all-reduce is in it"
        assert json.loads((out / "result.json").read_text())["result"]["global_step"] == 16  # trained on to the end
    # Kineto's markers (2 a rank) and torch's word that a trace has no warm-up step: nothing a user can act on.
    assert "USDT:" not in result.stderr and "warmup" not in result.stderr, result.stderr[-3000:]
