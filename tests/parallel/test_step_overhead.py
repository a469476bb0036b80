"""trainer/loop/step.py and trainer/parallel/strategy.py: the step without what accelerate's prepared objects cost per
step, the same behaviour. (Speed itself is measured in benchmarks/step_overhead.py and benchmarks/gpu.py, not here.)"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ROOT, SCENARIOS, accelerate_launch, clean_env, run


# On a CPU accelerate autocasts bf16 only: fp16.yaml there runs in fp32 (tests/test_gpu.py has fp16 on a GPU).
@pytest.mark.parametrize(
    "config, dtype",
    [("bf16.yaml", "torch.bfloat16"), ("fp16.yaml", "torch.float32"), ("multi_gpu.yaml", "torch.float32")],
)
def test_outputs_stay_in_the_autocast_dtype_no_fp32_copy(tmp_path, config, dtype):
    # accelerate's prepare() would convert every output to fp32 under mixed precision (a GPT-2's logits: 1.5 GB).
    accelerate_launch(SCENARIOS, "job", "--output_dir", tmp_path, config=config, num_processes=1)
    report = json.loads((tmp_path / "result.json").read_text())
    assert report["logits_dtype"] == dtype
    assert report["result"]["eval_loss"] < report["before"]["eval_loss"]


COUNT_PER_STEP_CHECKS = """
import importlib.util, inspect, sys, tempfile
import torch
sys.path.insert(0, {root!r})
from trainer import TrainConfig, Trainer

counts = {{"find_spec": 0, "signature": 0}}
find_spec, signature = importlib.util.find_spec, inspect.signature
def counting_find_spec(*a, **kw):
    counts["find_spec"] += 1
    return find_spec(*a, **kw)
def counting_signature(*a, **kw):
    counts["signature"] += 1
    return signature(*a, **kw)

data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
config = TrainConfig(output_dir=tempfile.mkdtemp(), max_steps=40, batch_size=4, optimizer="sgd", lr=0.01)
trainer = Trainer(torch.nn.Linear(4, 1), config, train_data=data,
                  loss_fn=lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]))
class Count:
    def on_train_begin(self, trainer):
        importlib.util.find_spec, inspect.signature = counting_find_spec, counting_signature
    def on_step_end(self, trainer):
        if trainer.global_step == 39:
            importlib.util.find_spec, inspect.signature = find_spec, signature
trainer.callbacks.append(Count())
trainer.fit()
print("COUNTS", counts)
"""


def test_a_step_asks_importlib_and_inspect_nothing():
    # accelerate's optimizer.step() asks importlib twice whether LOMO is installed, zero_grad() inspects a signature:
    # 0.2 ms a step, a quarter of a small model's step on this CPU.
    result = run([sys.executable, "-c", COUNT_PER_STEP_CHECKS.format(root=str(ROOT))])
    assert "COUNTS {'find_spec': 0, 'signature': 0}" in result.stdout


def test_steps_that_do_not_log_read_nothing_back_from_the_device(tmp_path):
    """The README's "no host synchronisation except on steps that log", counted: every host read of a tensor the
    trainer makes during fit() (item, tolist, bool, float, int, numpy, cpu; tests/jobs/host_reads.py), under FSDP2 with
    the model's token-weighted loss and under DDP with a (loss_sum, count) loss, both with accumulation and clipping, 2
    processes. Steps 1, 2, 4, 5 do not log: none there. A log step reads its figures once, the user's once more (and
    the last one checks for NaN and exports); an evaluate() after fit() reads once."""
    accelerate_launch(ROOT / "tests" / "jobs" / "host_reads.py", "--out", tmp_path, config="fsdp.yaml")
    for job, found in json.loads((tmp_path / "reads.json").read_text()).items():
        assert found["logging_steps"] == [3, 6], job
        # An evaluation reads its totals once, not once a batch: the sharded model's lockstep (3 and 2 batches
        # here) is worked out by each process from the data set's length, not agreed batch by batch.
        evaluation = found["reads"].pop("evaluate")
        assert len(evaluation) == 1 and evaluation[0].startswith("evaluation.py:"), (job, evaluation)
        silent = {step: reads for step, reads in found["reads"].items() if int(step) not in found["logging_steps"]}
        assert silent == {}, job
        # The gather of every rank's window (loss, counts, lr, gradient norm) in one read, the user's figures in
        # one more (4 reads before: the norm and each figure had their own).
        log_step = [read.split(":")[0] + " " + read.split()[-1] for read in found["reads"]["3"]]
        assert log_step == ["telemetry.py tolist", "window.py tolist"], (job, found["reads"]["3"])


ZEROS_IN_BACKWARD = """
import copy, sys, tempfile
import torch
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, {root!r})
from transformers import GPT2Config, GPT2LMHeadModel
from trainer import TrainConfig, Trainer

torch.manual_seed(0)
B, T, V = 4, 32, 512
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=T, vocab_size=V, use_cache=False))
tokens = torch.randint(0, V, (8 * B, T))
config = TrainConfig(output_dir=tempfile.mkdtemp(), max_steps=3, batch_size=B, log_every=1, stall_warning_s=None)
trainer = Trainer(model, config, train_data=[dict(input_ids=t, labels=t) for t in tokens])
print(trainer.describe())

class Made(TorchDispatchMode):
    # What each op of the backward makes: (op, shape).
    seen = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {{}}))
        if isinstance(out, torch.Tensor):
            Made.seen.append((str(func), list(out.shape)))
        return out

backward = trainer.strategy.backward
def observed(loss):
    with Made():
        backward(loss)
trainer.strategy.backward = observed
trainer.fit()
logits = [op for op, shape in Made.seen if shape == [B, T, V]]
print("LOGITS_SIZED", sorted(set(logits)))
print("ZEROS", sorted({{op for op in logits if "zero" in op or "fill" in op}}))
# The model answers its callers as before; a copy computes with its own weights.
model.eval()
twin = copy.deepcopy(model)
with torch.no_grad():
    for p in twin.parameters():
        p.zero_()
    ids = tokens[:2].to(next(model.parameters()).device)  # a GPU host trains on its GPU
    own, copied = model(input_ids=ids).logits, twin(input_ids=ids).logits
    print("OUTPUT", list(own.shape), copied.abs().max().item())
"""


def test_a_model_compiled_whole_makes_no_gradient_of_zeros_for_the_logits_its_loss_does_not_read():
    """A graph's outputs the loss does not read still get a gradient: autograd fills a compiled function's with
    zeros before its backward. Compiled whole, the model's logits were such an output under the default loss (a
    GPT-2 at 16 x 1024: 1.5 GB of zeros and an add a step on an H100); the default loss now asks for the loss
    alone, the logits stay inside the graph. Every op of the backward, observed: none makes a logits-sized zeros."""
    env = clean_env(ACCELERATE_DYNAMO_BACKEND="aot_eager")
    result = run([sys.executable, "-c", ZEROS_IN_BACKWARD.format(root=str(ROOT))], env=env)
    assert "compiled whole (aot_eager)" in result.stdout, result.stdout
    # The backward is seen: the logits' own gradient is made there.
    assert "LOGITS_SIZED []" not in result.stdout, result.stdout
    assert "ZEROS []" in result.stdout, result.stdout
    assert "OUTPUT [2, 32, 512] 0.0" in result.stdout, result.stdout
