"""FSDP2's groups of an untied model: its input embeddings and output head are groups of their own (torchtitan's
layout), so that the embeddings are let go after their forward and the head's gradient is reduced as soon as its
backward is done, instead of both staying gathered in the root group the whole step; a tied model keeps them in the
root. Read from the weights FSDP2 leaves on the modules while a 2-process job runs; what the step allocates besides
(a tied weight's gradients made whole anew, gloo's copy of each reduce-scatter's input), from torch's profiler there."""

from __future__ import annotations

import json

import pytest

from conftest import clean_env, launch_jobs, torchrun

JOB = """
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trainer import TrainConfig, Trainer

tied = sys.argv[2] == "tied"
config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=tied)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
seen = {}

def sharded(weight):
    return type(weight).__name__ == "DTensor"

def in_forward(module, args):
    seen.setdefault("embeddings gathered in the blocks' forward", not sharded(model.model.embed_tokens.weight))

def in_backward(module, grad):
    grad_of_head = model.lm_head.weight.grad
    reduced = grad_of_head is not None and sharded(grad_of_head)
    seen.setdefault("head's gradient reduced before the blocks' backward", reduced)

model.model.layers[0].register_forward_pre_hook(in_forward)
model.model.layers[0].register_full_backward_pre_hook(in_backward)
rows = [{"input_ids": torch.arange(8) + i, "labels": torch.arange(8) + i} for i in range(8)]
trainer = Trainer(model, TrainConfig(output_dir=sys.argv[1], max_steps=1, batch_size=2), train_data=rows)
activities = [torch.profiler.ProfilerActivity.CPU]
with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True) as profiled:
    trainer.fit()
events = profiled.events()
vocabulary = [[config.vocab_size, config.hidden_size]] * 2
sums = {e.name for e in events if e.name in ("aten::add", "aten::add_") and e.input_shapes[:2] == vocabulary}
seen["vocabulary-sized sums"] = sorted(sums)
whole = config.vocab_size * config.hidden_size * 4
seen["vocabulary-sized embedding gradients"] = [e.name for e in events if "embedding" in e.name
                                                and e.cpu_memory_usage >= whole]
seen["collectives"] = sorted({e.name for e in events if e.name.startswith(("gloo:", "c10d::"))})
if trainer.accelerator.is_main_process:
    print("SEEN " + json.dumps({**seen, "banner": trainer.describe()}))
"""


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict[str, dict]:
    """untied / tied -> what the job saw; both jobs in one 2-process launch (conftest.launch_jobs)."""
    root = tmp_path_factory.mktemp("sharding")
    script = root / "job.py"
    script.write_text(JOB)
    ended = launch_jobs({tie: [script, root / tie, tie] for tie in ("untied", "tied")}, config="fsdp.yaml")
    said = {}
    for tie, done in ended.items():
        assert done.returncode == 0, done.stderr[-3000:]
        said[tie] = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("SEEN "))[5:])
    return said


@pytest.mark.parametrize("tie", ["untied", "tied"])
def test_untied_embeddings_and_head_are_groups_of_their_own(seen, tie):
    seen = seen[tie]
    apart = tie == "untied"
    assert seen["embeddings gathered in the blocks' forward"] is not apart
    assert seen["head's gradient reduced before the blocks' backward"] is apart
    assert ("2 sharded blocks + embeddings + head + root" in seen["banner"]) is apart


def test_a_tied_gradient_is_summed_in_place_and_reduce_scatters_over_gloo_copy_nothing(seen):
    """The tied head's gradient reaches its weight as a view of torch's matmul output, which autograd would not add
    to in place, and the embeddings' is a vocabulary-sized matrix of its own: both copies at the end of the backward
    are gone (trainer.parallel.tied; the in place sum left is of an expanded zero). gloo's reduce-scatter clones its
    whole input: each runs as an all-reduce of FSDP2's own buffer instead (trainer.parallel.fsdp.reduce_scatter)."""
    assert seen["tied"]["vocabulary-sized sums"] == ["aten::add_"]
    assert seen["tied"]["vocabulary-sized embedding gradients"] == []
    assert seen["untied"]["vocabulary-sized embedding gradients"], "the test sees no embedding gradient at all"
    for tie in ("untied", "tied"):
        assert "gloo:all_reduce" in seen[tie]["collectives"]
        assert not [name for name in seen[tie]["collectives"] if "reduce_scatter" in name], seen[tie]["collectives"]


REDUCE = """
import json
from pathlib import Path
import torch
import torch.distributed as dist
from trainer.parallel.fsdp import reduce_scatter

dist.init_process_group("gloo")
group, rank = dist.group.WORLD, dist.get_rank()
torch.manual_seed(rank)
gradients = torch.randn(8 * 2**20)  # 32 MiB, as FSDP2's buffer of one group's gradients

def grown(reduce):
    \"\"\"This rank's part, and how far the peak RSS rose above the RSS while it was computed.\"\"\"
    given, part = gradients.clone(), torch.empty(gradients.numel() // 2)
    Path("/proc/self/clear_refs").write_text("5")
    reduce(part, given)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return part, (int(status["VmHWM"].split()[0]) - int(status["VmRSS"].split()[0])) * 1024

glooed, gloo_grew = grown(lambda part, given: dist.reduce_scatter_tensor(part, given, group=group))
ours, ours_grew = grown(lambda part, given: reduce_scatter(part, given, group, op=dist.ReduceOp.SUM))
print("REDUCED " + json.dumps({"equal": torch.equal(ours, glooed), "gloo": gloo_grew, "ours": ours_grew}))
"""


def test_a_reduce_scatter_over_gloo_gives_gloos_sums_without_copying_its_input(tmp_path):
    """trainer.parallel.fsdp.reduce_scatter, as FSDP2 calls it on CPU tensors, against gloo's own on 2 processes: the
    same part on each rank, bit for bit, while gloo's raises the peak by a copy of its whole input and ours does not
    (glibc's fixed mmap threshold returns freed tensors to the system, as a GPU allocator's count would)."""
    script = tmp_path / "reduce.py"
    script.write_text(REDUCE)
    done = torchrun(script, env=clean_env(MALLOC_MMAP_THRESHOLD_="65536"))
    lines = [json.loads(line[8:]) for line in done.stdout.splitlines() if line.startswith("REDUCED ")]
    assert len(lines) == 2
    for seen in lines:
        assert seen["equal"], seen
        assert seen["gloo"] > 24 * 2**20 > 8 * 2**20 > seen["ours"], seen
