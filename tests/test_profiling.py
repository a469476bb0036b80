"""``profile_steps``: a torch.profiler trace of the same optimizer steps on every rank of a real 2-process job."""

from __future__ import annotations

import json

from conftest import SCENARIOS, accelerate_launch


def test_every_rank_traces_the_steps_asked_each_one_span(tmp_path):
    result = accelerate_launch(SCENARIOS, "job", "--output_dir", tmp_path, "--profile_steps", "3-4")
    assert f"profile: steps 3-4 traced on every rank, into {tmp_path}/profile/rank<k>/trace.json" in result.stdout
    for rank in (0, 1):
        events = json.loads((tmp_path / "profile" / f"rank{rank}" / "trace.json").read_text())["traceEvents"]
        steps = sorted({event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")})
        assert steps == ["ProfilerStep#0", "ProfilerStep#1"], (rank, steps)  # torch numbers the spans it saw
        assert any("all_reduce" in event.get("name", "") for event in events), "the gradients' all-reduce is in it"
    assert json.loads((tmp_path / "result.json").read_text())["result"]["global_step"] == 16  # trained on to the end
