"""A LoRA adapter (PEFT) trained through real processes (tests/jobs/lora.py): only the adapter changes, 2 processes
give the updates of 1 (the loss is the transformers model's inside PEFT's wrapper, weighed by its tokens), FSDP2
gives DDP's, a resume is bit-exact, and ``final/`` is the adapter as PEFT writes it, which PEFT's own loader puts
back on a fresh base model; a checkpoint exports as that adapter, or merged, as ``save_model(merged=True)`` writes
it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ROOT, accelerate_launch, python

pytest.importorskip("peft")  # in the test extra; a host without it (the GPU host) skips
LORA = ROOT / "tests" / "jobs" / "lora.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("lora")
    jobs = {"fsdp": [], "ddp": ["--ddp"], "resumed": ["--ddp", "--resume_from", f"{out}/ddp/checkpoints/step-00000002"]}
    accelerate_launch(LORA, "--out", out, "--jobs", json.dumps(jobs), config="fsdp.yaml")
    python(LORA, "--out", out, "--jobs", json.dumps({"one process": ["--accumulation", "2"]}))
    return {name: json.loads((out / name / "lora.json").read_text()) for name in [*jobs, "one process"]}


def test_only_the_adapter_trains_with_the_same_updates_on_any_split_and_resumes_bit_exact(runs):
    ddp = runs["ddp"]
    for name, run in runs.items():
        assert run["frozen_kept"], f"{name}: a frozen base weight changed"
        assert all("lora_" in tensor for tensor in run["trained"]), name
    assert runs["resumed"]["trained"] == ddp["trained"]  # continued from step 2: bit-exact
    for name in ("one process", "fsdp"):  # 1 process x accumulation 2, and sharded: the same global batch
        for tensor, values in ddp["trained"].items():
            np.testing.assert_allclose(runs[name]["trained"][tensor], values, rtol=0, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(runs[name]["losses"], ddp["losses"], rtol=1e-6, err_msg=name)
    assert 4.0 < ddp["losses"][0] < 4.3  # ln(64): the whole loss at 2 processes, not half of it


def test_final_is_the_adapter_that_peft_loads_back(runs):
    for name, run in runs.items():
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(run["final"]), name
        assert "model.safetensors" not in run["final"], name
        assert run["loaded_back"], f"{name}: PeftModel.from_pretrained(base, final) holds other weights"


@pytest.mark.parametrize("job", ["ddp", "fsdp"])
def test_a_checkpoint_exports_as_the_adapter_or_merged_and_loads_with_peft_and_transformers(runs, job, tmp_path):
    """``python -m trainer.export`` of the last checkpoint (step 6, what final/ holds): the adapter, bit-identical
    to final/'s, and with --merged one plain GPT-2 that from_pretrained loads, equal to PEFT's own merge, as is
    what the job's ``save_model(merged=True)`` wrote."""
    import torch
    from lora import base_model
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.tools.export import main as export

    out = runs[job]["out"]
    last = f"{out}/checkpoints/step-00000006"
    export([last, str(tmp_path / "adapter")])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    final = load_file(f"{out}/final/adapter_model.safetensors")
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)

    export([last, str(tmp_path / "merged"), "--merged"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged).__name__ == "GPT2LMHeadModel"
    peft_merged = PeftModel.from_pretrained(base_model(), f"{out}/final").merge_and_unload()
    ours, theirs = merged.state_dict(), peft_merged.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    asked = AutoModelForCausalLM.from_pretrained(f"{out}/merged").state_dict()  # save_model(merged=True)
    assert asked.keys() == theirs.keys() and all(torch.equal(asked[k], theirs[k]) for k in theirs)
    base = base_model().state_dict()
    assert not torch.equal(ours["transformer.h.0.attn.c_attn.weight"], base["transformer.h.0.attn.c_attn.weight"])


def test_merged_is_refused_by_name_for_a_model_without_an_adapter(tmp_path):
    import torch

    from trainer import TrainConfig, Trainer
    from trainer.errors import ExportError

    trainer = Trainer(torch.nn.Linear(2, 2), TrainConfig(output_dir=str(tmp_path)), train_data=None)
    with pytest.raises(ExportError, match=r"merged=True folds a PEFT adapter .* \(Linear\) has none"):
        trainer.save_model(tmp_path / "merged", merged=True)
    assert not (tmp_path / "merged").exists()


def test_a_peft_checkpoint_without_its_adapter_config_is_refused_by_name_not_exported_unloadable(runs, tmp_path):
    """A checkpoint written before checkpoints carried adapter_config.json (its config.json naming PeftModel):
    the export used to write PEFT's names under that config, which no loader accepts."""
    import shutil
    import zlib

    from trainer.checkpoint.export import export
    from trainer.errors import ExportError

    old = tmp_path / "step-00000006"
    shutil.copytree(f"{runs['ddp']['out']}/checkpoints/step-00000006", old)
    (old / "adapter_config.json").unlink()
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "architectures": ["PeftModel"]}))
    state = json.loads((old / "trainer_state.json").read_text())
    for files in (state["files"], state["crc32"]):
        files.pop("adapter_config.json")
    data = (old / "config.json").read_bytes()
    state["files"]["config.json"], state["crc32"]["config.json"] = len(data), f"{zlib.crc32(data):08x}"
    (old / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ExportError, match="holds a PEFT model but not its adapter's config"):
        export(old, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_adapted_embedding_and_a_module_to_save_export_as_peft_saves_them(tmp_path):
    """PEFT saves more than the adapter's own tensors here: the base embedding it adapted and the module to save.
    The export asks PEFT which tensors those are (before, the base embedding stayed on meta: 'Cannot copy out of
    meta tensor'). In-process, one process."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import TrainConfig, Trainer
    from trainer.tools.export import main as export

    torch.manual_seed(0)
    base = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    adapter = LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"])
    model = get_peft_model(base, adapter)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 16))]
    config = TrainConfig(output_dir=str(tmp_path / "run"), batch_size=4, max_steps=2, save_every=2, optimizer="sgd")
    Trainer(model, config, train_data=rows).fit()
    export([str(tmp_path / "run" / "checkpoints" / "step-00000002"), str(tmp_path / "adapter")])
    final = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.embed_tokens.base_layer.weight" in final
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
