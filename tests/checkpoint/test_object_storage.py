"""Checkpoints in object storage (``checkpoint_storage: s3://...``, trainer/checkpoint/bucket.py), against moto's S3
server on loopback: each rank uploads its share, the manifest is written last and the pointer after it, an upload cut
short is never a checkpoint, a damaged object is found before anything reads it, keep_last and keep_best prune and
spare in the bucket; through real processes (DDP and FSDP2, 2 each) a crashed run and one killed with SIGKILL in the
middle of an upload resume from the bucket bit-identical to a run never interrupted, and ``python -m trainer.export``
reads a checkpoint straight from the bucket. Skipped where moto or s3fs is not installed (the test extra has both)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import ROOT, clean_env, free_port, launch_command, run

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None,
    reason="needs moto and s3fs: pip install -e '.[test]'",
)
RAGGED = ROOT / "tests" / "jobs" / "ragged_lm.py"
FLAGS = ["--batch_size", "4", "--optimizer", "adamw", "--lr", "0.01", "--save_every", "2", "--max_steps", "12"]
BUCKET = "checkpoints"


class S3:
    """moto's S3 server on a loopback port, in this process: ``env`` points a job at it (botocore reads
    ``AWS_ENDPOINT_URL``); ``kill`` makes it SIGKILL a job's every process when an upload reaches a key, ``pause``
    hold the first download of a key for some seconds, as a server that stops answering for a while."""

    def __init__(self):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.app = DomainDispatcherApplication(create_backend_app)
        self.kill: dict = {}  # "key": a part of the key; "after": PUTs to let through first; "pid": the job's
        self.refuse = "/refused/step-00000004/"  # PUTs to these keys are answered 403
        self.killed: list[str] = []
        # PUTs to the kill's key being stored: s3fs sends a rank's files at once, and a kill while they stream would
        # leave none of them (a torn upload with no object), as on a loaded host.
        self.storing, self.stored = 0, threading.Condition()
        self.pause: dict = {}  # "key": a part of the key; "s": seconds
        self.server = make_server("127.0.0.1", free_port(), self.serve, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self.credentials = dict(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")
        os.environ.update(self.credentials, AWS_ENDPOINT_URL=self.endpoint)
        import fsspec

        self.fs = fsspec.filesystem("s3", skip_instance_cache=True)
        self.fs.mkdir(BUCKET)

    def serve(self, environ, start_response):
        if environ["REQUEST_METHOD"] == "PUT" and self.refuse in environ["PATH_INFO"]:
            start_response("403 Forbidden", [("Content-Type", "application/xml")])
            return [b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"]
        pause = self.pause
        if environ["REQUEST_METHOD"] == "GET" and pause and pause["key"] in environ["PATH_INFO"]:
            self.pause = {}
            time.sleep(pause["s"])
        kill = self.kill
        if environ["REQUEST_METHOD"] == "PUT" and kill and kill["key"] in environ["PATH_INFO"]:
            kill["after"] -= 1
            if kill["after"] >= 0:
                return self.store(environ, start_response)
            if kill.get("pid"):
                # The PUTs let through are stored first; then the launcher and every worker (torch's launcher starts
                # them in sessions of their own).
                with self.stored:
                    self.stored.wait_for(lambda: not self.storing, timeout=60)
                job = psutil.Process(kill["pid"])
                for process in [job, *job.children(recursive=True)]:
                    process.send_signal(signal.SIGKILL)
                self.killed.append(environ["PATH_INFO"])
                self.kill = {}
        return self.app(environ, start_response)

    def store(self, environ, start_response):
        with self.stored:
            self.storing += 1
        try:
            return self.app(environ, start_response)
        finally:
            with self.stored:
                self.storing -= 1
                self.stored.notify_all()

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(AWS_ENDPOINT_URL=self.endpoint, **self.credentials, **extra)

    def keys(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache()
        return [key.removeprefix(f"{BUCKET}/{prefix}/") for key in self.fs.find(f"{BUCKET}/{prefix}")]


@pytest.fixture(scope="module")
def s3():
    saved = dict(os.environ)
    server = S3()
    yield server
    server.server.shutdown()
    os.environ.clear()
    os.environ.update(saved)


def launch(s3: S3, out, variants: dict, *, config: str = "multi_gpu.yaml", killed_at: dict | None = None, **kw):
    """One accelerate launch of tests/jobs/ragged_lm.py's ``variants`` (each in ``out/<name>``); with ``killed_at``,
    killed by the server there (its output returned)."""
    command = launch_command(RAGGED, "--out", out, "--variants", json.dumps(variants), *FLAGS, config=config)
    if killed_at is None:
        return run(command, env=s3.env(), **kw)
    job = subprocess.Popen(
        command, cwd=ROOT, env=s3.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    s3.kill = {**killed_at, "pid": job.pid}
    output = job.communicate(timeout=300)[0]
    assert job.returncode != 0 and s3.killed, output[-3000:]
    return output


def summary(out) -> dict:
    return json.loads((out / "ragged.json").read_text())


def test_ddp_a_crashed_run_resumes_from_the_bucket_bit_identical_and_keep_best_reads_the_best_back(s3, tmp_path):
    """2 processes (DDP): the last rank dies after step 7; run again, the job downloads step 6 from the bucket and
    ends with the weights of the run never interrupted. Only the last two checkpoints stay in the bucket; the local
    output_dir holds no checkpoint. A store that refuses an upload is named, the last checkpoint kept. With keep_best
    (the highest eval loss: step 6's), step 6 is spared and read back from the bucket at the end, as from a disk.
    The server pausing 8 s while the resume downloads, the stall reporter says so (stall_warning_s 2)."""
    url = f"s3://{BUCKET}/ddp"
    straight = ["--storage", f"{url}/straight"]
    crashed = ["--storage", f"{url}/crashed", "--crash_at", "7", "--crash_once"]
    best = ["--eval", "--eval_examples", "8", "--best"]
    variants = {"straight": straight, "best": [*best, "--storage", f"{url}/best"], "best on disk": best}
    variants["refused"] = ["--storage", f"{url}/refused", "--expect_refusal"]  # the server refuses step 4's uploads
    variants["in the background"] = ["--storage", f"{url}/background", "--save_async"]
    first = launch(s3, tmp_path, {**variants, "crashed": crashed}, expect_ok=False)
    assert "CRASH after step 7" in first.stdout, first.stdout[-3000:] + first.stderr[-3000:]
    assert s3.fs.cat(f"{BUCKET}/ddp/crashed/latest") == b"step-00000006"
    # The server stops answering for 8 s while the resume downloads: the stall reporter speaks (nothing did).
    s3.pause = {"key": "/ddp/crashed/step-00000006/shards/", "s": 8}
    again = launch(s3, tmp_path, {"crashed": [*crashed, "--stall_warning_s", "2"]})
    assert f"downloaded {url}/crashed/step-00000006 into" in again.stdout, again.stdout[-3000:]
    assert "s: rank 0 (" in again.stderr and " resuming from a checkpoint since " in again.stderr, again.stderr[-3000:]
    assert "Every rank is at the same place (resuming from a checkpoint): a long resume" in again.stderr
    assert "resumed from" in again.stdout and ": step 6, " in again.stdout
    assert summary(tmp_path / "crashed")["weights"] == summary(tmp_path / "straight")["weights"]
    kept = {key.split("/")[0] for key in s3.keys("ddp/straight")}
    assert kept == {"step-00000010", "step-00000012", "latest", ".owner"}, kept
    assert not list((tmp_path / "straight" / "checkpoints").glob("step-*"))
    assert not list((tmp_path / "crashed" / "checkpoints").glob("**/*.distcp"))  # the download removed once read
    assert first.stdout.count("load_best_at_end: final/ holds the weights of step 6") == 2
    assert {key.split("/")[0] for key in s3.keys("ddp/best")} == {"step-00000006", "step-00000010", "step-00000012",
                                                                   "latest", "best", ".owner"}  # fmt: skip
    assert summary(tmp_path / "best")["weights"] == summary(tmp_path / "best on disk")["weights"]
    refused = summary(tmp_path / "refused")["refused"]
    assert refused.startswith(f"could not upload checkpoint step-00000004 to {url}/refused: PermissionError: ")
    assert refused.endswith(f"; {url}/refused/step-00000002 is still the latest"), refused
    assert not list((tmp_path / "refused" / "checkpoints").iterdir())  # its staging folder removed
    # save_async: each rank uploads from a thread of its own once its shards are written; the same checkpoints.
    assert summary(tmp_path / "in the background")["weights"] == summary(tmp_path / "straight")["weights"]
    assert {key.split("/")[0] for key in s3.keys("ddp/background")} == kept


def test_fsdp2_killed_during_an_upload_resumes_from_the_last_committed_and_exports_from_the_bucket(s3, tmp_path):
    """2 processes (FSDP2): SIGKILL to the whole job while step 6's files are being uploaded (the server kills it at
    the third object): step 6 is objects without a manifest, ``latest`` still names step 4, and the run started
    again resumes from step 4 (never the partial one) to the weights of the run never interrupted. Its last
    checkpoint exports from the bucket to a file whose tensors are the trained weights."""
    url = f"s3://{BUCKET}/fsdp"
    killed = ["--storage", f"{url}/killed"]
    at = {"key": "/fsdp/killed/step-00000006/", "after": 2}
    output = launch(s3, tmp_path, {"killed": killed}, config="fsdp.yaml", killed_at=at)
    partial = s3.keys("fsdp/killed/step-00000006")
    assert partial and "trainer_state.json" not in partial, (partial, output[-3000:])
    assert s3.fs.cat(f"{BUCKET}/fsdp/killed/latest") == b"step-00000004"
    both = launch(s3, tmp_path, {"straight": ["--storage", f"{url}/straight"], "killed": killed}, config="fsdp.yaml")
    assert f"downloaded {url}/killed/step-00000004 into" in both.stdout, both.stdout[-3000:]
    assert "device cpu (FSDP2)" in both.stdout
    resumed, straight = summary(tmp_path / "killed"), summary(tmp_path / "straight")
    assert resumed["weights"] == straight["weights"]
    export = run([sys.executable, "-m", "trainer.export", f"{url}/killed/step-00000012", tmp_path / "export"],
                 env=s3.env())  # fmt: skip
    assert f"exported {url}/killed/step-00000012" in export.stdout
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert {name: exported[name].flatten().tolist() for name in resumed["weights"]} == resumed["weights"]


def commit(bucket, tmp_path, step: int, *, keep_last: int = 2, best: int | None = None, payload: bytes = b"shard"):
    """Step ``step`` uploaded and committed as the trainer does it (one rank); ``best``: keep_best's step then."""
    staging = tmp_path / f".tmp-step-{step:08d}"
    (staging / "shards").mkdir(parents=True, exist_ok=True)
    (staging / "shards" / "__0_0.distcp").write_bytes(payload)
    name = staging.name.removeprefix(".tmp-")
    bucket.clear(name)
    sent = bucket.upload(staging, ["shards/__0_0.distcp"])
    state = {
        "train": {"global_step": step, "epoch": 0, "batches_into_epoch": step, "run_id": "x"},
        "best": {"figure": "eval_loss", "value": 1.0, "step": best} if best is not None else None,
    }
    return bucket.commit(name, state, uploaded=sent, keep_last=keep_last)


def test_an_upload_cut_short_is_never_resumed_and_a_damaged_checkpoint_is_set_aside(s3, tmp_path, capsys):
    from trainer import CheckpointError
    from trainer.checkpoint.bucket import Bucket

    bucket = Bucket(f"s3://{BUCKET}/cut-short")
    commit(bucket, tmp_path, 2)
    commit(bucket, tmp_path, 4)
    # Step 4 saved again (a run resumed from step 2), killed after its old manifest went and one object came.
    bucket.clear("step-00000004")
    bucket.upload(tmp_path / ".tmp-step-00000004", ["shards/__0_0.distcp"])
    assert bucket.committed() == ["step-00000002"] and bucket.pointer() == "step-00000004"
    found = bucket.resume_point("auto", tmp_path / "downloads")
    assert found == tmp_path / "downloads" / "step-00000002"
    assert (found / "shards" / "__0_0.distcp").read_bytes() == b"shard"
    said = capsys.readouterr().err
    assert "checkpoint s3://checkpoints/cut-short/step-00000004 is torn: it has no trainer_state.json" in said
    assert "continuing from the newest whole checkpoint, s3://checkpoints/cut-short/step-00000002" in said
    s3.fs.pipe(f"{BUCKET}/cut-short/step-00000002/shards/__0_0.distcp", b"shard!"[1:])  # the same size
    with pytest.raises(CheckpointError, match="step-00000004 is torn: .*, and no other checkpoint under .* is whole"):
        bucket.resume_point("auto", tmp_path / "downloads")
    assert "trainer_state.json.damaged" in s3.keys("cut-short/step-00000002") and not bucket.committed()
    with pytest.raises(CheckpointError, match="already holds checkpoints of an earlier run"):
        Bucket(f"s3://{BUCKET}/cut-short").resume_point(None, tmp_path)


def test_keep_last_prunes_in_the_bucket_and_spares_the_best_which_the_best_pointer_names(s3, tmp_path):
    from trainer.checkpoint.bucket import Bucket

    bucket = Bucket(f"s3://{BUCKET}/pruned")
    for step in (2, 4, 6, 8):
        url = commit(bucket, tmp_path, step, best=2)
    assert url == f"s3://{BUCKET}/pruned/step-00000008" and bucket.pointer() == "step-00000008"
    assert bucket.committed() == ["step-00000002", "step-00000006", "step-00000008"]
    assert not s3.keys("pruned/step-00000004") and bucket.pointer("best") == "step-00000002"
    assert bucket.best_url({"step": 2}) == f"s3://{BUCKET}/pruned/step-00000002"
    commit(bucket, tmp_path, 10)  # a record of another timeline (none): no best pointer, step 2 no longer spared
    assert bucket.committed() == ["step-00000008", "step-00000010"] and bucket.pointer("best") is None


def test_a_second_job_saving_to_the_same_folder_takes_it_over_and_the_first_stops_at_its_next_save(s3, tmp_path):
    """A bucket has no lock that goes with a process: the job that saved last owns the folder (a job started again
    after a crash takes it over), and an older one still running stops at its next save, deleting nothing."""
    from trainer import CheckpointError
    from trainer.checkpoint.bucket import Bucket

    first, second = Bucket(f"s3://{BUCKET}/two-jobs"), Bucket(f"s3://{BUCKET}/two-jobs")
    commit(first, tmp_path, 2)
    commit(second, tmp_path / "second", 4)
    taken = r"checkpoint_storage s3://checkpoints/two-jobs was taken over by another job \(\w+ \(pid \d+ on "
    with pytest.raises(CheckpointError, match=taken + r".*\): checkpoint step-00000004 was not committed"):
        commit(first, tmp_path, 4)
    assert second.committed() == ["step-00000002", "step-00000004"] and second.pointer() == "step-00000004"
    assert (second.fetch("step-00000004", tmp_path / "read") / "shards" / "__0_0.distcp").is_file()


def test_a_bucket_that_cannot_be_written_a_corrupt_pointer_and_a_wrong_setting_are_named(s3, tmp_path):
    from trainer import CheckpointError, ConfigError, TrainConfig
    from trainer.checkpoint.bucket import Bucket
    from trainer.checkpoint.transfers import shares

    with pytest.raises(CheckpointError, match="checkpoint_storage s3://no-such-bucket/run cannot be written"):
        Bucket.checked("s3://no-such-bucket/run")
    s3.fs.pipe(f"{BUCKET}/pointed/latest", b"../other-run/step-00000004")
    with pytest.raises(CheckpointError, match=r"the latest pointer s3://checkpoints/pointed/latest is corrupt"):
        Bucket(f"s3://{BUCKET}/pointed").resume_point("auto", tmp_path)
    with pytest.raises(ConfigError, match="checkpoint_storage must be an object store's URL"):
        TrainConfig(checkpoint_storage="runs/bucket")
    with pytest.raises(ConfigError, match="resume is a URL"):
        TrainConfig(resume="s3://checkpoints/run/step-00000002")
    # Each file sent once, by a rank that sees it, the work spread: machine 0 (ranks 0, 1) shares a disk.
    given = shares([["a", "b", "c"], ["a", "b", "c"], ["d", "e"]])
    assert sorted(sum(given, [])) == ["a", "b", "c", "d", "e"] and all(given)
    assert set(given[0] + given[1]) == {"a", "b", "c"} and set(given[2]) == {"d", "e"}


def test_the_preflight_asks_every_rank_to_write_to_the_bucket(s3, tmp_path):
    """``trainer.check --checkpoint_storage`` inside a 2-process launch: a bucket that does not exist is one PROBLEM
    line per rank, naming it, and exit 1 (the good bucket's word is the launches' above: they start by writing)."""
    command = launch_command(ROOT / "trainer" / "tools" / "preflight.py", "--checkpoint_storage", "s3://no-such/run")
    command += ["--output_dir", str(tmp_path)]
    checked = run(command, env=s3.env(), expect_ok=False)
    for rank in (0, 1):
        assert f"PROBLEM: rank {rank} (" in checked.stdout, checked.stdout + checked.stderr[-2000:]
    assert checked.stdout.count("checkpoint_storage s3://no-such/run cannot be written: ") == 2
