"""The Slurm scripts under a real Slurm (tests/support/slurm_cluster.py: munged, slurmctld and two slurmd on this host),
submitted with sbatch as a user would: one node with 2 processes, two nodes (SLURM_NODEID 0 and 1) with one each,
and a preempted job that checkpoints, requeues itself and finishes bit-identical. Skipped where Slurm is not
installed (`apt-get install slurmctld slurmd slurm-client munge`; .ci/run installs it)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
import slurm_cluster
from test_checkpoint import assert_bit_identical, final_weights, reference  # noqa: F401
from test_cluster import SGD_MEAN, one_process  # noqa: F401
from test_same_updates import COMMON, assert_same_run

from conftest import ROOT, SAME_UPDATES, SCENARIOS, clean_env, read_summary

pytestmark = [
    pytest.mark.skipif(
        bool(slurm_cluster.missing()),
        reason="Slurm is not installed here (missing "
        f"{', '.join(slurm_cluster.missing())}): apt-get install slurmctld slurmd slurm-client munge",
    ),
]
SCRIPTS = ROOT / "examples" / "slurm"
# The scripts' #SBATCH lines are for a GPU cluster ("edit them for yours"): here, from the command line.
HERE = ["--partition=debug", "--cpus-per-task=1", "--chdir", str(ROOT)]


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="trainer-slurm-"))  # munged wants its socket's folders open to all (x)
    root.chmod(0o711)
    started = time.monotonic()
    running = slurm_cluster.SlurmCluster(root).start()
    print(f"slurm up in {time.monotonic() - started:.2f} s")
    yield running
    running.stop()
    shutil.rmtree(root, ignore_errors=True)


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def sbatch(cluster, script: str, *args, env: dict, sbatch_args=(), wait: bool = True) -> str:
    """Submit as a user would; with ``wait``, until the job ended, and it must have completed. (Polled here rather
    than by `sbatch --wait`, whose own polling backs off to tens of seconds: most of a test's time.)"""
    cluster.env = {**clean_env(), **env, "SLURM_CONF": str(cluster.conf)}
    done = cluster.run("sbatch", "--parsable", *HERE, *sbatch_args, SCRIPTS / script, *args, check=False, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    job = done.stdout.strip().split(";")[0]
    if wait:
        state = cluster.wait_for(job, ENDED, timeout=300)
        assert state["JobState"] == "COMPLETED", state
    return job


def test_single_node_script_under_sbatch_matches_one_process(cluster, tmp_path, one_process):  # noqa: F811
    log = tmp_path / "job.out"
    job = sbatch(
        cluster,
        "single_node.sbatch",
        *COMMON,
        *SGD_MEAN,
        "--batch_size",
        "5",
        "--output_dir",
        tmp_path / "out",
        env={"SCRIPT": str(SAME_UPDATES), "PROCESSES_PER_NODE": "2"},
        sbatch_args=["--gpus=0", "-o", str(log)],
    )
    assert f"slurm job {job}: 1 node, 2 process(es)" in log.read_text()
    two = read_summary(tmp_path / "out")
    assert two["world_size"] == 2
    assert_same_run(one_process, two)


def test_two_node_script_under_sbatch_matches_one_process(cluster, tmp_path, one_process):  # noqa: F811
    log = tmp_path / "job.out"
    job = sbatch(
        cluster,
        "multi_node.sbatch",
        *COMMON,
        *SGD_MEAN,
        "--batch_size",
        "5",
        "--output_dir",
        tmp_path / "out",
        env={
            "SCRIPT": str(SAME_UPDATES),
            "PROCESSES_PER_NODE": "1",
            "MAIN_PROCESS_IP": "127.0.0.1",
        },  # n1, n2: names that do not resolve here
        sbatch_args=["--nodes=2", "--gpus-per-node=0", "-o", str(log)],
    )
    text = log.read_text()
    assert f"slurm job {job}: 2 nodes x 1 process(es), head 127.0.0.1:" in text
    assert cluster.job_state(job)["NodeList"] == "n[1-2]"
    two = read_summary(tmp_path / "out")
    assert two["world_size"] == 2
    assert_same_run(one_process, two)


def test_a_preempted_job_checkpoints_requeues_itself_and_finishes_bit_identical(cluster, tmp_path, reference):  # noqa: F811
    log, out = tmp_path / "job.out", tmp_path / "out"
    job = sbatch(
        cluster,
        "single_node.sbatch",
        "resume",
        "--output_dir",
        out,
        "--step_sleep",
        "0.5",
        "--slurm_requeue",
        env={"SCRIPT": str(SCENARIOS), "PROCESSES_PER_NODE": "2"},
        sbatch_args=["--gpus=0", "-o", str(log)],
        wait=False,
    )
    metrics = out / "metrics" / "rank0.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and '"step": 6' in metrics.read_text()):
        assert time.monotonic() < deadline, log.read_text() if log.is_file() else "the job never started"
        time.sleep(0.1)
    signalled = time.monotonic()
    # What `#SBATCH --signal=B:TERM@90` does 90 s before the time limit, or a preemption: SIGTERM to the batch
    # script (exec'd into accelerate launch, which forwards it to the workers).
    cluster.run("scancel", "--signal=TERM", "--batch", job)
    requeued = cluster.wait_for(job, {"PENDING", "COMPLETED", "FAILED", "CANCELLED"}, timeout=120)
    if requeued["JobState"] == "PENDING":  # Slurm holds a requeued job about 2 minutes (BeginTime): not our wait
        print(f"requeued {time.monotonic() - signalled:.1f} s after the signal; eligible at {requeued['EligibleTime']}")
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    state = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and int(state["Restarts"]) >= 1, (state, text[-3000:])
    assert "trainer: preempted (SIGTERM) at step " in text and f"job {job} requeued" in text, text[-3000:]
    step = int(text.split("trainer: preempted (SIGTERM) at step ")[1].split()[0])
    assert f"resumed from {out}/checkpoints/step-{step:08d}" in text
    print(f"preempted at step {step}; requeued, resumed and finished {time.monotonic() - signalled:.1f} s later")
    assert_bit_identical(final_weights(reference), final_weights(out))


@pytest.mark.parametrize("given", ["", "the user's own"])
def test_the_jobs_comment_tells_its_progress_unless_the_user_gave_one(cluster, tmp_path, given):
    """Progress to the scheduler (trainer/telemetry/progress.py): the comment says 100% once the job is done; a
    comment given at submission is left alone."""
    job = sbatch(
        cluster,
        "single_node.sbatch",
        *COMMON,
        *SGD_MEAN,
        "--output_dir",
        tmp_path / "out",
        env={"SCRIPT": str(SAME_UPDATES), "PROCESSES_PER_NODE": "1"},
        sbatch_args=["--gpus=0", "-o", str(tmp_path / "job.out"), *([f"--comment={given}"] if given else [])],
    )
    shown = cluster.run("scontrol", "show", "job", job).stdout
    comment = next(line.split("Comment=", 1)[1].strip() for line in shown.splitlines() if "Comment=" in line)
    assert comment == (given or "trainer: 100% (step 12 of 12), done"), shown
