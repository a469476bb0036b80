"""The checkpoint store (trainer/checkpoint/store.py), in-process: a commit is a rename and a pointer written last, the
manifest catches a truncated or damaged file, pointers lead nowhere but a step folder beside them, damaged
checkpoints are set aside, keep_last spares the best. tests/checkpoint/test_checkpoint.py runs the same through real
processes, crashes and kills included."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from trainer import CheckpointError
from trainer.checkpoint import integrity, store


def commit(root: Path, step: int, keep_last: int = 2, best: int | None = None, payload: bytes = b"weights") -> Path:
    """Step ``step`` committed as the trainer commits it; ``best``: the step keep_best's record names then."""
    staging = store.staging_folder(root, step)
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(payload)
    state = {
        "train": {"global_step": step, "epoch": 0, "batches_into_epoch": step, "run_id": "x"},
        "best": {"figure": "eval_loss", "value": 1.0, "step": best} if best is not None else None,
    }
    return store.commit(staging, state, keep_last)


def test_a_commit_renames_the_folder_then_moves_the_pointer_and_lists_every_file(tmp_path):
    root = tmp_path / "checkpoints"
    folder = commit(root, 4)
    assert folder == root / "step-00000004" and (root / "latest").read_text() == "step-00000004"
    state = integrity.read_state(folder)
    assert state["files"] == {"model.safetensors": 7} and set(state["crc32"]) == {"model.safetensors"}
    assert store.latest_checkpoint(root) == folder and not list(root.glob(".tmp-*"))


def test_the_manifest_names_a_truncated_or_damaged_file(tmp_path):
    folder = commit(tmp_path / "checkpoints", 4)
    (folder / "model.safetensors").write_bytes(b"weighs!")  # the same size: only the CRC tells
    with pytest.raises(CheckpointError, match="model.safetensors does not hold what was written"):
        integrity.verify(folder)
    integrity.verify(folder, contents=False)  # sizes alone: every rank checks those
    (folder / "model.safetensors").write_bytes(b"w")
    with pytest.raises(CheckpointError, match="is torn: model.safetensors is missing or truncated"):
        integrity.verify(folder, contents=False)


def test_a_state_file_that_is_not_a_trainer_state_is_named(tmp_path):
    folder = commit(tmp_path / "checkpoints", 4)
    state = json.loads((folder / "trainer_state.json").read_text())
    del state["train"]["epoch"]
    (folder / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"is not a trainer state \(no valid train.epoch\)"):
        integrity.read_state(folder)


@pytest.mark.parametrize("raw", [b"../other/checkpoints/step-00000003", b"\xff\xfe", b"", b"step-4; rm -rf /"])
def test_a_pointer_leads_only_to_a_step_folder_beside_it(tmp_path, raw):
    pointer = tmp_path / "latest"
    pointer.write_bytes(raw)
    with pytest.raises(CheckpointError, match="pointer .* is corrupt"):
        store.pointed_at(pointer)


def test_resume_auto_sets_a_damaged_latest_aside_and_takes_the_newest_whole_one(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    commit(root, 4)
    damaged = commit(root, 8)
    (damaged / "model.safetensors").write_bytes(b"WEIGHTS")
    assert store.newest_whole_checkpoint(root) == root / "step-00000004"
    assert (root / "damaged-step-00000008").is_dir() and not damaged.exists()
    assert "continuing from the newest whole checkpoint" in capsys.readouterr().err


def test_a_damaged_latest_in_a_read_only_folder_is_left_in_place_and_said(tmp_path, capsys, monkeypatch):
    root = tmp_path / "checkpoints"
    commit(root, 4)
    damaged = commit(root, 8)
    (damaged / "model.safetensors").write_bytes(b"WEIGHTS")
    root.chmod(0o555)
    if os.access(root, os.W_OK):  # root ignores permissions: the move fails as on a read-only disk

        def read_only(source, destination):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(source))

        monkeypatch.setattr(store.os, "replace", read_only)
    try:
        assert store.newest_whole_checkpoint(root) == root / "step-00000004"
    finally:
        root.chmod(0o755)
    assert damaged.is_dir(), "left in place"
    said = capsys.readouterr().err
    assert "continuing from the newest whole checkpoint" in said and "step-00000008 damaged, left in place" in said


@pytest.mark.parametrize("how", ["a link to a file outside", "a link among its files", "a manifest leading out"])
def test_nothing_outside_a_checkpoint_is_read_and_no_link_followed(tmp_path, how):
    folder = commit(tmp_path / "checkpoints", 4)
    outside = tmp_path / "passwd"
    outside.write_bytes(b"weights")  # the size the manifest expects: only the link gives it away
    state = json.loads((folder / "trainer_state.json").read_text())
    if how == "a link to a file outside":
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").symlink_to(outside)
        del state["crc32"]  # a manifest of the older, sizes-only kind
        match = "model.safetensors is a symbolic link"
    elif how == "a link among its files":
        (folder / "extra").symlink_to(outside)
        match = "extra is a symbolic link"
    else:
        state["files"][str(outside)] = 7
        state["files"]["../../passwd"] = 7
        match = "its manifest lists .* outside its folder"
    (folder / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=match):
        integrity.verify(folder, contents=False)


def test_keep_last_prunes_the_oldest_and_spares_the_best(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        commit(root, step, keep_last=1, best=2)
    assert sorted(p.name for p in root.iterdir()) == ["best", "latest", "step-00000002", "step-00000008"]
    assert store.best_checkpoint(root, {"step": 2}) == root / "step-00000002"
    assert store.pointed_at(root / "best") == "step-00000002"


def test_the_best_pointer_follows_this_runs_record_not_an_abandoned_timeline_or_damage(tmp_path):
    """Rolled back to step 8 of a run whose best was step 12: the pointer names step 8, the record's, at the next
    commit (it named the abandoned step 12). A damaged pointer is rewritten, and the best checkpoint it should have
    named is spared by keep_last all the same."""
    root = tmp_path / "checkpoints"
    for step in (4, 8, 12):
        commit(root, step, keep_last=5, best=step)
    assert store.pointed_at(root / "best") == "step-00000012"
    commit(root, 8, keep_last=5, best=8)  # the resumed run saves step 8 again, its record the step-8 evaluation
    assert store.pointed_at(root / "best") == "step-00000008"
    (root / "best").write_bytes(b"garbage")
    for step in (10, 14, 16):
        commit(root, step, keep_last=1, best=4)
    assert store.pointed_at(root / "best") == "step-00000004" and (root / "step-00000004").is_dir()
    commit(root, 18, keep_last=1, best=None)  # no record (another figure, or none yet): no pointer at all
    assert not (root / "best").exists()


def test_saving_a_step_again_keeps_a_whole_checkpoint_named_by_latest(tmp_path):
    root = tmp_path / "checkpoints"
    commit(root, 4, payload=b"first")
    commit(root, 4, payload=b"second!")  # a run resumed from an older checkpoint saves step 4 again
    assert (root / "step-00000004" / "model.safetensors").read_bytes() == b"second!"
    assert not (root / ".old-step-00000004").exists()


def test_a_checkpoint_written_before_the_registry_still_reads(tmp_path):
    """A trainer_state.json of the earlier layout (every key at the top) reads as today's."""
    folder = commit(tmp_path / "checkpoints", 4)
    state = json.loads((folder / "trainer_state.json").read_text())
    flat = {
        "global_step": 4,
        "epoch": 0,
        "batches_into_epoch": 4,
        "run_id": "x",
        "world_size": 2,
        "batch_size": 4,
        "gradient_accumulation_steps": 1,
        "config": {},
        "sharding": "FSDP2",
        "best": None,
        "files": state["files"],
        "crc32": state["crc32"],
    }
    (folder / "trainer_state.json").write_text(json.dumps(flat))
    read = integrity.read_state(folder)
    assert read["train"]["global_step"] == 4 and read["run"]["world_size"] == 2 and read["sharding"] == "FSDP2"


@pytest.mark.parametrize("latest", ["names the link", "is missing"])
def test_a_step_folder_that_is_a_link_is_never_taken_counted_or_pruned_around(tmp_path, capsys, latest):
    """``ln -s <another run>/checkpoints/step-12 checkpoints/step-99``: neither ``latest`` naming it nor the fallback
    when ``latest`` is gone takes it, keep_last neither counts it nor prunes around it, and the other run's checkpoint
    is left as it was."""
    other = commit(tmp_path / "other" / "checkpoints", 12)
    root = tmp_path / "run" / "checkpoints"
    commit(root, 8, keep_last=2)
    commit(root, 12, keep_last=2)
    (root / "step-00000099").symlink_to(other)
    if latest == "names the link":
        (root / "latest").write_text("step-00000099")
        assert store.newest_whole_checkpoint(root) == root / "step-00000012"
        said = capsys.readouterr().err
        assert "step-00000099 is not to be trusted: it is a symbolic link" in said, said
    else:
        (root / "latest").unlink()
        assert store.latest_checkpoint(root) == root / "step-00000012"
    assert integrity.complete_checkpoints(root) == [root / "step-00000008", root / "step-00000012"]
    commit(root, 16, keep_last=2)
    assert [p.name for p in integrity.complete_checkpoints(root)] == ["step-00000012", "step-00000016"]
    assert integrity.verify(other) == other, "the other run's checkpoint is untouched"
    with pytest.raises(CheckpointError, match="is a symbolic link .* Pass the folder it names as resume=<path>"):
        store.resume_point(root, str(root / "step-00000099"))


def test_a_latest_pointer_that_is_a_link_is_not_read_nor_printed(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    root = tmp_path / "checkpoints"
    commit(root, 4)
    (root / "latest").unlink()
    (root / "latest").symlink_to(secret)
    with pytest.raises(CheckpointError, match="pointer .* is a symbolic link") as refused:
        store.latest_checkpoint(root)
    assert "root:x" not in str(refused.value)
