"""Preemption through real signals: a checkpoint at the step every rank agreed on, a clean exit with status 75, a
bounded wait, and a rerun (resume: auto) bit-identical to a run never interrupted (tests/jobs/scenarios.py `resume`:
2 CPU processes, 18 optimizer steps, a periodic checkpoint every 4)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_checkpoint import assert_bit_identical, final_weights, launch_resume, reference  # noqa: F401

from conftest import SCENARIOS, clean_env, launch_command, python, run

PREEMPTED_EXIT = 75


def latest(output_dir: Path) -> str:
    return (output_dir / "checkpoints" / "latest").read_text()


def test_one_ranks_signal_is_enough_every_rank_checkpoints_the_same_step(tmp_path, reference):  # noqa: F811
    result = launch_resume(tmp_path, "--signal_at", 5, "--signal_rank", 1, "--step_sleep", 0.3, expect_ok=False)
    assert "SIGNAL SIGUSR1 to rank 1 after step 5" in result.stdout
    # Rank 1 alone got it. After the first log (step 3) the ranks compare notes about once a second: every 3
    # steps of 0.3 s, so rank 1's note goes out at step 6 and both ranks read it, and stop, at step 9.
    assert result.stdout.count("trainer: preempted (SIGUSR1) at step ") == 1
    step = preempted_at(result.stdout, "SIGUSR1")
    assert 6 <= step <= 12
    assert f"exitcode  : {PREEMPTED_EXIT}" in result.stderr  # the launcher's report of the worker
    assert latest(tmp_path) == f"step-{step:08d}", "a checkpoint of the step reached, whatever save_every says"
    assert not (tmp_path / "final").exists()
    again = launch_resume(tmp_path)
    assert "resumed from" in again.stdout and f"step {step}" in again.stdout
    assert_bit_identical(final_weights(reference), final_weights(tmp_path))


def start_slow_job(
    output_dir: Path, *args: str, until: str = "", launcher: str = "accelerate.commands.launch"
) -> tuple[subprocess.Popen, tempfile.TemporaryFile]:
    """The 2-process `resume` job at 0.3 s a step (started by ``python -m <launcher>``), returned once it is past
    step 6 (and its checkpoint of step 4), or once its output holds ``until``."""
    log = tempfile.TemporaryFile("w+")
    command = launch_command(
        SCENARIOS, "resume", "--output_dir", output_dir, "--step_sleep", "0.3", *args, launcher=launcher
    )
    launcher = subprocess.Popen(
        command, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    metrics = output_dir / "metrics" / "rank0.jsonl"

    def ready() -> bool:
        if until:
            log.seek(0)
            return until in log.read()
        return metrics.is_file() and '"step": 6' in metrics.read_text()

    deadline = time.monotonic() + 120
    while not ready():
        assert launcher.poll() is None and time.monotonic() < deadline, f"the job never reached {until or 'step 6'}"
        time.sleep(0.05)
    return launcher, log


def preempted_at(output: str, signal_name: str) -> int:
    assert f"trainer: preempted ({signal_name}) at step " in output, output[-3000:]
    return int(output.split(f"trainer: preempted ({signal_name}) at step ")[1].split()[0])


def workers_alive(output_dir: Path) -> int:
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    return sum(str(output_dir) in line and "scenarios.py" in line for line in ps.splitlines())


def kill_the_launcher(launcher: subprocess.Popen, output_dir: Path, within_s: float) -> float:
    """SIGKILL to the launcher alone, as the OOM killer or `kill -9` sends it; the seconds until its workers were
    gone, or ``within_s`` if they were not by then."""
    killed = time.monotonic()
    launcher.kill()
    launcher.wait()
    while workers_alive(output_dir) and time.monotonic() - killed < within_s:
        time.sleep(0.1)
    return time.monotonic() - killed


def test_sigterm_to_the_job_saves_exits_in_seconds_and_the_rerun_is_bit_identical(tmp_path, reference):  # noqa: F811
    launcher, log = start_slow_job(tmp_path)
    signalled = time.monotonic()
    # As Slurm does: SIGTERM to every process of the job, the launcher and its workers, and the launcher forwards
    # its own copy to each worker: both copies are the one preemption, not a second signal.
    os.killpg(launcher.pid, signal.SIGTERM)
    launcher.wait(timeout=60)
    seconds = time.monotonic() - signalled
    log.seek(0)
    step = preempted_at(log.read(), "SIGTERM")
    assert step >= 6 and latest(tmp_path) == f"step-{step:08d}"
    assert seconds < 15, f"{seconds:.1f} s from the signal to the exit"
    print(f"SIGTERM to the job: preempted at step {step}, {seconds:.1f} s from the signal to the launcher's exit")
    again = launch_resume(tmp_path)
    assert f"step {step}" in again.stdout
    assert_bit_identical(final_weights(reference), final_weights(tmp_path))


def test_a_signal_while_final_is_written_lets_it_finish_and_says_so(tmp_path):
    """SIGTERM to every rank as the export begins (after the last step's check): it ended every process with no line
    before, final/ not written; now the export finishes within the grace, every rank says why it went on, exit 0."""
    ended = launch_resume(tmp_path, "--max_steps", 4, "--signal_in_export")
    assert "EXPORTING rank 0" in ended.stdout and "EXPORTING rank 1" in ended.stdout, ended.stdout[-3000:]
    said = "trainer: SIGTERM received after the last step: the run was finished first (final/ written); nothing is"
    assert ended.stderr.count(said) == 2, ended.stderr[-3000:]
    assert (tmp_path / "final" / "model.safetensors").is_file() and "RESULT" in ended.stdout


def test_trainer_launch_ends_a_job_as_its_processes_chose_without_the_launchers_traceback(tmp_path):
    """accelerate launch (and torchrun) end a failed job with torch's 20-35-line ChildFailedError or SignalException
    traceback and status 1, a preemption's 75 lost to the scheduler. python -m trainer.launch, given the same
    arguments, ends a refusal with its one line and status 1, and a SIGTERM to the launcher alone with the
    processes' preemption checkpoint and 75, no traceback."""
    args = ("resume", "--output_dir", tmp_path / "refused", "--resume", tmp_path / "nope")
    refused = run(launch_command(SCENARIOS, *args, launcher="trainer.launch"), expect_ok=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    said = [line for line in refused.stderr.splitlines() if "trainer: " in line]
    assert len(said) == 1 and f"checkpoint {tmp_path / 'nope'} does not exist" in said[0], refused.stderr[-3000:]
    launcher, log = start_slow_job(tmp_path / "signalled", launcher="trainer.launch")
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == PREEMPTED_EXIT
    log.seek(0)
    output = log.read()
    assert "trainer: the launcher received SIGTERM, and passed it to the job's processes" in output, output[-3000:]
    step = preempted_at(output, "SIGTERM")
    assert latest(tmp_path / "signalled") == f"step-{step:08d}" and "Traceback" not in output, output[-3000:]


def test_a_killed_launcher_takes_its_workers_with_it_after_their_checkpoint(tmp_path, reference):  # noqa: F811
    launcher, log = start_slow_job(tmp_path)
    seconds = kill_the_launcher(launcher, tmp_path, within_s=30)
    assert not workers_alive(tmp_path), "the workers outlived their launcher"
    print(f"SIGKILL to the launcher: its workers gone {seconds:.1f} s later")
    log.seek(0)
    step = preempted_at(log.read(), "SIGTERM")  # their death signal, set at start (PR_SET_PDEATHSIG)
    assert latest(tmp_path) == f"step-{step:08d}"
    again = launch_resume(tmp_path)
    assert f"step {step}" in again.stdout
    assert_bit_identical(final_weights(reference), final_weights(tmp_path))


def test_a_killed_launcher_takes_the_workers_of_a_stalled_job_with_it(tmp_path):
    """Rank 1 hangs in step 5, deaf to signals as a hung kernel is, and rank 0 waits for it in the all-reduce. Its
    launcher's death sends both SIGTERM, but no step can end for the checkpoint, and nobody is left to kill them: each
    ends itself, at once since it is stalled past stall_warning_s, instead of living on until preemption_grace_s (180
    s) or the collective timeout."""
    launcher, log = start_slow_job(
        tmp_path,
        "--stall_at",
        "5",
        "--stall_s",
        "900",
        "--stall_deaf",
        "--stall_warning_s",
        "2",
        until="trainer: stalled for",
    )
    seconds = kill_the_launcher(launcher, tmp_path, within_s=60)
    assert not workers_alive(tmp_path), "the workers of a stalled job outlived their launcher"
    print(f"SIGKILL to a stalled job's launcher: its workers gone {seconds:.1f} s later")
    log.seek(0)
    output = log.read()
    for rank in (0, 1):
        assert f"is gone and rank {rank} has made no progress for" in output, output
    assert "TCPStore" not in output, "no store calls once the store went with the launcher"
    assert latest(tmp_path) == "step-00000004", "the last checkpoint stays"


def test_a_save_that_hangs_ends_at_the_deadline_and_the_last_checkpoint_stays(tmp_path):
    started = time.monotonic()
    result = python(
        SCENARIOS,
        "resume",
        "--output_dir",
        tmp_path,
        "--signal_at",
        5,
        "--signal_rank",
        0,
        "--hang_in_preemption_save",
        "--preemption_grace_s",
        3,
        expect_ok=False,
    )
    assert result.returncode == PREEMPTED_EXIT
    assert "HANGING in the save of step 5" in result.stdout
    assert "trainer: still not done 3 s after SIGUSR1 (preemption_grace_s): exiting now" in result.stderr
    assert time.monotonic() - started < 60
    assert latest(tmp_path) == "step-00000004", "the half-done save never became latest"


def test_a_second_signal_exits_at_once(tmp_path):
    """A second signal, seconds after the first (copies within 2 s count as one)."""
    command = [
        sys.executable,
        str(SCENARIOS),
        "resume",
        "--output_dir",
        str(tmp_path),
        "--signal_at",
        "5",
        "--signal_rank",
        "0",
        "--hang_in_preemption_save",
    ]
    job = subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in job.stdout:
        if line.startswith("HANGING"):
            break
    else:
        pytest.fail("the job never reached its preemption save")
    time.sleep(2.5)
    second = time.monotonic()
    job.send_signal(signal.SIGINT)  # Ctrl-C, again
    job.wait(timeout=30)
    assert job.returncode == PREEMPTED_EXIT and time.monotonic() - second < 5
    assert "trainer: second signal (SIGINT): exiting now" in job.stderr.read()
    assert latest(tmp_path) == "step-00000004"


REQUEUE = """
import signal, sys, time
from trainer.launch.preemption import requeue_slurm_job
signal.signal(signal.SIGTERM, lambda *a: None)  # the worker survives: fit() notes the signal
print("ASKING", flush=True)
print("REQUEUE", requeue_slurm_job(), flush=True)
"""


def test_the_requeue_survives_the_launchers_signal_to_the_workers_process_group(tmp_path):
    """torch's launcher, shutting down on the job's SIGTERM, signals each worker's whole process group (os.killpg),
    and again a second later: the `scontrol requeue` a worker is running must not die of it mid-request (under a
    real Slurm the request had gone through, but the worker said `scontrol requeue 3 failed: `). Here `scontrol`
    takes 2 s to answer, and the group gets SIGTERM while it does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    started = tmp_path / "scontrol-started"
    fake.write_text(f"#!/bin/sh\ntouch {started}\nsleep 2\necho requeued\n")
    fake.chmod(0o755)
    env = clean_env(SLURM_JOB_ID="7", PATH=f"{bin_dir}:{os.environ['PATH']}")
    worker = subprocess.Popen(
        [sys.executable, "-c", REQUEUE], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert worker.stdout.readline().strip() == "ASKING"
    deadline = time.monotonic() + 60
    while not started.exists():  # scontrol is running
        assert time.monotonic() < deadline and worker.poll() is None, "scontrol never started"
        time.sleep(0.05)
    os.killpg(worker.pid, signal.SIGTERM)
    output, _ = worker.communicate(timeout=60)
    assert "REQUEUE job 7 requeued" in output, output
