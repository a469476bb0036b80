"""wandb from every process, read back from what wandb's real offline mode wrote; local metrics and the plot."""

from __future__ import annotations

import json
import sys

import pytest
from wandb_records import offline_runs

from conftest import SCENARIOS, accelerate_launch, clean_env, free_port, launch_jobs, python, run

PROJECT = ["--wandb_project", "trainer-tests", "--experiment_name", "exp"]


def wandb_env(tmp_path, **extra: str) -> dict[str, str]:
    """Offline wandb whose settings and caches stay inside the test's folder."""
    extra = {"WANDB_MODE": "offline", **extra}
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        extra.setdefault(name, str(tmp_path / name.lower()))
    return clean_env(**extra)


def by_name(runs):
    return {run.name: run for run in runs}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> dict:
    """2-process jobs logging to wandb (offline): one crashed after step 6 and one preempted at step 3, each in a
    launch of its own, then in one launch (conftest.launch_jobs) their reruns and a run with rank 1 slower. By name:
    the output_dir, the first launch's ending, the run's ending in the shared launch, the first launch's wandb runs
    (neither first for the slowed run)."""
    root = tmp_path_factory.mktemp("tracked")
    env, out = wandb_env(root), {name: root / name for name in ("logged", "crashed", "preempted")}
    job = {name: [SCENARIOS, "resume", "--output_dir", folder, *PROJECT] for name, folder in out.items()}
    first = {
        "crashed": accelerate_launch(*job["crashed"], "--crash_at", "6", env=env, expect_ok=False),
        "preempted": accelerate_launch(
            *job["preempted"], "--signal_at", "2", "--signal_rank", "1", env=env, expect_ok=False
        ),
    }
    runs = {name: offline_runs(out[name]) for name in first}
    again = launch_jobs({**job, "logged": [*job["logged"], "--slow_rank", "1"]}, env=env)
    return {name: (out[name], first.get(name), again[name], runs.get(name)) for name in out}


@pytest.fixture(scope="module")
def logged_run(tracked):
    """A 2-process run logging to wandb (offline), rank 1 slower: its output_dir."""
    out, _, ended, _ = tracked["logged"]
    assert ended.returncode == 0, ended.stderr[-3000:]
    return out


def test_two_processes_log_two_runs_in_one_group_with_their_own_shards(logged_run):
    out = logged_run
    runs = offline_runs(out)
    assert sorted(r.name for r in runs) == ["exp-rank0", "exp-rank1"]
    assert {r.group for r in runs} == {"exp"} and len({r.run_id for r in runs}) == 2
    rank0, rank1 = by_name(runs)["exp-rank0"], by_name(runs)["exp-rank1"]
    for rank, r in enumerate((rank0, rank1)):
        assert r.exit_code == 0 and r.run_id.endswith(f"-rank{rank}")
        assert (r.config["rank"], r.config["world_size"], r.config["lr"]) == (rank, 2, 0.01)
        assert {"local_rank", "node_rank", "host"} <= r.config.keys()
    logged = lambda r: [h for h in r.history if "rank/loss" in h]  # noqa: E731
    assert [h["_step"] for h in logged(rank0)] == [3, 6, 9, 12, 15, 18] == [h["_step"] for h in logged(rank1)]
    # Each rank's own shard: the two losses differ, and their mean is the global loss the main process logs.
    for own0, own1 in zip(logged(rank0), logged(rank1), strict=True):
        assert own0["rank/loss"] != own1["rank/loss"]
        assert abs((own0["rank/loss"] + own1["rank/loss"]) / 2 - own0["global/train_loss"]) < 1e-9
        for key in ("rank/step_time_s", "rank/data_wait_s", "rank/examples_per_s", "rank/memory_gb"):
            assert own0[key] > 0 and own1[key] > 0, key
        assert own0["rank/lr"] == own1["rank/lr"] >= 0
    assert not any(key.startswith("global/") for h in rank1.history for key in h), "only the main process"
    # The straggler: rank 1 sleeps 100 ms in every forward; the main process names it at every log.
    assert [h["global/slowest_rank"] for h in logged(rank0)] == [1] * 6
    assert all(h["global/step_time_max_s"] >= h["global/step_time_min_s"] for h in logged(rank0))
    assert all(
        h["global/forward_max_s"] == own1["rank/forward_s"] >= 0.1
        for h, own1 in zip(logged(rank0), logged(rank1), strict=True)
    )
    # The local metrics hold the same figures, one file per rank.
    lines = [json.loads(line) for line in (out / "metrics" / "rank1.jsonl").read_text().splitlines()]
    assert [line["rank/loss"] for line in lines] == [h["rank/loss"] for h in logged(rank1)]


def test_a_resumed_job_continues_the_same_runs(tracked):
    out, _, rerun, first = tracked["crashed"]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    second = offline_runs(out)[len(first) :]
    assert len(first) == len(second) == 2
    assert sorted(r.run_id for r in first) == sorted(r.run_id for r in second), "the same 2 runs, continued"
    assert sorted(r.name for r in second) == ["exp-rank0", "exp-rank1"]
    # Rank 1 died with os._exit: its run never ended. (Rank 0 usually ends its own run failed, with gloo's
    # "Connection reset by peer" in it, unless the launcher kills it first.)
    assert [r.exit_code for r in first if r.run_id.endswith("rank1")] == [None]
    assert all(r.exit_code == 0 for r in second)
    # The crash came after step 6; the last checkpoint was step 4, so the second attempt logs from step 6 on.
    steps = [h["_step"] for h in by_name(second)["exp-rank0"].history if "rank/loss" in h]
    assert steps == [6, 9, 12, 15, 18]


def test_a_preempted_job_ends_its_runs_preempting_and_the_rerun_continues_them(tracked):
    out, preempted, rerun, first = tracked["preempted"]
    assert "trainer: preempted (SIGUSR1) at step 3 of 18" in preempted.stdout
    assert len(first) == 2 and all(r.preempting and r.exit_code == 75 for r in first), first
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    second = offline_runs(out)[len(first) :]
    assert sorted(r.run_id for r in first) == sorted(r.run_id for r in second), "the same 2 runs, continued"
    assert all(r.exit_code == 0 and not r.preempting for r in second)
    steps = [h["_step"] for h in by_name(second)["exp-rank0"].history if "rank/loss" in h]
    assert steps[0] > 3 and steps[-1] == 18


def test_an_exception_on_one_rank_marks_its_run_failed_with_the_error(tmp_path):
    out = tmp_path / "run"
    failed = accelerate_launch(
        SCENARIOS, "resume", "--output_dir", out, *PROJECT, "--raise_at", "5", env=wandb_env(tmp_path), expect_ok=False
    )
    assert "boom on rank 1 at step 5" in failed.stderr
    # Rank 0, left in the gradients' all-reduce, says so in one line rather than with a second traceback (unless
    # the launcher, seeing rank 1 gone, ends it first: then it says nothing).
    assert (
        failed.stderr.count(
            "trainer: another process of the job ended while this one waited for it in a collective (Connection "
        )
        <= 1
    ), failed.stderr[-3000:]
    assert "[rank0]: Traceback" not in failed.stderr, failed.stderr[-3000:]
    rank1 = by_name(offline_runs(out))["exp-rank1"]
    assert rank1.exit_code == 1
    assert rank1.summary["error"] == "RuntimeError: boom on rank 1 at step 5"
    assert "Traceback" in rank1.summary["traceback"]
    error = json.loads((out / "metrics" / "rank1.jsonl").read_text().splitlines()[-1])["error"]
    assert "RuntimeError: boom on rank 1 at step 5" in error


def test_no_credentials_and_no_network_still_train_offline(tmp_path):
    # Online mode, an API key, and a server address where nothing listens: wandb.init fails (fast, here).
    env = wandb_env(
        tmp_path, WANDB_API_KEY="x" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}", WANDB_INIT_TIMEOUT="3"
    )
    del env["WANDB_MODE"]
    result = python(SCENARIOS, "resume", "--output_dir", tmp_path / "a", *PROJECT, env=env)
    assert result.stderr.count("wandb is unreachable") == 1 and "RESULT" in result.stdout
    assert [r.exit_code for r in offline_runs(tmp_path / "a")] == [0]
    # No API key at all: the same, at once.
    env = wandb_env(tmp_path)
    del env["WANDB_MODE"]
    result = python(SCENARIOS, "resume", "--output_dir", tmp_path / "b", *PROJECT, env=env)
    assert "wandb is unreachable (No API key configured" in result.stderr and "RESULT" in result.stdout


def test_without_wandb_project_neither_wandb_nor_datasets_is_imported(tmp_path):
    """Nor transformers' schedule module, for the run's cosine schedule: it imports PEFT where PEFT is installed
    (3.6 s of a process's start here; trainer.schedules has the same schedules)."""
    unused = {"wandb", "datasets", "transformers.optimization", "peft"}
    code = (
        "import sys, runpy; sys.argv = ['scenarios.py', 'resume', '--output_dir', sys.argv[1]]; "
        f"runpy.run_path({str(SCENARIOS)!r}, run_name='__main__'); "
        f"imported = {unused!r} & set(sys.modules); assert not imported, imported; print('NOT IMPORTED')"
    )
    result = run([sys.executable, "-c", code, str(tmp_path)])
    assert "NOT IMPORTED" in result.stdout
    assert (tmp_path / "metrics" / "rank0.jsonl").is_file() and not (tmp_path / "wandb").exists()


def test_plot_draws_every_rank_to_a_png(logged_run, tmp_path):
    result = run([sys.executable, "-m", "trainer.plot", str(logged_run), "--out", str(tmp_path / "curves.png")])
    assert "curves.png" in result.stdout
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "curves.png").stat().st_size > 20_000  # four panels of lines, not an empty canvas
