"""Activation offloading (trainer.loop.offload), in-process. On a GPU the saved activations go to pinned CPU memory;
here the same hooks are pointed at the CPU itself, so that their copies really happen: the gradients are those of
autograd without them, bit for bit, the activations were copied and the weights were not. The step runner's
``activation_offloading: true`` gives the same step as without."""

from __future__ import annotations

import pytest
import torch

from trainer import TrainConfig
from trainer.launch.run import Run
from trainer.loop import offload
from trainer.loop.offload import OffloadActivations


def model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    return model, torch.randn(64, 32)


def plain_gradients() -> dict[str, torch.Tensor]:
    model, x = model_and_batch()
    model(x).square().mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_activations_are_copied_out_and_back_the_weights_stay_and_the_gradients_are_autograds():
    plain = plain_gradients()
    hooks = OffloadActivations(min_bytes=1024, device_types=("cpu",))
    model, x = model_and_batch()
    weights = {id(p) for p in model.parameters()}
    pack, offloaded, kept = hooks.pack_hook, [], []

    def watching(tensor):
        packed = pack(tensor)
        (offloaded if isinstance(packed, tuple) else kept).append(tensor)
        return packed

    hooks.pack_hook = watching
    with hooks:
        loss = model(x).square().mean()
    loss.backward()
    assert hooks.offloaded == len(offloaded) >= 2, "the linear layers' inputs and the GELU's: 8 KB and 16 KB"
    from_weights = [t for t in kept if id(t) in weights or id(t._base) in weights]
    assert from_weights, "autograd saved the weights (transposed: views of them), and they stayed"
    assert not any(id(t) in weights or id(t._base) in weights for t in offloaded)
    for name, grad in plain.items():
        assert torch.equal(grad, dict(model.named_parameters())[name].grad), name


def test_small_tensors_parameters_and_tensors_on_other_devices_stay_where_they_are():
    hooks = OffloadActivations(min_bytes=1024, device_types=("cpu",))
    parameter, small, large = torch.nn.Parameter(torch.ones(1024)), torch.ones(4), torch.ones(1024)
    assert hooks.pack_hook(parameter) is parameter and hooks.pack_hook(small) is small
    device, held = hooks.pack_hook(large)
    assert device == large.device and held is not large and torch.equal(held, large)
    assert torch.equal(hooks.unpack_hook((device, held)), large)
    on_gpu_only = OffloadActivations(min_bytes=1024)  # the default: CUDA tensors only
    assert on_gpu_only.pack_hook(large) is large


@pytest.mark.parametrize("offloading", [False, True])
def test_the_step_runner_takes_the_same_step_with_activation_offloading(tmp_path, offloading, monkeypatch):
    from test_parts import rows, stepped

    opened = []
    real = offload.OffloadActivations

    def counted(*args, **kwargs):
        opened.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("trainer.loop.step.OffloadActivations", counted)
    config = TrainConfig(output_dir=str(tmp_path), optimizer="sgd", lr=0.1, batch_size=2)
    run = Run.join(config.replace(activation_offloading=offloading))
    reference = stepped(Run.join(config), 2, rows(8))
    model = stepped(run, 2, rows(8))
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)
    assert bool(opened) == offloading, "one OffloadActivations around each micro-batch's forward"
