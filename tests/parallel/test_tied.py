"""A weight tied between the input embeddings and the output head (trainer.parallel.tied): its two gradients are
summed in place, and the embeddings' is never a vocabulary-sized matrix of its own, with the same floats as torch's
own backward. In process, against an untouched copy of the model; under FSDP2 through real processes in
test_sharding.py."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from trainer.parallel.tied import tied_gradient_in_place

VOCAB, WIDTH = 97, 16


def gpt2() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=32))


def llama_with_padding() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=3,
    )
    return LlamaForCausalLM(config)


def vocabulary_sized(profiled: torch.profiler.profile) -> list[str]:
    """The sums (``add``) and embedding gradients of the whole vocabulary's size a backward made anew (in the
    host's memory or, where the Trainer placed the model on a GPU, the device's)."""
    made = []
    for event in profiled.events():
        summed = event.name == "aten::add" and event.input_shapes[:2] == [[VOCAB, WIDTH]] * 2
        allocated = event.cpu_memory_usage + getattr(event, "device_memory_usage", 0)
        embedding = "embedding" in event.name and allocated >= VOCAB * WIDTH * 4
        if summed or embedding:
            made.append(event.name)
    return made


def backward(model: torch.nn.Module, ids: torch.Tensor, *, profile: bool = False) -> list[str]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True) as profiled:
        loss.backward()
    return vocabulary_sized(profiled) if profile else []


@pytest.mark.parametrize("build", [gpt2, llama_with_padding])
def test_the_tied_gradient_is_torchs_bit_for_bit_with_no_vocabulary_sized_matrix_of_its_own(build):
    """The padding token's row (Llama's) gets no gradient, as in torch's; a forward without a backward before,
    a forward without the head, and a second backward through the same graph give torch's floats too."""
    torch.manual_seed(0)
    plain = build().eval()  # no dropout: the two copies see the same forward
    ours = copy.deepcopy(plain)
    assert tied_gradient_in_place(ours)
    ids = torch.randint(0, VOCAB, (3, 10))
    ids[0, :4] = 3

    def weight_grad(model: torch.nn.Module) -> torch.Tensor:
        return model.get_input_embeddings().weight.grad

    made = {name: backward(model, ids, profile=True) for name, model in (("plain", plain), ("ours", ours))}
    assert made["ours"] == [] and made["plain"], made
    assert torch.equal(weight_grad(plain), weight_grad(ours))
    for model in (plain, ours):
        model(input_ids=ids[:1])
        backward(model, ids)
    assert torch.equal(weight_grad(plain), weight_grad(ours))
    for model in (plain, ours):
        model.zero_grad(set_to_none=True)
        model.base_model(input_ids=ids).last_hidden_state.square().sum().backward()
    assert torch.equal(weight_grad(plain), weight_grad(ours))
    for model in (plain, ours):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        loss.backward()
    assert torch.equal(weight_grad(plain), weight_grad(ours))
    # Two forwards' losses in one backward: the same sums, in another order.
    for model in (plain, ours):
        model.zero_grad(set_to_none=True)
        (model(input_ids=ids, labels=ids).loss + model(input_ids=ids[1:], labels=ids[1:]).loss).backward()
    torch.testing.assert_close(weight_grad(plain), weight_grad(ours), rtol=1e-6, atol=1e-7)


def test_only_a_linear_head_tied_to_the_embeddings_gets_the_trainers_forward():
    """transformers' base class raises for a model without embeddings: such a model trains as it is, as does an
    untied one; a tied head is given the forward once."""
    from transformers import PretrainedConfig, PreTrainedModel

    class NoEmbeddings(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self):
            super().__init__(PretrainedConfig())
            self.layer = torch.nn.Linear(2, 2)

    tied, untied = gpt2(), gpt2()
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert [tied_gradient_in_place(m) for m in (NoEmbeddings(), untied, tied, tied)] == [False, False, True, False]


def test_one_process_sums_a_tied_gradient_in_place_too(tmp_path):
    """The same in place sums where the model is not sharded (one process, the DDP strategy's path)."""
    from trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    model = gpt2()
    rows = [{"input_ids": torch.arange(8) + i, "labels": torch.arange(8) + i} for i in range(4)]
    trainer = Trainer(model, TrainConfig(output_dir=str(tmp_path), max_steps=1, batch_size=2), train_data=rows)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True) as profiled:
        trainer.fit()
    assert vocabulary_sized(profiled) == []


class TwiceEmbedded(torch.nn.Module):
    """Its embeddings called twice a forward, a hook between their backwards that can fail (as running out of
    memory there would)."""

    def __init__(self):
        super().__init__()
        self.embeddings = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embeddings.weight
        self.fail = False

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embeddings

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        first = self.embeddings(ids)
        if self.fail:
            first.register_hook(self.out_of_memory)
        return self.head(first * 2 + self.embeddings(ids.flip(0))).logsumexp(-1).sum()

    def out_of_memory(self, grad: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("out of memory between the embeddings' backwards")


def test_a_backward_that_failed_between_the_embeddings_adds_nothing_to_the_next():
    torch.manual_seed(0)
    plain = TwiceEmbedded()
    ours = copy.deepcopy(plain)
    assert tied_gradient_in_place(ours)
    ids = torch.randint(0, VOCAB, (3, 10))
    for model in (plain, ours):
        model.fail = True
        with pytest.raises(torch.OutOfMemoryError):
            model(ids).backward()
        model.fail = False
        model.zero_grad(set_to_none=True)
        model(ids).backward()
    assert torch.equal(plain.embeddings.weight.grad, ours.embeddings.weight.grad)
