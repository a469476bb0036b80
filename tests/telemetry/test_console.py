"""The console: library warnings once per job, and no line of output breaking into the progress bar."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT, accelerate_launch, clean_env, free_port

SCENARIOS = ROOT / "tests" / "jobs" / "scenarios.py"


def test_library_warnings_come_once_per_job_not_once_per_rank_or_per_step(tmp_path):
    result = accelerate_launch(SCENARIOS, "noisy", "--output_dir", tmp_path)  # 2 processes, 8 steps
    output = result.stdout + result.stderr
    assert output.count("NOISE from transformers, on every rank") == 1
    assert output.count("NOISE from accelerate, at every save") == 1
    assert output.count("NOISE printed in pieces") == 8  # the user's own lines are theirs: every one


def test_lines_written_while_the_progress_bar_is_drawn_stay_whole(tmp_path):
    pexpect = pytest.importorskip("pexpect")  # in the test extra; a host without it skips, as test_hosts does

    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / "multi_gpu.yaml"),
        "--main_process_port",
        str(free_port()),
        str(SCENARIOS),
        "noisy",
        "--output_dir",
        str(tmp_path),
        "--max_steps",
        "20",
    ]
    child = pexpect.spawn(
        command[0], command[1:], env=clean_env(), cwd=str(ROOT), dimensions=(24, 160), encoding="utf-8", timeout=180
    )
    child.expect(pexpect.EOF)
    child.close()
    raw = child.before
    assert child.exitstatus == 0, raw[-3000:]
    assert "train:" in raw and "20/20" in raw, "a terminal gets the progress bar"
    # What a terminal shows of a line is what follows its last carriage return: each message must be all of it,
    # not the bar's text with the message glued on (or the message cut by a redrawn bar).
    shown = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in raw.split("\n")]
    for message in ("NOISE printed in pieces", "[transformers] NOISE from transformers, on every rank"):
        mangled = [
            line
            for line, seen in zip(raw.split("\n"), shown, strict=True)
            if message.split()[-1] in line and seen != message
        ]
        assert not mangled, f"{message!r} broke into the bar: {mangled[:2]}"
    assert shown.count("NOISE printed in pieces") == 20
    step_lines = [line for line in shown if line.startswith("step ")]
    assert len(step_lines) == 20 and all(line.endswith("examples/s") for line in step_lines), step_lines[:3]
