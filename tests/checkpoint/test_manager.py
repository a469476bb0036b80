"""The checkpoint manager and its parts against a run of one process, in this pytest process: what a checkpoint holds
under every strategy (DCP's shards, accelerate's schedule and random states, the plain parts in trainer_state.json),
a resume that puts every part back, and a checkpoint the trainer wrote before every strategy wrote DCP."""

from __future__ import annotations

import json
import pickle
import resource
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer import CheckpointError, EarlyStopping, TrainConfig, Trainer
from trainer.checkpoint.best import KeepBest
from trainer.checkpoint.export import export
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.parts import AccelerateState, CallbackStates, ModelPart, kept_stager
from trainer.checkpoint.policy import RunSetup
from trainer.checkpoint.safe_dcp import read_sharded_weights
from trainer.errors import ExportError, ShardingError
from trainer.launch.run import Run
from trainer.loop.callbacks import stateful
from trainer.loop.microbatch import MicroBatchSplit
from trainer.optim import build as optim
from trainer.parallel.placement import whole_on_device
from trainer.state import TrainState

from conftest import resign

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "fixtures"


def parts_of(run: Run, model: torch.nn.Module, callbacks: list) -> tuple[Checkpointer, TrainState, object]:
    built = optim.build(model, run.config, optimizer=None, lr_scheduler=None, total_steps=10)
    state, best = TrainState(8, 1, run_id="unit"), KeepBest(run.config)
    parts = {
        "model": ModelPart(run, model, built.optimizer),
        "accelerate": AccelerateState(run, built.scheduler),
        "train": state,
        "best": best,
        "callbacks": CallbackStates(run, callbacks, named=stateful),
        "data": None,
    }
    return Checkpointer(run, parts=parts, setup=RunSetup(run, built), best=best), state, built


def step(model: torch.nn.Module, built) -> None:
    model(torch.ones(2, 4)).sum().backward()
    built.optimizer.step()
    built.scheduler.step()
    built.optimizer.zero_grad()


def test_a_checkpoint_is_dcp_shards_and_accelerates_files_and_a_resume_puts_every_part_back(tmp_path):
    run = Run.join(TrainConfig(output_dir=str(tmp_path), lr_scheduler="cosine", warmup_steps=2, resume="auto"))
    torch.manual_seed(0)
    model, stopping = torch.nn.Linear(4, 3), EarlyStopping(patience=5)
    checkpoints, state, built = parts_of(run, model, [stopping])
    assert checkpoints.start() is None
    for _ in range(3):
        step(model, built)
        state.stepped(1)
    stopping.waited = 2
    folder = checkpoints.save(state.step)
    held = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert held == [
        "callback_states_0.pt",
        "random_states_0.pkl",
        "scheduler.bin",
        "shards/.metadata",
        "shards/__0_0.distcp",
        "trainer_state.json",
    ]
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    moments = built.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    lr = built.optimizer.param_groups[0]["lr"]

    torch.manual_seed(1)
    again, stopping_again = torch.nn.Linear(4, 3), EarlyStopping(patience=5)
    resumed, position, rebuilt = parts_of(run, again, [stopping_again])
    assert resumed.start() is None
    assert position.step == 3 and position.run_id == "unit" and resumed.last == folder
    assert all(torch.equal(again.state_dict()[name], tensor) for name, tensor in saved.items())
    assert torch.equal(rebuilt.optimizer.state_dict()["state"][0]["exp_avg"], moments)
    assert rebuilt.optimizer.param_groups[0]["lr"] == lr and stopping_again.waited == 2


def test_a_ddp_checkpoint_written_before_dcp_still_loads_whole_on_one_process(tmp_path, capsys):
    """tests/fixtures/ddp-checkpoint-v1: step 2 of tests/jobs/legacy_job.py on 2 processes, as the trainer wrote DDP
    checkpoints before (``model.safetensors``, ``optimizer.bin`` by parameter index): a run of one process at the same
    global batch takes its weights and optimizer state as they are (tests/checkpoint/test_checkpoint.py resumes it on 2
    processes under DDP and FSDP2, to the uninterrupted run's end bit for bit)."""
    from safetensors.torch import load_file

    sys.path.insert(0, str(TESTS / "jobs"))
    from legacy_job import config_of, model_and_data

    checkpoint = tmp_path / "checkpoints" / "step-00000002"
    shutil.copytree(DATA / "ddp-checkpoint-v1", checkpoint)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["sharding"] == "DDP"
    model, rows = model_and_data()
    trainer = Trainer(model, config_of(str(tmp_path), str(checkpoint), batch_size=4), train_data=rows)
    assert trainer.cannot_train_on is None and trainer.global_step == 2
    assert "step-00000002 is in the layout before DCP" in capsys.readouterr().out
    weights = load_file(checkpoint / "model.safetensors")
    assert weights and all(torch.equal(trainer.unwrapped_model.state_dict()[name], t) for name, t in weights.items())
    saved = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    state = trainer.optimizer.state_dict()
    assert saved["state"].keys() == state["state"].keys()
    for index, moments in saved["state"].items():
        assert all(torch.equal(state["state"][index][key], value) for key, value in moments.items()), index


@pytest.mark.parametrize("background", [False, True])
def test_save_async_writes_the_same_checkpoint_under_ddp(tmp_path, background):
    """A DDP run's model and optimizer are DCP's, so save_async writes them in the background too."""
    run = Run.join(TrainConfig(output_dir=str(tmp_path), save_async=True))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    checkpoints, state, built = parts_of(run, model, [])
    checkpoints.start()
    step(model, built)
    state.stepped(1)
    folder = checkpoints.save(1, wait=not background)
    checkpoints.wait()
    assert checkpoints.last == folder and (folder / "shards" / ".metadata").is_file()


def test_a_stager_is_kept_across_background_saves_only_where_it_stages_again(monkeypatch):
    """save_async on a GPU keeps one stager, its copies refilled at each save. torch 2.11's closes itself at the end
    of each save (its type table emptied): kept, the second save on an H100 failed with KeyError. kept_stager keeps
    one only where it stages again, into the same copies; elsewhere DCP's default, a new stager each save."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # The GPU's options less what a CPU cannot do (pinned memory, copies without blocking).
    options = StagingOptions(False, False, False, False)
    stager, state = kept_stager(options), {"model": {"w": torch.arange(4.0)}, "step": 1}
    if stager is not None:
        first = stager.stage(state)
        state["model"]["w"] += 1
        second = stager.stage(state)
        assert torch.equal(second["model"]["w"], torch.arange(4.0) + 1) and second["step"] == 1
        assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    stage = DefaultStager._stage

    def as_torch_2_11_stages(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", as_torch_2_11_stages)
    assert kept_stager(options) is None


def saved_checkpoint(tmp_path: Path, callbacks: list = ()) -> Path:
    """Step 1 of a run of one process (a Linear model), committed."""
    run = Run.join(TrainConfig(output_dir=str(tmp_path), resume="auto"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    checkpoints, state, built = parts_of(run, model, list(callbacks))
    checkpoints.start()
    step(model, built)
    state.stepped(1)
    return checkpoints.save(1)


def resume_from(tmp_path: Path, folder: Path, callbacks: list = ()) -> Checkpointer:
    run = Run.join(TrainConfig(output_dir=str(tmp_path), resume=str(folder)))
    return parts_of(run, torch.nn.Linear(4, 3), list(callbacks))[0]


@pytest.mark.parametrize("where", ["another run's shard", "../ to another run's shard", "/etc/passwd"])
def test_a_crafted_index_that_places_tensors_outside_the_checkpoint_is_refused(tmp_path, where):
    """DCP's index (shards/.metadata, unpickled with DCP's own classes, its storage paths changed, re-signed): the
    export's reader and a resume refuse it before reading a byte outside the checkpoint's own shards."""
    other = saved_checkpoint(tmp_path / "other")
    folder = saved_checkpoint(tmp_path / "run")
    target = {
        "another run's shard": str(other / "shards" / "__0_0.distcp"),
        "../ to another run's shard": "../../../other/checkpoints/step-00000001/shards/__0_0.distcp",
        "/etc/passwd": "../../../../../../../../etc/passwd",
    }[where]
    index = pickle.loads((folder / "shards" / ".metadata").read_bytes())
    for info in index.storage_data.values():
        info.relative_path = target
    (folder / "shards" / ".metadata").write_bytes(pickle.dumps(index))
    resign(folder)
    refusal = "not within a file of its own shards folder: the checkpoint is refused"
    with pytest.raises(CheckpointError, match=refusal):
        read_sharded_weights(folder)
    with pytest.raises(CheckpointError, match=refusal):
        resume_from(tmp_path / "again", folder).start()


def test_a_crafted_part_state_is_refused_by_name_before_it_is_used(tmp_path):
    """trainer_state.json edited and re-signed: keep_best's record with a step that is no number, auto_microbatch's
    pieces 0 or "abc" (it would cut each micro-batch into 0 pieces) are refused before anything uses them."""
    folder = saved_checkpoint(tmp_path / "run")
    state = json.loads((folder / "trainer_state.json").read_text())
    state["best"] = {"figure": "eval_loss", "value": 0.5, "step": "abc"}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    resign(folder)
    with pytest.raises(CheckpointError, match=r"the 'best' state in trainer_state.json cannot be used"):
        resume_from(tmp_path / "again", folder).start()
    split = object.__new__(MicroBatchSplit)
    for pieces in (0, "abc", 3, -2):
        with pytest.raises(ValueError, match="auto_microbatch writes 1, 2, 4"):
            split.load_state_dict({"pieces": pieces})
    split.load_state_dict({"pieces": 4})
    assert split.pieces == 4


def test_random_states_that_cannot_be_loaded_safely_are_said_and_nothing_runs(tmp_path, capsys):
    """accelerate skips random states it cannot load without a word; the run says it goes on with fresh ones."""
    folder = saved_checkpoint(tmp_path / "run")
    marker = tmp_path / "ran"
    (folder / "random_states_0.pkl").write_bytes(pickle.dumps({"random_state": Path.touch, "at": marker}))
    resign(folder)
    assert resume_from(tmp_path / "again", folder).start() is None
    said = capsys.readouterr().err
    assert "random_states_0.pkl cannot be loaded safely" in said and "fresh random states" in said, said
    assert not marker.exists()


def test_a_ddp_checkpoint_written_before_dcp_that_lacks_a_tensor_is_refused_by_name(tmp_path):
    """model.safetensors without one weight (re-signed): the model would keep that weight's fresh initialisation."""
    from safetensors.torch import load_file

    sys.path.insert(0, str(TESTS / "jobs"))
    from legacy_job import config_of, model_and_data

    checkpoint = tmp_path / "checkpoints" / "step-00000002"
    shutil.copytree(DATA / "ddp-checkpoint-v1", checkpoint)
    weights = load_file(checkpoint / "model.safetensors")
    del weights["transformer.h.0.mlp.c_fc.weight"]
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    resign(checkpoint)
    model, rows = model_and_data()
    with pytest.raises(CheckpointError, match="model.safetensors lacks transformer.h.0.mlp.c_fc.weight"):
        Trainer(model, config_of(str(tmp_path), str(checkpoint), batch_size=4), train_data=rows)


class NanoGPTLike(torch.nn.Module):
    """As nanoGPT builds its GPT: ``_init_weights`` applied to Linear and Embedding only (LayerNorm keeps its own)."""

    def __init__(self, scale: bool = False):
        super().__init__()
        self.wte, self.ln, self.head = torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16)
        self.scale = torch.nn.Parameter(torch.ones(8)) if scale else None
        self.apply(self._init_weights)

    def _init_weights(self, module: torch.nn.Module) -> None:
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.zeros_(module.bias)


def test_a_model_built_on_meta_that_is_not_a_transformers_model_is_initialised_as_its_own_code_would():
    """Each module's reset_parameters, then the model's _init_weights: its LayerNorm is ones and zeros, not whatever
    memory held (1e29 and a NaN loss at step 1 before); a tensor neither writes is refused by name."""
    with torch.device("meta"):
        model = NanoGPTLike()
    whole_on_device(model, torch.device("cpu"), seed=0)
    assert torch.equal(model.ln.weight, torch.ones(8)) and torch.equal(model.ln.bias, torch.zeros(8))
    assert torch.equal(model.head.bias, torch.zeros(16)) and 0.01 < float(model.head.weight.detach().std()) < 0.03
    assert 0.01 < float(model.wte.weight.detach().std()) < 0.03
    with torch.device("meta"):
        unwritten = NanoGPTLike(scale=True)
    with pytest.raises(ShardingError, match="left scale unwritten"):
        whole_on_device(unwritten, torch.device("cpu"), seed=0)


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_partial_export(tmp_path):
    """safetensors' own error on a full disk is no OSError (it was a raw SafetensorError): here the disk fills at
    8 kB (RLIMIT_FSIZE, as a small tmpfs would; root ignores permissions, not this)."""
    run = Run.join(TrainConfig(output_dir=str(tmp_path / "run")))
    model = torch.nn.Linear(64, 64)
    checkpoints, state, built = parts_of(run, model, [])
    checkpoints.start()
    folder = checkpoints.save(1)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    try:
        with pytest.raises(ExportError, match=r"cannot write the export into .*File too large.*left as it was before"):
            export(folder, tmp_path / "exported")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert not (tmp_path / "exported").exists() and not (tmp_path / ".exported.writing").exists()


def test_a_shard_whose_tensor_is_a_crafted_pickle_is_one_line_in_the_export(tmp_path):
    """A tensor's bytes in ``__0_0.distcp`` replaced by a pickle naming a global (re-signed, the index pointing
    within the file): the export refuses it in one line, as a resume does (a raw CheckpointException before)."""
    import io

    folder = saved_checkpoint(tmp_path / "run")
    shard = folder / "shards" / "__0_0.distcp"
    crafted = io.BytesIO()
    torch.save({"weight": Path("/etc/passwd")}, crafted)
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + crafted.getvalue())
    index = pickle.loads((folder / "shards" / ".metadata").read_bytes())
    for key, info in index.storage_data.items():
        if key.fqn.startswith("model."):
            info.offset, info.length = offset, len(crafted.getvalue())
    (folder / "shards" / ".metadata").write_bytes(pickle.dumps(index))
    resign(folder)
    with pytest.raises(CheckpointError, match="a file of its shards cannot be loaded safely .* nothing in it was run"):
        export(folder, tmp_path / "exported")
