"""``chunked_loss``: a causal language model's loss from its hidden states a chunk of tokens at a time gives the model's
own loss and updates to float order, on one process, under DDP and under FSDP2 (tests/jobs/chunked.py); what it
cannot do is refused by name."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trainer import ConfigError, TrainConfig, Trainer

from conftest import ROOT, TESTS, accelerate_launch

sys.path.insert(0, str(TESTS / "jobs"))
import chunked as job  # noqa: E402


def same_training(found: dict, out) -> None:
    full, chunked = found["full"], found["chunked"]
    assert len(full["losses"]) == 4 and len(full["eval"]) == 2
    np.testing.assert_allclose(chunked["losses"], full["losses"], rtol=1e-6)
    np.testing.assert_allclose(chunked["eval"], full["eval"], rtol=1e-6)
    weights, again = (
        load_file(out / "full" / "final" / "model.safetensors"),
        load_file(out / "chunked" / "final" / "model.safetensors"),
    )
    assert weights.keys() == again.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=2e-6, msg=name)


def test_the_chunked_loss_trains_as_the_models_own_on_one_process(tmp_path, capsys):
    same_training(job.runs(str(tmp_path)), tmp_path)
    assert "computed 7 tokens at a time (chunked_loss)" in capsys.readouterr().out


@pytest.mark.parametrize("config", ["cpu.yaml", "fsdp.yaml"])
def test_the_chunked_loss_trains_as_the_models_own_on_two_processes(tmp_path, config):
    accelerate_launch(ROOT / "tests" / "jobs" / "chunked.py", "--out", tmp_path, config=config, num_processes=2)
    same_training(json.loads((tmp_path / "chunked.json").read_text()), tmp_path)


def test_the_chunked_loss_holds_no_logits_of_the_whole_batch(tmp_path):
    """No tensor of the whole batch's logits is made in the training forward and backward: the largest has a chunk's
    rows (counted by torch's dispatch, every op's outputs; the head's weight transposed, hidden x vocabulary, aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        vocab_wide = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                weight = isinstance(tensor, torch.Tensor) and tensor.shape == (32, job.VOCAB)
                if isinstance(tensor, torch.Tensor) and tensor.ndim and tensor.shape[-1] == job.VOCAB and not weight:
                    rows = tensor.numel() // job.VOCAB
                    Largest.vocab_wide = max(Largest.vocab_wide, rows)
            return out

    found = {}
    for chunked in (False, True):
        config = TrainConfig(output_dir=str(tmp_path / str(chunked)), batch_size=4, max_steps=1, chunked_loss=chunked)
        trainer = Trainer(job.build(), config.replace(loss_chunk_tokens=8), train_data=job.rows())
        Largest.vocab_wide = 0
        with Largest():
            trainer.fit()
        found[chunked] = Largest.vocab_wide
    # 4 rows of 20 tokens: 80 rows of logits at once without, 8 (a chunk) with.
    assert found == {False: 80, True: 8}
    # The model of a Trainer with it, given to one without: its own loss again.
    model = trainer.unwrapped_model
    again = Trainer(model, TrainConfig(output_dir=str(tmp_path / "again"), batch_size=4, max_steps=1), job.rows())
    Largest.vocab_wide = 0
    with Largest():
        again.fit()
    assert Largest.vocab_wide == 80


def test_a_tied_model_given_to_a_second_trainer_still_computes_its_loss_in_chunks(tmp_path):
    """A head tied to the embeddings gets a forward of the trainer's own (its gradient summed in place:
    trainer.parallel.tied), and chunked_loss a forward of its own over that one; a second
    Trainer of the same model, chunked too, leaves both as they are rather than handing the chunks the logits."""
    model = job.build()
    model.lm_head.weight = model.model.embed_tokens.weight
    for name in ("first", "second"):
        train = TrainConfig(output_dir=str(tmp_path / name), batch_size=4, max_steps=1, chunked_loss=True)
        Trainer(model, train.replace(loss_chunk_tokens=8), train_data=job.rows()).fit()
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_what_the_chunked_loss_cannot_do_is_refused_by_name(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2ForSequenceClassification

    config = TrainConfig(output_dir=str(tmp_path), chunked_loss=True)
    data = job.rows()
    with pytest.raises(ConfigError, match="a loss_fn was given"):
        Trainer(job.build(), config, train_data=data, loss_fn=lambda model, batch: model(**batch).loss)
    classifier = GPT2ForSequenceClassification(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=97))
    with pytest.raises(ConfigError, match="GPT2ForSequenceClassification is not one"):
        Trainer(classifier, config, train_data=data)
    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=97,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    with pytest.raises(ConfigError, match=r"Gemma2ForCausalLM changes its logits .*final_logit_softcapping"):
        Trainer(gemma, config, train_data=data)
    with pytest.raises(ConfigError, match="loss_chunk_tokens must be >= 1"):
        TrainConfig(chunked_loss=True, loss_chunk_tokens=0)


def test_compiled_per_block_the_loss_the_chunks_replace_stays_eager():
    """compile per block compiles a model's loss function beside its blocks, unless chunked_loss replaces it (the
    banner then does not say "and the loss"); torch.compile is lazy, so nothing is traced here."""
    from trainer.parallel.compiling import Compilation, compile_in_place

    compilation = Compilation(kwargs={"backend": "inductor"}, per_block=True)
    for loss in (True, False):
        model = job.build()
        own = model.loss_function
        said = compile_in_place(model, compilation, per_block=True, loss=loss)
        assert ("and the loss" in said) is loss
        assert (model.loss_function is own) is not loss
