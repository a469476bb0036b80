"""Compiled graphs kept in the checkpoint: a compiled run's checkpoint holds torch's compile artefacts; a fresh process
resuming it (``resume: auto``, a torch cache of its own, empty) takes its graphs from the checkpoint, as torch counts
its FX graph cache hits, and ends on the weights of the run never interrupted; a key that differs, or a checkpoint
named by hand, compiles cold with one line (tests/jobs/compiled_resume.py)."""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, clean_env, run

JOB = ROOT / "tests" / "jobs" / "compiled_resume.py"


def job(out, cache, *args):
    env = clean_env(TORCHINDUCTOR_CACHE_DIR=str(cache))
    done = run([sys.executable, str(JOB), "--out", str(out), *map(str, args)], env=env, timeout=600)
    return done.stdout, json.loads((out / "graphs.json").read_text())


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    said, counted = job(root / "run", root / "cache-first", "--steps", 2)
    return root, counted


def test_a_resume_takes_its_graphs_from_the_checkpoint_and_ends_on_the_uninterrupted_weights(first_half):
    root, counted = first_half
    assert counted == {"hits": 0, "misses": 2}
    step = root / "run" / "checkpoints" / "step-00000002"
    assert (step / "compiled_0.bin").stat().st_size > 0 and (step / "compiled.json").is_file()
    said, counted = job(root / "run", root / "cache-resumed", "--steps", 4, "--resume", "auto")
    assert "compiled graphs: 2 taken from the checkpoint" in said
    # torch's own counts: every graph from its cache, which only the checkpoint filled.
    assert counted == {"hits": 2, "misses": 0}
    _, whole = job(root / "whole", root / "cache-whole", "--steps", 4)
    resumed, uninterrupted = (load_file(root / name / "final" / "model.safetensors") for name in ("run", "whole"))
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name


def part(tmp_path, resume="auto"):
    from trainer.checkpoint.compiled import CompiledGraphs
    from trainer.parallel.compiling import Compilation

    config = types.SimpleNamespace(resume=resume, compile=True, output_dir=str(tmp_path))
    return CompiledGraphs(
        types.SimpleNamespace(rank=0, config=config, device=torch.device("cpu")), Compilation.of(True)
    )


def test_a_key_that_differs_or_a_checkpoint_named_by_hand_compiles_cold(first_half, tmp_path, capsys):
    root, _ = first_half
    folder = tmp_path / "checkpoints" / "step"
    shutil.copytree(root / "run" / "checkpoints" / "step-00000002", folder)
    key = json.loads((folder / "compiled.json").read_text())
    (folder / "compiled.json").write_text(json.dumps({**key, "torch": "2.0.0"}))
    graphs = part(tmp_path)
    graphs.load(folder)
    assert graphs.loaded is None
    assert f"compiled cold: the checkpoint's graphs were compiled otherwise (torch 2.0.0 -> {torch.__version__})" in (
        capsys.readouterr().out
    )
    by_hand = part(tmp_path, resume=str(folder))
    by_hand.load(folder)
    assert by_hand.loaded is None
    assert "taken from the run's own checkpoints only (resume: auto)" in capsys.readouterr().out
    # resume: auto, but a checkpoint outside the run's output_dir (trainer.load_checkpoint by hand): cold too.
    elsewhere = part(tmp_path / "another-run")
    elsewhere.load(folder)
    assert elsewhere.loaded is None
