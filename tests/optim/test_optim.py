"""The optimizer the config builds: weight decay as transformers' Trainer applies it, and what the banner says.
Plain logic: in-process. And the schedules, against transformers' own."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers import Trainer as HFTrainer

from trainer import TrainConfig
from trainer.optim.build import build_optimizer, build_scheduler, decayed, describe


class RMSNormLike(torch.nn.Module):  # a model's own norm class (LlamaRMSNorm, T5LayerNorm): known by its name
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))


def gpt2() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def test_weight_decay_skips_biases_and_norm_weights_as_transformers_does():
    model = gpt2()
    assert decayed(model) == set(HFTrainer.get_decay_parameter_names(None, model))  # lm_head.weight (tied) too
    assert not {"transformer.h.0.ln_1.weight", "transformer.h.0.attn.c_attn.bias"} & decayed(model)
    assert "transformer.wte.weight" in decayed(model)
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), RMSNormLike(), torch.nn.BatchNorm1d(4))
    assert decayed(mixed) == {"0.weight"}


SCHEDULES = [  # (lr_scheduler, warmup_steps, min_lr_ratio, lr_scheduler_kwargs)
    ("constant", 0, None, {}),
    ("constant", 3, None, {}),
    ("linear", 0, None, {}),
    ("linear", 4, None, {}),
    ("cosine", 3, None, {}),
    ("cosine", 0, None, {"num_cycles": 1.5}),
    ("cosine_with_min_lr", 3, 0.1, {}),
    ("cosine_with_min_lr", 2, None, {"min_lr": 1e-4}),
    ("polynomial", 3, 0.01, {"power": 2.0}),
    ("polynomial", 0, None, {}),
    ("inverse_sqrt", 4, None, {}),
    ("inverse_sqrt", 0, None, {}),
    ("inverse_sqrt", 2, None, {"timescale": 7}),
    ("warmup_stable_decay", 3, 0.1, {"num_decay_steps": 5}),
    ("warmup_stable_decay", 4, None, {"num_decay_steps": 6, "warmup_type": "cosine", "decay_type": "1-sqrt"}),
    (
        "warmup_stable_decay",
        5,
        0.2,
        {
            "num_decay_steps": 4,
            "num_stable_steps": 3,
            "warmup_type": "1-sqrt",
            "decay_type": "linear",
            "num_cycles": 0.7,
        },
    ),
]


@pytest.mark.parametrize("name, warmup, floor, kwargs", SCHEDULES)
def test_every_schedule_gives_transformers_lr_at_every_step_bit_for_bit(name, warmup, floor, kwargs):
    """trainer.schedules writes transformers' schedules out (importing them costs a process 3.6 s where PEFT is
    installed): the lr of every step, and past the end, equals get_scheduler's exactly."""
    from transformers import get_scheduler

    from trainer.optim.build import schedule_settings

    config = TrainConfig(
        lr=3e-3, lr_scheduler=name, warmup_steps=warmup, min_lr_ratio=floor, lr_scheduler_kwargs=kwargs
    )
    ours, theirs = (torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=3e-3) for _ in range(2))
    schedule = build_scheduler(ours, config, 20)
    theirs_name = "constant_with_warmup" if name == "constant" else name
    reference = get_scheduler(
        theirs_name,
        theirs,
        num_warmup_steps=warmup,
        num_training_steps=20,
        scheduler_specific_kwargs=schedule_settings(config, theirs_name),
    )
    for step in range(25):
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"], (name, step)
        for optimizer, scheduler in ((ours, schedule), (theirs, reference)):
            optimizer.step()
            scheduler.step()


def test_the_groups_and_the_banner():
    model = gpt2()
    groups = build_optimizer(model, TrainConfig(weight_decay=0.1)).param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    every = build_optimizer(model, TrainConfig(weight_decay=0.1, decay_biases_and_norms=True)).param_groups
    assert len(every) == 1 and every[0]["weight_decay"] == 0.1
    assert len(build_optimizer(model, TrainConfig()).param_groups) == 1  # no decay: one group

    config = TrainConfig(weight_decay=0.1, lr_scheduler="cosine", warmup_steps=3)
    optimizer = build_optimizer(model, config)
    words = describe(
        optimizer, build_scheduler(optimizer, config, 10), config, built_optimizer=True, built_scheduler=True
    )
    assert words == (
        "adamw lr 0.0003, weight decay 0.1 on 10 of 28 tensors (not biases or norm weights), cosine "
        "schedule after 3 warm-up steps"
    )
    yours = torch.optim.RMSprop(model.parameters(), lr=0.01)
    step = torch.optim.lr_scheduler.StepLR(yours, 5)
    assert describe(yours, step, TrainConfig(), built_optimizer=False, built_scheduler=False) == (
        "your RMSprop (lr 0.01), your StepLR"
    )


FP16_STEPS = """
import torch
from trainer import TrainConfig
from trainer.launch.run import Run
from trainer.parallel import for_run
run = Run.join(TrainConfig())
run.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)  # what fp16 gets on a GPU; the CPU's own here
strategy = for_run(run)
model = torch.nn.Linear(4, 4)
model = strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
for factor in (1.0, float("inf"), 1.0):
    before = model.weight.detach().clone()
    strategy.backward((model(torch.ones(1, 4)) * factor).sum())
    taken = strategy.step()
    print(not taken, torch.equal(model.weight, before))
    strategy.zero_grad()
"""


def test_an_fp16_overflow_skipped_inside_a_fused_adamw_is_reported_as_skipped():
    """A fused AdamW (the CUDA default) is always called by fp16's loss scaler and skips an overflowed step inside
    its kernel; the step must still count as skipped, or the schedule moves on without an update."""
    import subprocess
    import sys

    from conftest import clean_env

    result = subprocess.run([sys.executable, "-c", FP16_STEPS], capture_output=True, text=True, env=clean_env())
    assert result.stdout.split() == ["False", "False", "True", "True", "False", "False"], result.stderr[-2000:]


FP16_SUM = """
import torch
from trainer import TrainConfig
from trainer.launch.run import Run
from trainer.loop.weighing import StepBatches, Weighing
from trainer.parallel import for_run
run = Run.join(TrainConfig())
run.accelerator.scaler = torch.amp.GradScaler("cpu")  # fp16's, at its initial scale of 65536 (the CPU's own here)
torch.manual_seed(0)
strategy = for_run(run)
model = torch.nn.Linear(8, 16)  # a language model's head: 16 tokens' logits
model = strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
def loss_fn(model, batch):  # cross-entropy summed over 64 tokens, and their count; fp16, as autocast on a GPU
    features, labels = batch
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(features)
    return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum"), labels.numel()
weighing = Weighing(run, model, loss_fn=loss_fn)
for step in range(4):
    window = StepBatches([(torch.randn(64, 8), torch.randint(0, 16, (64,)))], divisor=1)
    objective, _, _ = weighing.loss(window, model, window.micro_batches[0])
    strategy.backward(objective)
    weighing.finish(window, model.parameters())
    print(not strategy.step())
    strategy.zero_grad()
"""


def test_a_loss_sum_under_fp16_does_not_overflow_its_first_steps():
    """A (loss_sum, count) loss: each term's gradient at full weight times fp16's initial scale of 65536 overflowed
    fp16, and the loss scaler skipped steps until its scale had fallen by about the count."""
    import subprocess
    import sys

    from conftest import clean_env

    result = subprocess.run([sys.executable, "-c", FP16_SUM], capture_output=True, text=True, env=clean_env())
    assert result.stdout.split() == ["False"] * 4, result.stdout + result.stderr[-2000:]


TENSOR_LR = """
import torch, trainer as t
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4)
trainer = t.Trainer(model, t.TrainConfig(output_dir={out!r}, batch_size=2, max_steps=3, log_every=1),
                    [torch.ones(2)] * 6, loss_fn=lambda m, b: m(b).pow(2).mean(), optimizer=optimizer,
                    lr_scheduler=schedule)
trainer.fit()
print(*[row["lr"] for row in trainer.log_history])
"""


def test_a_tensor_lr_is_logged_as_the_step_used_it_not_as_the_schedule_moved_it_after(tmp_path):
    """A tensor lr (fused or capturable optimizers) is moved in place by the scheduler: the log keeps a copy."""
    import subprocess
    import sys

    from conftest import clean_env

    script = TENSOR_LR.format(out=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=clean_env())
    assert [round(float(lr), 6) for lr in result.stdout.split()[-3:]] == [0.0025, 0.005, 0.0075], result.stderr[-2000:]


NANOGPT_JOB = """
import torch
from trainer import TrainConfig, Trainer
torch.manual_seed(0)
data = [{{"x": torch.randn(4), "labels": torch.tensor(1.0)}} for _ in range(64)]

class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {{"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}}

config = TrainConfig(output_dir={out!r}, batch_size=4, max_steps=14, log_every=1, lr=6e-4, warmup_steps=3,
                     lr_scheduler="nanogpt", min_lr_ratio=0.1, lr_scheduler_kwargs={{"lr_decay_steps": 10}})
trainer = Trainer(Regression(), config, train_data=data)
trainer.fit()
print(*[repr(row["lr"]) for row in trainer.log_history])
"""


def nanogpt_get_lr(it, *, learning_rate=6e-4, warmup_iters=3, lr_decay_iters=10, min_lr=6e-5):
    """nanoGPT's train.py, as it is written there."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def test_nanogpts_schedule_from_the_config_alone_is_its_get_lr_at_every_step(tmp_path):
    """lr_scheduler: nanogpt, warm-up 3, decay over 10 steps of a 14-step run, floor 0.1: the lr each step used, as
    a real job logs it, is nanoGPT's get_lr of that iteration (its warm-up starts at lr / 4, not 0; flat after)."""
    import subprocess
    import sys

    from conftest import clean_env

    result = subprocess.run(
        [sys.executable, "-c", NANOGPT_JOB.format(out=str(tmp_path))], capture_output=True, text=True, env=clean_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    used = [float(lr) for lr in result.stdout.split()[-14:]]
    expected = [nanogpt_get_lr(it) for it in range(14)]
    assert max(abs(a - b) for a, b in zip(used, expected, strict=True)) < 1e-12, (used, expected)
    assert "nanogpt schedule after 3 warm-up steps down to 0.1 x lr, lr_decay_steps 10" in result.stdout


def test_muon_takes_the_hidden_matrices_and_its_state_round_trips_into_the_same_next_step():
    """optimizer: muon splits as the published recipes do: Muon on each block's weight matrices, AdamW on the
    embeddings, the (tied) head, norms and biases, in one optimizer whose state dict loads into a fresh one and
    gives the same next step bit for bit; an lr schedule moves both parts."""
    config = TrainConfig(output_dir="unused", optimizer="muon", lr=0.01, weight_decay=0.1)

    def built():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)).eval()
        return model, build_optimizer(model, config)

    def step(model, optimizer):
        ids = torch.arange(32).reshape(2, 16) % 64
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = built()
    names = {id(p): name for name, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"])
    assert muon == sorted(
        f"transformer.h.{i}.{m}.weight"
        for i in (0, 1)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    step(model, optimizer)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(optimizer.state_dict())  # as a checkpoint holds it: not the live tensors
    again, fresh = built()
    again.load_state_dict(saved)
    fresh.load_state_dict(state)
    step(model, optimizer)
    step(again, fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    scheduler = build_scheduler(fresh, TrainConfig(output_dir="unused", warmup_steps=2), total_steps=4)
    scheduler.step()
    assert {g["lr"] for g in fresh.param_groups} == {0.005}  # warm-up's half way, Muon's groups and AdamW's
