"""Checkpoints and exact resume through real processes (tests/jobs/scenarios.py `resume`: dropout, AdamW, a cosine
schedule, shuffling, 2 CPU processes, 6 optimizer steps an epoch, 18 in all, a checkpoint every 4 steps)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scenarios import DropoutClassifier

from trainer import PREEMPTED_EXIT

from conftest import (
    JOBS,
    ROOT,
    SCENARIOS,
    accelerate_launch,
    clean_env,
    job_exits,
    launch_command,
    once_per_suite,
    python,
    resign,
    split_jobs,
    torchrun,
)


def launch_resume(output_dir, *args, **kw):
    return accelerate_launch(SCENARIOS, "resume", "--output_dir", output_dir, *map(str, args), **kw)


def final_weights(output_dir):
    return load_file(str(output_dir / "final" / "model.safetensors"))


def assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs by {(a[name] - b[name]).abs().max().item()}"


def result_line(output: str) -> dict:
    (line,) = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted run (once for every module that compares with it: read, never written)."""
    return once_per_suite(tmp_path_factory, "reference", launch_resume)


# Runs that fail part-way (name -> arguments), each launched alone; then every one of them is continued in one launch
# (tests/jobs/run_many.py), as a restart continues it.
FAILURES = {
    "crash after 9 on rank 1": ["--crash_at", 9, "--crash_rank", 1],  # mid-epoch, a step after a checkpoint
    "crash after 8 on rank 0": ["--crash_at", 8, "--crash_rank", 0],  # right after a checkpoint
    "crash after 6 on rank 1": ["--crash_at", 6, "--crash_rank", 1],  # at an epoch's end, two steps after one
    "killed in the save of 8": ["--kill_in_save_at", 8],
    "nan at 6 on rank 1": ["--nan_at", 6, "--nan_rank", 1],
}


@pytest.fixture(scope="module")
def failed_then_resumed(tmp_path_factory, reference) -> dict[str, tuple]:
    """name -> (its output_dir, the failed launch, the `latest` pointer it left, the resumed run's stdout); and
    two more runs of that launch, by name -> (output_dir, stdout): the reference run started again once finished,
    and a run that skips a NaN step."""
    failed = {}
    for name, args in FAILURES.items():
        out = tmp_path_factory.mktemp("failed")
        result = launch_resume(out, *args, expect_ok=False)
        failed[name] = (out, result, (out / "checkpoints" / "latest").read_text())
    # everything the resumes load must load with weights_only=True
    jobs = [[str(SCENARIOS), "resume", "--output_dir", str(out), "--forbid_unsafe_load"] for out, *_ in failed.values()]
    finished, skipping = tmp_path_factory.mktemp("finished") / "run", tmp_path_factory.mktemp("skip")
    shutil.copytree(reference, finished)
    exported = tmp_path_factory.mktemp("hf_export")
    jobs += [
        [str(SCENARIOS), "resume", "--output_dir", str(finished)],
        [
            str(SCENARIOS),
            "resume",
            "--output_dir",
            str(skipping),
            "--nan_at",
            6,
            "--nan_rank",
            0,
            "--nan_policy",
            "skip",
        ],
        [str(SCENARIOS), "hf_export", "--output_dir", str(exported)],
    ]
    outputs = split_jobs(accelerate_launch(JOBS, json.dumps(jobs, default=str)).stdout)
    runs = {name: (*failed[name], output) for name, output in zip(failed, outputs[: len(failed)], strict=True)}
    runs["finished, started again"], runs["nan skipped"] = (finished, outputs[-3]), (skipping, outputs[-2])
    runs["a transformers model"] = (exported, outputs[-1])
    return runs


@pytest.mark.parametrize(
    "crash_at, rank, resumes_at",
    [(9, 1, "step 8, epoch 1, batch 2"), (8, 0, "step 8, epoch 1, batch 2"), (6, 1, "step 4, epoch 0, batch 4")],
)
def test_hard_crash_then_restart_ends_bit_identical(failed_then_resumed, reference, crash_at, rank, resumes_at):
    out, crashed, _, resumed = failed_then_resumed[f"crash after {crash_at} on rank {rank}"]
    assert f"CRASH rank {rank} after step {crash_at}" in crashed.stdout
    assert f"resumed from {out}/checkpoints/" in resumed and resumes_at in resumed
    assert result_line(resumed)["global_step"] == 18
    assert_bit_identical(final_weights(reference), final_weights(out))


@pytest.mark.parametrize("launcher", ["accelerate-shipped-config", "torchrun-c10d"])
def test_elastic_restart_finishes_by_itself_bit_identical(tmp_path, reference, launcher):
    """A worker dies; the launcher restarts the job (--max_restarts 1), which resumes from its checkpoint. With the
    shipped config as it is (static rendezvous: one store for every attempt, pytorch/pytorch#135712) the restarted
    workers used to read the dead attempt's addresses and hang or fail; each attempt's keys are kept apart now."""
    if launcher == "torchrun-c10d":  # torchrun shares its c10d store with the workers as well
        result = torchrun(
            SCENARIOS,
            "resume",
            "--output_dir",
            tmp_path,
            "--crash_at",
            13,
            "--crash_rank",
            0,
            run_args=["--max-restarts", "1", "--monitor-interval", "0.5"],
        )
    else:
        elastic = ["--max_restarts", "1", "--monitor_interval", "0.5"]
        result = launch_resume(tmp_path, "--crash_at", 13, "--crash_rank", 0, run_args=elastic, timeout=120)
    assert "CRASH rank 0 after step 13" in result.stdout and "step 12, epoch 2, batch 0" in result.stdout
    assert_bit_identical(final_weights(reference), final_weights(tmp_path))


def test_a_finished_run_started_again_says_so(failed_then_resumed, reference):
    run, again = failed_then_resumed["finished, started again"]
    assert "already finished at step 18 of 18: nothing to train; raise max_steps" in again
    assert_bit_identical(final_weights(reference), final_weights(run))


def test_kill_during_a_save_leaves_the_previous_checkpoint_latest(failed_then_resumed, reference):
    tmp_path, killed, latest, resumed = failed_then_resumed["killed in the save of 8"]
    assert "KILLED during the save of step 8" in killed.stdout
    assert latest == "step-00000004"
    assert "step 4, epoch 0, batch 4" in resumed
    assert_bit_identical(final_weights(reference), final_weights(tmp_path))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["latest", "step-00000016", "step-00000018"], "keep_last=2, and the torn write is cleared"


def test_nan_raise_names_step_and_rank_and_the_last_good_checkpoint_resumes(failed_then_resumed, reference):
    tmp_path, failed, latest, _ = failed_then_resumed["nan at 6 on rank 1"]
    assert "non-finite loss (NaN or inf) at step 6 on rank 1" in failed.stderr
    assert f"The last good checkpoint is {tmp_path}/checkpoints/step-00000004" in failed.stderr
    assert latest == "step-00000004", "no NaN state was checkpointed"
    # the NaN was transient: continuing from the good checkpoint reproduces the run
    assert_bit_identical(final_weights(reference), final_weights(tmp_path))


def test_nan_skip_drops_the_step_on_every_rank(failed_then_resumed, reference):
    tmp_path, output = failed_then_resumed["nan skipped"]
    summary = result_line(output)
    assert summary["skipped_steps"] == 1 and summary["global_step"] == 18
    weights = final_weights(tmp_path)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not torch.equal(weights["net.0.weight"], final_weights(reference)["net.0.weight"])


def test_final_model_of_a_transformers_model_loads_with_the_auto_classes(failed_then_resumed):
    tmp_path, output = failed_then_resumed["a transformers model"]
    assert "PERPLEXITY" in output  # the default loss, model(**batch).loss, reports perplexity
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert type(model).__name__ == "GPT2LMHeadModel" and (tmp_path / "final" / "model.safetensors").is_file()


# ------------------------------------------------------------------- bad input: one process is enough


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    python(SCENARIOS, "resume", "--output_dir", out)
    return out


@pytest.fixture(scope="module")
def refused_on_two(one_process_run) -> dict[str, str]:
    """The one-process run resumed on 2 processes, refused: without resume ("overwrite"), and at another global
    batch ("global batch"); both in one launch (tests/jobs/run_many.py), each run's stderr by name."""
    runs = {"overwrite": ["--resume", "none"], "global batch": []}
    jobs = [[str(SCENARIOS), "resume", "--output_dir", str(one_process_run), *args] for args in runs.values()]
    result = accelerate_launch(JOBS, json.dumps(jobs), expect_ok=False)
    assert job_exits(result.stderr, len(runs)) == [1, 1], result.stderr[-3000:]
    return dict(zip(runs, split_jobs(result.stderr), strict=True))


def test_existing_checkpoints_are_not_silently_overwritten_one_line_from_every_process(refused_on_one, refused_on_two):
    message = refusal(refused_on_one, "overwrite")
    assert "already holds checkpoints of an earlier run. Set resume='auto'" in message
    assert message.startswith("trainer: ") and message.count("\n") == 1, "one line, no traceback: " + message
    # 2 processes: the main process decides and every rank refuses; none is left in a collective to die noisily.
    launched = refused_on_two["overwrite"]
    assert launched.count("trainer: ") == 1 and "already holds checkpoints of an earlier run" in launched, launched
    assert "[rank0]: Traceback" not in launched and "[rank1]: Traceback" not in launched, "the line, no traceback"
    assert "GLHF" not in launched and "Connection closed" not in launched and "terminate called" not in launched


def test_checkpoint_of_another_model_is_refused_by_name(refused_on_one):
    message = refusal(refused_on_one, "another model")
    assert "checkpoints/step-00000036 does not fit this run" in message
    assert (
        "Size mismatch between saved torch.Size([32, 8]) and current: torch.Size([16, 8]) for model.net.0.weight"
        in message
    )


def test_missing_resume_path_is_named(refused_on_one):
    message = refusal(refused_on_one, "missing path")
    assert "step-00000099 does not exist. Other checkpoints there:" in message


def copy_of(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


@pytest.fixture(scope="module")
def refused_on_one(one_process_run, tmp_path_factory) -> dict[str, tuple]:
    """The one-process run (or a copy of it, damaged) resumed in ways that are refused, every run in one process
    (tests/jobs/run_many.py, each ending as its own process would): name -> (exit status, stdout, stderr, folder)."""
    torn, crafted = (copy_of(one_process_run, tmp_path_factory.mktemp(name)) for name in ("torn", "crafted"))
    (torn / "checkpoints" / "step-00000036" / "shards" / "__0_0.distcp").unlink()
    ran = crafted.parent / "it-ran"

    class Payload:  # scheduler.bin as a pickle that calls os.system, its size and CRC-32 made to match
        def __reduce__(self):
            return os.system, (f"touch {ran}",)

    checkpoint = crafted / "checkpoints" / "step-00000036"
    torch.save({"state": Payload()}, checkpoint / "scheduler.bin")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    data = (checkpoint / "scheduler.bin").read_bytes()
    state["files"]["scheduler.bin"], state["crc32"]["scheduler.bin"] = len(data), f"{zlib.crc32(data):08x}"
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    missing = one_process_run / "checkpoints" / "step-00000099"
    loop = tmp_path_factory.mktemp("loop") / "out"
    loop.symlink_to(loop)
    runs = {
        "overwrite": (one_process_run, "--resume", "none"),
        "another model": (one_process_run, "--hidden", 16),
        "missing path": (tmp_path_factory.mktemp("missing"), "--resume", missing),
        "torn": (torn, "--resume", torn / "checkpoints" / "step-00000036"),
        "torn, the one before": (torn, "--resume", torn / "checkpoints" / "step-00000032"),
        "crafted": (crafted, "--resume", checkpoint),
        "unwritable": (one_process_run / "checkpoints" / "latest" / "sub",),
        "a link loop": (loop,),
    }
    jobs = [[str(SCENARIOS), "resume", "--output_dir", str(folder), *map(str, args)] for folder, *args in runs.values()]
    result = python(JOBS, json.dumps(jobs), expect_ok=False)
    outputs = zip(
        job_exits(result.stderr, len(runs)), split_jobs(result.stdout), split_jobs(result.stderr), strict=True
    )
    return {name: (*output, folder) for (name, (folder, *_)), output in zip(runs.items(), outputs, strict=True)}


def refusal(refused_on_one, name: str) -> str:
    status, _, stderr, _ = refused_on_one[name]
    assert status == 1, f"{name}: exit {status}\n{stderr}"
    return stderr


def test_a_torn_checkpoint_asked_for_by_path_is_named_with_the_others(refused_on_one):
    message = refusal(refused_on_one, "torn")
    assert "step-00000036 is torn: shards/__0_0.distcp is missing or truncated" in message
    assert "Other checkpoints there:" in message and "step-00000032" in message
    status, stdout, stderr, _ = refused_on_one["torn, the one before"]
    assert status == 0, stderr[-3000:]
    assert "resumed from" in stdout and result_line(stdout)["global_step"] == 36


def test_a_file_torch_load_refuses_is_named_in_one_line_and_runs_nothing(refused_on_one):
    """scheduler.bin (accelerate's, read by torch.load) replaced by a pickle that calls os.system, the manifest's
    size and CRC-32 made to match: the resume refuses it in one line (weights_only=True), and the command never
    runs. (A crafted shard index: tests/parallel/test_fsdp.py.)"""
    message, crafted = refusal(refused_on_one, "crafted"), refused_on_one["crafted"][3]
    checkpoint = crafted / "checkpoints" / "step-00000036"
    assert (
        message.startswith(
            f"trainer: checkpoint {checkpoint} holds a file that cannot be loaded safely (nothing "
            "in it was run): UnpicklingError"
        )
        and message.count("\n") == 1
    ), message
    assert not (crafted.parent / "it-ran").exists(), "the pickle ran its command"


def zero_a_kilobyte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 1024] = bytes(1024)
    path.write_bytes(bytes(data))  # the same size: only the contents tell


DAMAGES = [
    "truncated",
    "zeroed model",
    "zeroed rng",
    "0xff optimizer",
    "deleted",
    "state a list",
    "state without files",
]


def damage(latest: Path, how: str) -> None:
    shard = latest / "shards" / "__0_0.distcp"  # the model's weights and the optimizer's state
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "zeroed model":
        zero_a_kilobyte(shard)
    elif how == "zeroed rng":
        zero_a_kilobyte(next(latest.glob("random_states_*.pkl")))
    elif how == "0xff optimizer":
        data = bytearray(shard.read_bytes())
        data[-64:] = b"\xff" * 64
        shard.write_bytes(bytes(data))
    elif how == "deleted":
        shutil.rmtree(latest)
    else:
        state = json.loads((latest / "trainer_state.json").read_text())
        state.pop("files")
        (latest / "trainer_state.json").write_text(json.dumps([] if how == "state a list" else state))


@pytest.fixture(scope="module")
def resumed_copies(one_process_run, tmp_path_factory) -> dict[str, tuple[Path, str, str]]:
    """Copies of the one-process run, each damaged in one way (and one where a kill left step 36 half-replaced),
    then resumed, every resume in one process (tests/jobs/run_many.py): name -> (the copy, its stdout, its stderr)."""
    copies = {}
    for how in DAMAGES:
        copies[how] = copy_of(one_process_run, tmp_path_factory.mktemp("damaged"))
        damage(copies[how] / "checkpoints" / "step-00000036", how)
    # Saving step 36 again (a run resumed from an older checkpoint) first moves the old step-36 aside; a kill before
    # the new one is in place leaves `latest` naming a folder that is not there.
    copies["half replaced"] = copy = copy_of(one_process_run, tmp_path_factory.mktemp("half_replaced"))
    (copy / "checkpoints" / "step-00000036").rename(copy / "checkpoints" / ".old-step-00000036")
    (copy / "checkpoints" / ".tmp-step-00000036").mkdir()  # the new one's unfinished folder
    runs = [[str(SCENARIOS), "resume", "--output_dir", str(copy)] for copy in copies.values()]
    runs[-1] += ["--max_steps", "40"]
    result = python(JOBS, json.dumps(runs))
    outputs = zip(split_jobs(result.stdout), split_jobs(result.stderr), strict=True)
    return {name: (copy, *output) for (name, copy), output in zip(copies.items(), outputs, strict=True)}


@pytest.mark.parametrize("how", DAMAGES)
def test_resume_auto_continues_from_the_newest_whole_checkpoint_past_a_damaged_latest(
    one_process_run, resumed_copies, how
):
    copy, stdout, stderr = resumed_copies[how]
    assert "continuing from the newest whole checkpoint" in stderr and "step-00000032" in stderr
    assert "resumed from" in stdout and "step 32" in stdout
    if how != "deleted":
        assert (copy / "checkpoints" / "damaged-step-00000036").is_dir(), "set aside, not deleted"
    # the run re-trained steps 33-36 from a whole checkpoint: the same weights as before the damage
    assert_bit_identical(final_weights(one_process_run), final_weights(copy))


def test_a_kill_while_an_existing_step_is_saved_again_leaves_a_whole_latest(resumed_copies):
    """`latest` names step 36, moved aside by a save of step 36 again that a kill stopped: the old one comes back."""
    _, stdout, _ = resumed_copies["half replaced"]
    assert "resumed from" in stdout and "step 36" in stdout


def test_two_jobs_on_one_output_dir_the_second_is_refused(tmp_path):
    # The first job is far from done when the second starts (a slow host once let it finish first: the second then
    # found the lock free); once the second has been refused, the first is preempted and must checkpoint as usual.
    command = [
        sys.executable,
        str(SCENARIOS),
        "resume",
        "--output_dir",
        str(tmp_path),
        "--step_sleep",
        "0.2",
        "--max_steps",
        "100000",
    ]
    first = subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (tmp_path / "metrics" / "rank0.jsonl").is_file():
        assert first.poll() is None, first.communicate()
        time.sleep(0.05)
    second = launch_resume(tmp_path, expect_ok=False)
    assert first.poll() is None, "the first job must still hold the lock"
    assert second.stderr.count(f"output_dir {tmp_path} is in use by another job (pid {first.pid} on ") == 1, (
        second.stderr[-3000:]
    )
    assert second.stderr.count("trainer: ") == 1 and "terminate called" not in second.stderr, second.stderr[-3000:]
    assert "[rank0]: Traceback" not in second.stderr and "[rank1]: Traceback" not in second.stderr
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
    assert first.returncode == PREEMPTED_EXIT, err  # it went on undisturbed, and checkpointed when told to stop


def test_a_full_disk_during_a_checkpoint_is_named_and_loses_nothing(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        # ~390 KB a checkpoint (hidden 2048): step 4 and step 8 fit, step 12's write fills the disk
        failed = python(SCENARIOS, "resume", "--output_dir", disk / "run", "--hidden", 2048, expect_ok=False)
        checkpoints = disk / "run" / "checkpoints"
        assert "could not write checkpoint step-00000012: the disk is full" in failed.stderr, failed.stderr[-2000:]
        assert f"{checkpoints / 'step-00000008'} is still the latest" in failed.stderr
        assert not list(checkpoints.glob(".tmp-*")), "the unfinished folder is removed, its space given back"
        subprocess.run(["mount", "-o", "remount,size=3m", str(disk)], check=True)
        again = python(SCENARIOS, "resume", "--output_dir", disk / "run", "--hidden", 2048)
        assert "step 8" in again.stdout and result_line(again.stdout)["global_step"] == 36
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_unwritable_output_dir_is_named(refused_on_one):
    """A file in the way, or a link that leads to itself (\"File exists\" before), said in words."""
    latest = refused_on_one["unwritable"][3].parent
    assert f"cannot be written: {latest} is a file, not a folder" in refusal(refused_on_one, "unwritable")
    loop = refused_on_one["a link loop"][3]
    said = f"output_dir {loop} cannot be written: {loop} is a symbolic link to {loop}, which leads to no folder"
    assert said in refusal(refused_on_one, "a link loop")


def test_a_different_global_batch_on_resume_stops_naming_both(refused_on_two):
    """1 process x batch 4 resumed on 2 x 4: a different global batch (the same one on any split continues:
    tests/parallel/test_fsdp.py)."""
    message = refused_on_two["global batch"]
    assert (
        message.count(
            "was written with 1 process(es) x batch 4 x accumulation 1 = 4 global; this run has 2 "
            "process(es) x batch 4 x accumulation 1 = 8 global"
        )
        == 1
    ), "said once for the job"
    assert "[rank0]: Traceback" not in message and "[rank1]: Traceback" not in message
    assert "keep 4 global (batch_size 2 with gradient_accumulation_steps 1)" in message


def test_a_compiled_model_checkpoints_resumes_and_exports_plain_weights(tmp_path):
    """compile: true goes through accelerate's dynamo plugin; the checkpoints and the export still fit a plain
    model (no "_orig_mod." prefixes), and a resumed compiled run continues from the checkpoint."""
    env = clean_env(TORCHINDUCTOR_COMPILE_THREADS="1")  # compiled in the process: no pool of workers importing torch
    first = python(SCENARIOS, "resume", "--output_dir", tmp_path, "--compile", "--max_steps", "4", env=env)
    assert result_line(first.stdout)["global_step"] == 4
    plain = final_weights(tmp_path)
    assert sorted(plain) == sorted(DropoutClassifier().state_dict())
    again = python(SCENARIOS, "resume", "--output_dir", tmp_path, "--compile", "--max_steps", "8", env=env)
    assert "resumed from" in again.stdout and result_line(again.stdout)["global_step"] == 8


def written_before_dcp(step: Path, into: Path) -> None:
    """Checkpoint folder ``step`` (today's: DCP's ``shards/``) rewritten in ``into`` as the trainer wrote DDP
    checkpoints before every strategy wrote DCP: the model in ``model.safetensors`` (tied weights once), the
    optimizer's ``state_dict()`` by parameter index in ``optimizer.bin``, the manifest's keys those of that time,
    re-signed. The layout is checked against tests/fixtures/ddp-checkpoint-v1 (written by that version) to the last key,
    shape and dtype, so that only the values are this environment's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    old = ROOT / "tests" / "fixtures" / "ddp-checkpoint-v1"
    shutil.copytree(step, into, ignore=shutil.ignore_patterns("shards"))
    dcp_to_torch_save(step / "shards", into / "whole.pt")
    whole = torch.load(into / "whole.pt", weights_only=False)
    (into / "whole.pt").unlink()
    stored = load_file(old / "model.safetensors")
    save_file({k: whole["model"][k] for k in stored}, into / "model.safetensors", metadata={"format": "pt"})
    groups = whole["optimizer"]["param_groups"]
    index = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    optimizer = {
        "state": {index[name]: value for name, value in whole["optimizer"]["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in groups],
    }
    torch.save(optimizer, into / "optimizer.bin")
    # The manifest's keys as that version wrote them (values this run's): it named the sharding.
    then, now = (json.loads((f / "trainer_state.json").read_text()) for f in (old, into))
    state = {
        part: ({k: now[part].get(k, v) for k, v in keys.items()} if isinstance(keys, dict) else keys)
        for part, keys in then.items()
    }
    state["run"]["config"] = {k: now["run"]["config"].get(k, v) for k, v in then["run"]["config"].items()}
    (into / "trainer_state.json").write_text(json.dumps(state))
    resign(into)

    def layout(value):
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype)
        if isinstance(value, dict):
            return {k: layout(v) for k, v in value.items() if k not in ("lr", "run_id", "output_dir")}
        return [layout(v) for v in value] if isinstance(value, (list, tuple)) else value

    assert sorted(p.name for p in into.iterdir()) == sorted(p.name for p in old.iterdir())
    for name in ("model.safetensors", "optimizer.bin"):
        read = load_file if name.endswith("safetensors") else lambda f: torch.load(f, weights_only=True)
        assert layout(read(into / name)) == layout(read(old / name)), name
    assert layout(state) | {"files": 0, "crc32": 0} == layout(then) | {"files": 0, "crc32": 0}


def test_a_ddp_checkpoint_written_before_dcp_resumes_bit_identical_under_ddp_and_fsdp2(tmp_path):
    """tests/jobs/legacy_job.py's step 2 (2 processes) in the layout DDP checkpoints had before every strategy wrote DCP
    (model.safetensors, optimizer.bin) resumes on 2 processes to the uninterrupted run's end bit for bit, as DDP and
    as FSDP2 (one launch). Both are this environment's: the step-2 checkpoint of an uninterrupted run here rewritten
    in the old layout (checked against tests/fixtures/ddp-checkpoint-v1, which that version wrote), since a checkpoint's
    numbers from another machine or another release of a dependency are 1e-6 away from this one's. The stored
    checkpoint itself resumes to the same end as DDP and as FSDP2; without one weight (re-signed) it is refused by
    name under FSDP2, as under DDP (it kept that weight's fresh initialisation before, and ended 0.077 away from the
    uninterrupted run). And in the same launch, a model built as nanoGPT builds its GPT on meta, sharded, starts with
    its LayerNorm's own ones and zeros (whatever memory held before: around 1e29 for nanoGPT's own GPT, and a NaN
    loss at step 1)."""
    job = ROOT / "tests" / "jobs" / "legacy_job.py"
    accelerate_launch(job, str(tmp_path / "whole"), num_processes=2)
    written_before_dcp(tmp_path / "whole" / "checkpoints" / "step-00000002", tmp_path / "here")
    runs = {"ddp": ["--ddp"], "fsdp": [], "stored-ddp": ["--ddp"], "stored-fsdp": [], "lacking": []}
    for name in runs:
        source = tmp_path / "here" if name in ("ddp", "fsdp") else ROOT / "tests" / "fixtures" / "ddp-checkpoint-v1"
        shutil.copytree(source, tmp_path / name / "checkpoints" / "step-00000002")
    lacking = tmp_path / "lacking" / "checkpoints" / "step-00000002"
    weights = load_file(lacking / "model.safetensors")
    del weights["transformer.h.0.mlp.c_fc.weight"]
    save_file(weights, lacking / "model.safetensors", metadata={"format": "pt"})
    resign(lacking)
    jobs = [
        [str(job), str(tmp_path / name), "--resume", str(tmp_path / name / "checkpoints" / "step-00000002"), *flags]
        for name, flags in runs.items()
    ]
    # In the same launch: a model built as nanoGPT builds its GPT, on meta, sharded.
    jobs.append([str(SCENARIOS), "nanogpt_meta", "--output_dir", str(tmp_path / "nanogpt")])
    launched = accelerate_launch(JOBS, json.dumps(jobs), config="fsdp.yaml", num_processes=2, expect_ok=False)
    assert job_exits(launched.stderr, 6) == [0, 0, 0, 0, 1, 0], launched.stderr
    lines = split_jobs(launched.stdout)[5].splitlines()
    placed = [json.loads(line.removeprefix("NANOGPT ")) for line in lines if line.startswith("NANOGPT ")]
    assert [(row["norm_ones"], row["norm_zeros"]) for row in placed] == [(True, True)] * 2, placed
    assert "model.safetensors lacks transformer.h.0.mlp.c_fc.weight" in split_jobs(launched.stderr)[4]
    assert not (tmp_path / "lacking" / "final").exists()
    for name, output in zip(list(runs)[:4], split_jobs(launched.stdout)[:4], strict=True):
        folder = tmp_path / name
        assert f"resumed from {folder / 'checkpoints' / 'step-00000002'}: step 2, epoch 0, batch 4" in output, name
        assert ("FSDP2 over 2 processes" in output) == name.endswith("fsdp"), output
        assert (folder / "checkpoints" / "step-00000004" / "shards" / ".metadata").is_file(), "written as DCP's"
    assert_bit_identical(final_weights(tmp_path / "ddp"), final_weights(tmp_path / "whole"))
    assert_bit_identical(final_weights(tmp_path / "fsdp"), final_weights(tmp_path / "whole"))
    assert_bit_identical(final_weights(tmp_path / "stored-fsdp"), final_weights(tmp_path / "stored-ddp"))


def test_save_async_under_ddp_killed_during_a_background_write_leaves_the_last_commit_and_resumes_bit_identical(
    reference, tmp_path
):
    """save_async under DDP (its model and optimizer are DCP's too): every process of the job is killed (SIGKILL)
    while step 8's checkpoint is being written in the background (its commit held back 2 s); step 4, committed
    before, is latest and whole, the unfinished write is never taken for a checkpoint, and the rerun ends bit for bit
    where the uninterrupted run did."""
    cmd = launch_command(SCENARIOS, "resume", "--output_dir", tmp_path, "--save_async", "--slow_background_write", 2)
    import psutil  # accelerate's own dependency

    job = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in job.stdout:
            if line.startswith("WRITING step-00000008"):
                break
    finally:
        # The workers too, at once (torch's agent starts them in sessions of their own): none lives to hear of it.
        for process in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            process.kill()
        job.wait()
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step-00000004"
    assert (checkpoints / ".tmp-step-00000008").is_dir(), "killed while the write was in flight"
    again = launch_resume(tmp_path, "--save_async")
    assert f"resumed from {checkpoints / 'step-00000004'}: step 4" in again.stdout
    assert result_line(again.stdout)["global_step"] == 18
    assert_bit_identical(final_weights(reference), final_weights(tmp_path))


def trainer_lines(output: str) -> list[str]:
    """The trainer's lines of every rank: its warnings, and a refusal as the launcher prefixes it (``[rank0]: ``)."""
    lines = output.splitlines()
    return [line for line in lines if line.startswith("trainer: ") or line.partition("]: ")[2].startswith("trainer: ")]


@pytest.fixture(scope="module")
def patience_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The patience case (2 ranks, stateful callbacks, an average of the weights, checkpoints of steps 8 and 10)
    whose final export cannot be written (its folder blocked by a file, as a read-only disk refuses it; root ignores
    permissions)."""
    base = tmp_path_factory.mktemp("patience")
    (base / ".final.writing").write_text("not a folder")
    args = ["--output_dir", base, "--ema_decay", "0.9"]
    return base, accelerate_launch(SCENARIOS, "patience", *args, expect_ok=False, timeout=180)


# Resumes of copies of the patience run's checkpoints, each with one thing wrong: name -> (what was done to the
# latest checkpoint, exit status). Where a file is crafted, the manifest is re-signed so that the checkpoint looks
# whole.
DAMAGED = {
    "callback_states_1.pt crafted": 1,
    "callback_states_0.pt crafted": 1,
    "a callback's load_state_dict raises on rank 1": 1,
    "a step folder linked to another run's, named by latest": 0,
    "keep_best's record edited": 1,
    "rank 1's random states unloadable": 0,
    "rank 1's random states missing": 0,
    "a damaged latest set aside, then a save that cannot be written": 1,
    "the average's index removed": 1,
    "an index placing tensors in another run's shard": 1,
    "no checkpoint, the first save's folder blocked": 1,
}


@pytest.fixture(scope="module")
def damaged(patience_run, tmp_path_factory) -> dict[str, tuple[Path, int, str, str]]:
    """Every case of DAMAGED in one launch of 2 processes (tests/jobs/run_many.py), an average of the weights kept (its
    part is read by every rank together, after the callbacks'): name -> (its output_dir, exit status, stdout,
    stderr). A case that left one rank waiting would time the launch out (120 s)."""
    root, base = tmp_path_factory.mktemp("damaged"), patience_run[0] / "checkpoints"
    other = root / "other" / "checkpoints" / "step-00000008"
    shutil.copytree(base / "step-00000008", other)
    folders, jobs = {}, []
    for i, name in enumerate(DAMAGED):
        out = folders[name] = root / f"case{i}"
        args = ["--fail_load_rank", "1"] if "load_state_dict raises" in name else []
        jobs.append([str(SCENARIOS), "patience", "--output_dir", str(out), "--ema_decay", "0.9", *args])
        if name.startswith("no checkpoint"):
            (out / "checkpoints").mkdir(parents=True)
            (out / "checkpoints" / ".tmp-step-00000002").write_text("not a folder")
            continue
        shutil.copytree(base, out / "checkpoints")
        latest = out / "checkpoints" / "step-00000010"
        if name.endswith(".pt crafted"):
            torch.save({"Remembers": Path("/etc/passwd")}, latest / name.split()[0])
        elif name.startswith("a step folder linked"):
            (out / "checkpoints" / "step-00000099").symlink_to(other)
            (out / "checkpoints" / "latest").write_text("step-00000099")
        elif name.startswith("keep_best"):
            state = json.loads((latest / "trainer_state.json").read_text())
            state["best"] = {"figure": "eval_loss", "value": 1.0, "step": "abc"}
            (latest / "trainer_state.json").write_text(json.dumps(state))
        elif name == "rank 1's random states unloadable":
            torch.save({"random_state": Path("/etc/passwd")}, latest / "random_states_1.pkl")
        elif name == "rank 1's random states missing":  # the manifest still lists it
            (latest / "random_states_1.pkl").unlink()
            continue
        elif name.startswith("a damaged latest"):  # resumed from step 8, step 10's save blocked by a file
            (latest / "random_states_1.pkl").unlink()
            (out / "checkpoints" / ".tmp-step-00000010").write_text("not a folder")
            continue
        elif name.startswith("the average's index"):
            (latest / "ema" / "shards" / ".metadata").unlink()
        elif name.startswith("an index"):
            index = pickle.loads((latest / "shards" / ".metadata").read_bytes())
            for info in index.storage_data.values():
                info.relative_path = str(other / "shards" / "__0_0.distcp")
            (latest / "shards" / ".metadata").write_bytes(pickle.dumps(index))
        resign(latest)
    launched = accelerate_launch(JOBS, json.dumps(jobs), num_processes=2, expect_ok=False, timeout=120)
    exits = job_exits(launched.stderr, len(DAMAGED))
    outs, errs = split_jobs(launched.stdout), split_jobs(launched.stderr)
    return {name: (folders[name], *ran) for name, *ran in zip(DAMAGED, exits, outs, errs, strict=True)}


def test_a_failed_export_is_one_line_from_every_rank_and_leaves_the_checkpoints(patience_run):
    """The run's final export cannot be written: one line, every rank exits, the checkpoints whole (a raw OSError
    from the main process's mkdir before, and the other rank's raw gloo traceback)."""
    base, ended = patience_run
    said = trainer_lines(ended.stderr)
    expected = f"[rank0]: trainer: cannot write the export into {base / 'final'}: File exists; it was left as it was"
    assert said == [f"{expected} before"], ended.stderr
    assert "[rank0]: Traceback" not in ended.stderr and "[rank1]: Traceback" not in ended.stderr, ended.stderr
    assert (base / "checkpoints" / "latest").read_text() == "step-00000010" and not (base / "final").exists()
    # Said at the start, on the banner: the run may end before max_steps.
    assert "early stopping on eval_loss (patience 3 evaluations)" in ended.stdout, ended.stdout


def test_a_checkpoint_holds_a_stateful_callback_as_of_its_steps_end(patience_run, damaged):
    """Step 10's checkpoint is written after step 10's on_step_end: a callback counting steps holds 10 (9 before,
    and a resume from it had seen one step fewer than the run had taken, at every resume); resumed, it goes on
    from 10."""
    base, _ = patience_run
    for rank in (0, 1):
        saved = torch.load(base / "checkpoints" / "step-00000010" / f"callback_states_{rank}.pt", weights_only=True)
        assert saved["Remembers"]["steps"] == 10, saved
    out, status, stdout, _ = damaged["rank 1's random states unloadable"]
    begin = [json.loads(line.split(" ", 2)[2]) for line in stdout.splitlines() if line.startswith("BEGIN ")]
    assert status == 0 and [(row["step"], row["steps"]) for row in begin] == [(10, 10)] * 2, begin


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_resume_ends_as_it_should_on_every_rank_in_one_line(damaged, name):
    """Each case's exit status and its one line. One rank alone refusing (a crafted callback_states_1.pt or _0.pt,
    a callback raising on rank 1) hung the job before, rank 0 training on or waiting in the next collective: every
    rank now ends at once, the line naming that rank and the file."""
    out, status, stdout, stderr = damaged[name]
    assert status == DAMAGED[name], (name, stderr[-3000:])
    said = trainer_lines(stderr)
    assert "[rank0]: Traceback" not in stderr and "[rank1]: Traceback" not in stderr, (name, stderr[-3000:])
    if status:  # one line (after the warning of a damaged latest set aside, where there is one)
        assert len([line for line in said if "continuing from the newest whole" not in line]) == 1, (name, said)
    # Refused while resuming: no rank went on to train (those refused at a save trained first).
    trained = status == 0 or name.startswith(("no checkpoint", "a damaged latest"))
    assert ("BEGIN" in stdout) == trained, (name, stdout[-2000:])
    latest = out / "checkpoints" / "step-00000010"
    expected = {
        "callback_states_1.pt crafted": "callback_states_1.pt: Unsupported global: GLOBAL pathlib.PosixPath",
        "callback_states_0.pt crafted": "callback_states_0.pt: Unsupported global: GLOBAL pathlib.PosixPath",
        "a callback's load_state_dict raises on rank 1": "'Remembers cannot take this state' (rank 1)",
        "a step folder linked to another run's, named by latest": "step-00000099 is not to be trusted: it is a symb",
        "keep_best's record edited": f"checkpoint {latest}: the 'best' state in trainer_state.json cannot be used",
        "rank 1's random states unloadable": "random_states_1.pkl cannot be loaded safely",
        "rank 1's random states missing": "random_states_1.pkl is missing or truncated; continuing from the newest",
        "the average's index removed": f"checkpoint {latest}: ema/ holds no whole average of the weights",
        # The one resumed from: step 10 (set aside) was said to be "still the latest" before.
        "a damaged latest set aside, then a save that cannot be written": "removed; "
        f"{latest.parent / 'step-00000008'} is still the latest.",
        "an index placing tensors in another run's shard": "not within a file of its own shards folder: the checkpo",
        "no checkpoint, the first save's folder blocked": "could not write checkpoint step-00000002: NotADirectoryE",
    }[name]
    assert len([line for line in said if expected in line]) == 1, (name, said)
    if name.endswith(".pt crafted"):
        assert said[0].endswith(f"(rank {name[16]})"), said
    if name.startswith("a step folder linked"):
        assert f"resumed from {latest}: step 10" in stdout, stdout
        assert (out / "checkpoints" / "step-00000099").is_symlink(), "not pruned"
    if name.startswith("no checkpoint"):
        assert said[0].endswith("The unfinished folder was removed; none was written before."), said


def crafted_adapter_checkpoint(root: Path, crafted: str) -> Path:
    """A committed checkpoint of a PEFT GPT-2 whose config.json or adapter_config.json was edited (``crafted``)."""
    from transformers import GPT2Config

    from trainer.checkpoint import store

    staging = store.staging_folder(root, 1)
    staging.mkdir(parents=True)
    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2).to_dict()
    config["architectures"] = ["GPT2LMHeadModel"]
    adapter = {"peft_type": "LORA", "r": 2, "target_modules": ["c_attn"], "task_type": "CAUSAL_LM"}
    if crafted == "auto_map and its code":
        # A model type transformers does not have: only the checkpoint's own code could build it.
        config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
        (staging / "evil.py").write_text(f"open({str(root.parent / 'ran')!r}, 'w')\n")
    elif crafted == "a function for a class":
        config["architectures"] = ["pipeline"]
    else:
        adapter["peft_type"] = "EVIL"
    (staging / "config.json").write_text(json.dumps(config))
    (staging / "adapter_config.json").write_text(json.dumps(adapter))
    save_file({"x": torch.zeros(1)}, staging / "model.safetensors")
    return store.commit(staging, {"train": {"global_step": 1, "epoch": 0, "batches_into_epoch": 1}}, keep_last=1)


def test_a_crafted_config_in_a_checkpoint_is_one_line_from_the_export_and_runs_nothing(tmp_path):
    """``python -m trainer.export <ckpt> <dir> --merged`` (three in one process, tests/jobs/run_many.py) builds the base
    model from the checkpoint's config.json: code it names (auto_map) is refused, not asked about on stdin (a raw
    EOFError, or one ``y`` from running it); an architecture that is no model class (``pipeline``) is not called (a
    raw TypeError); an adapter config PEFT cannot read (a raw KeyError): one line naming the checkpoint each."""
    cases = ["auto_map and its code", "a function for a class", "an unknown peft_type"]
    folders = [crafted_adapter_checkpoint(tmp_path / str(i) / "checkpoints", case) for i, case in enumerate(cases)]
    export = ROOT / "trainer" / "export.py"
    jobs = [[str(export), str(folder), str(folder.parent.parent / "merged"), "--merged"] for folder in folders]
    result = python(JOBS, json.dumps(jobs), expect_ok=False)
    assert job_exits(result.stderr, 3) == [1, 1, 1], result.stderr
    for case, folder, said in zip(cases, folders, split_jobs(result.stderr), strict=True):
        lines = trainer_lines(said)
        assert len(lines) == 1 and str(folder) in lines[0] and "Traceback" not in said, (case, said)
        assert not (folder.parent.parent / "merged").exists(), case
    assert not any(tmp_path.glob("*/ran")), "the checkpoint's code ran"
