"""examples/gpt2.py: offline tiny runs through every launcher, the saved model and tokenizer, resume, and flags."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer import ConfigError

from conftest import JOBS, ROOT, accelerate_launch, python, split_jobs, torchrun

GPT2 = ROOT / "examples" / "gpt2.py"
TINY = [
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--seq-len",
    "32",
    "--vocab-size",
    "512",
    "--batch-size",
    "4",
    "--log-every",
    "5",
    "--eval-every",
    "1000",
    "--save-every",
    "10",
    "--warmup-steps",
    "2",
    "--sample-tokens",
    "8",
]


def logged_losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+/\d+ \| loss ([\d.]+)", output, re.M)]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[dict[str, str], Path]:
    """The example's 2-process runs in two launches (tests/jobs/run_many.py): a run of 20 steps ("first") and a streamed
    run of 10 ("streamed"); then each started again for more steps ("again", "streamed again"). Their outputs by
    name (stdout, then stderr), and the folder."""
    out = tmp_path_factory.mktemp("gpt2_two")
    first = {"first": [*TINY, "--max-steps", "20"], "streamed": [*TINY, "--streaming", "--max-steps", "10"]}
    again = {"again": [*TINY, "--max-steps", "30"], "streamed again": [*TINY, "--streaming", "--max-steps", "20"]}
    folders = {"first": "first", "streamed": "streamed", "again": "first", "streamed again": "streamed"}
    outputs = {}
    for runs in (first, again):
        jobs = [[str(GPT2), *args, "--output-dir", str(out / folders[name])] for name, args in runs.items()]
        result = accelerate_launch(JOBS, json.dumps(jobs))
        for name, stdout, stderr in zip(runs, split_jobs(result.stdout), split_jobs(result.stderr), strict=True):
            outputs[name] = (stdout, stderr)
    return outputs, out


def test_two_processes_train_save_a_loadable_model_and_resume(two_processes):
    outputs, folder = two_processes
    (first, first_err), (again, _) = outputs["first"], outputs["again"]
    tmp_path = folder / "first"
    assert "trainer | 2 process(es)" in first
    losses = logged_losses(first)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert re.search(r"^eval loss [\d.]+, perplexity [\d.]+$", first, re.M)
    step_line = r"^step 20/20 \| loss [\d.]+ \| lr \S+ \| [\d.]+ examples/s \| [\d,]+ tokens/s$"  # (MFU on a GPU)
    assert re.search(step_line, first, re.M)
    assert "\nsample: " in first
    assert "Writing model shards" not in first_err, "no progress bar when the output is not a terminal"
    # What torchao (the test extra's; transformers imports it with any model) says at import, once per rank, that
    # no user can act on: its kernels for another Python failing to load, torch deprecating a call it makes.
    assert "Failed to load" not in first_err and "register_constant()" not in first_err, first_err[:3000]
    assert f"saved to {tmp_path}/final" in first

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert model.config.n_layer == 1 and model.config.vocab_size == len(tokenizer)
    assert tokenizer.decode(tokenizer("def f(x): return x")["input_ids"]) == "def f(x): return x"

    assert f"resumed from {tmp_path}/checkpoints/step-00000020: step 20" in again
    assert "step 25/30" in again and "step 5/30" not in again


def test_streaming_trains_from_a_stream_on_two_processes_and_resumes_mid_stream(two_processes):
    outputs, folder = two_processes
    (first, _), (again, _) = outputs["streamed"], outputs["streamed again"]
    tmp_path = folder / "streamed"
    held_out = re.search(
        r"^gpt2 \| [\d,]+ parameters, streamed train and (\d+) eval sequences of 32 tokens$", first, re.M
    )
    # --eval-blocks 64 at most: the built-in text (Python's own documentation) held out only 32 on a host with
    # Python 3.12.3 and tokenizers 0.23.2: which documents' hashes fall in the held-out part varies with the text.
    assert held_out and 0 < int(held_out[1]) <= 64
    assert "unknown optimizer steps per epoch, 10 in all" in first
    assert f"resumed from {tmp_path}/checkpoints/step-00000010: step 10, epoch 0, batch 10" in again
    losses = logged_losses(first + again)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    eval_loss = float(re.search(r"^eval loss ([\d.]+)", again, re.M)[1])
    assert abs(eval_loss - losses[-1]) < 1.5, "train and eval loss measure the same thing (every token once)"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[dict[str, str], Path]:
    """The example's one-process runs, in one process (tests/jobs/run_many.py): a plain run ("plain"), a run ("first")
    whose final/ a run from local files ("local") starts from, and one of documents kept apart ("documents").
    Their outputs by name, and the folder."""
    out = tmp_path_factory.mktemp("gpt2")
    text = out / "notes.txt"
    text.write_text("A trainer runs the same script on one process or many.\n" * 200)
    local = ["--model-name", out / "first" / "final", "--train-file", text, "--peak-flops", "1e12"]
    runs = {
        "plain": [*TINY, "--max-steps", "4"],
        "first": [*TINY, "--max-steps", "2"],
        "local": [*TINY, "--max-steps", "4", *local],
        "documents": [*TINY, "--max-steps", "4", "--pack-documents"],
    }
    jobs = [[str(GPT2), *map(str, args), "--output-dir", str(out / name)] for name, args in runs.items()]
    outputs = split_jobs(python(JOBS, json.dumps(jobs)).stdout)
    return dict(zip(runs, outputs, strict=True)), out


# The other configs run a small job each in tests/launch/test_launch.py.
@pytest.mark.parametrize("launch", ["fsdp.yaml", "torchrun", "python"])
def test_every_launch_path_runs(tmp_path, launch, request):
    args = [*TINY, "--max-steps", "4", "--output-dir", tmp_path]
    if launch == "torchrun":
        output = torchrun(GPT2, *args).stdout
    elif launch == "python":
        outputs, folder = request.getfixturevalue("one_process")
        output, tmp_path = outputs["plain"], folder / "plain"
    else:
        output = accelerate_launch(GPT2, *args, config=launch).stdout
    processes = 2 if launch in ("fsdp.yaml", "torchrun") else 1
    assert f"trainer | {processes} process(es)" in output
    assert ("(FSDP2)" in output) == (launch == "fsdp.yaml"), "an FSDP config shards, on a CPU host too"
    assert (tmp_path / "final" / "model.safetensors").is_file()


def load_example():
    spec = importlib.util.spec_from_file_location("gpt2_example", GPT2)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # @dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_closing_sample_stops_where_the_models_context_ends():
    """--seq-len 32 with the default 60 sample tokens ended a finished run in an IndexError (no position past 32)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    example = load_example()
    tokenizer = example.train_tokenizer({"text": ["The cat sat on the mat."] * 50}, vocab_size=300)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=16, n_embd=16, n_layer=1, n_head=2))
    text = example.sample(model, tokenizer, "The", new_tokens=60)
    assert text.startswith("The")  # and no IndexError past position 16


def test_flags_take_hyphens_or_underscores_and_a_yaml_config(tmp_path):
    example = load_example()
    args, config = example.parse_args(
        [
            "--batch-size",
            "3",
            "--max_steps",
            "7",
            "--betas",
            "0.8",
            "0.9",
            "--experiment-name",
            "x",
            "--model-name",
            "m",
        ]
    )
    assert (config.batch_size, config.max_steps, config.betas, config.experiment_name) == (3, 7, (0.8, 0.9), "x")
    assert args.model_name == "m" and config.lr == example.EXAMPLE_DEFAULTS["lr"]

    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("lr: 1e-4\nbatch_size: 5\n")
    _, config = example.parse_args(["--config", str(run_yaml), "--batch-size", "6"])
    assert (config.lr, config.batch_size) == (1e-4, 6), "the file over the defaults, flags over the file"

    run_yaml.write_text("learning_rate: 1e-4\n")
    with pytest.raises(ConfigError, match="unknown key 'learning_rate'"):
        example.parse_args(["--config", str(run_yaml)])
    with pytest.raises(ConfigError, match="optimizer must be one of"):
        example.parse_args(["--optimizer", "adagrad"])
    run_yaml.write_text("- lr: 1e-4\n")
    with pytest.raises(ConfigError, match="run.yaml: expected a mapping of TrainConfig keys, got list"):
        example.parse_args(["--config", str(run_yaml)])
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        example.parse_args(["--config", str(tmp_path / "nope.yaml")])


def test_pack_documents_trains_on_whole_documents_flattened_a_micro_batch_at_a_time(one_process):
    outputs, folder = one_process
    assert re.search(
        r"^gpt2 \| [\d,]+ parameters, [\d,]+ train and [\d,]+ eval documents of 32 tokens at most$",
        outputs["documents"],
        re.M,
    )
    assert re.search(r"^step 4/4 \| loss [\d.]+", outputs["documents"], re.M) and "eval loss" in outputs["documents"]
    assert (folder / "documents" / "final" / "model.safetensors").is_file()


def test_model_name_and_train_file_take_local_paths(one_process):
    outputs, folder = one_process
    assert re.search(
        r"^gpt2 \| [\d,]+ parameters, \d+ train and \d+ eval sequences of 32 tokens$", outputs["local"], re.M
    )
    assert re.search(r"^step 4/4 \| .* examples/s \| [\d,]+ tokens/s \| MFU [\d.]+%$", outputs["local"], re.M)
    assert not (folder / "local" / "tokenizer").exists(), "a --model-name run uses that model's tokenizer"
    # Without --peak-flops a CPU's MFU is not guessed: said once, none on the step line.
    assert outputs["plain"].count("MFU: the peak FLOP/s of this cpu is not known here: set peak_flops") == 1
    assert " | MFU " not in outputs["plain"]


def test_mfu_reads_the_peak_of_the_card_named_not_of_one_whose_name_it_contains():
    from trainer.telemetry.mfu import peak_flops_of

    peaks = {
        name: peak_flops_of(name)
        for name in (
            "NVIDIA H100 80GB HBM3",
            "NVIDIA H100 PCIe",
            "NVIDIA L40",
            "NVIDIA L4",
            "NVIDIA A10G",
            "NVIDIA L40S",
            "NVIDIA A100-SXM4-80GB",
            "AMD Instinct MI300X",
        )
    }
    assert peaks == {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA L40": 181e12,
        "NVIDIA L4": 121e12,
        "NVIDIA A10G": 125e12,
        "NVIDIA L40S": 362e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "AMD Instinct MI300X": None,
    }


def test_mfu_counts_6n_and_causal_attention_per_token_against_the_peak_of_every_process():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer import TrainConfig
    from trainer.telemetry.mfu import Utilisation

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=2))
    parameters = sum(p.numel() for p in model.parameters())

    def run(world: int = 1, **config):  # what Utilisation asks of the job: its config, device and processes
        return SimpleNamespace(config=TrainConfig(**config), device=torch.device("cpu"), world=world)

    gpu = Utilisation(run(2, peak_flops=1e12), model)
    # 1,000 tokens/s in 10 examples/s: sequences of 100 tokens; attention 6 x 2 layers x 32 wide x 100 per token.
    assert gpu.of(1000.0, 10.0) == pytest.approx((6 * parameters + 6 * 2 * 32 * 100) * 1000 / (1e12 * 2))
    given = Utilisation(run(flops_per_token=5e6, peak_flops=1e12), model)
    assert given.of(1000.0, 10.0) == pytest.approx(5e6 * 1000 / 1e12)
    cpu = Utilisation(run(), model)
    assert cpu.of(1000.0, 10.0) is None and cpu.said  # said once: a CPU's peak is not guessed
    plain = Utilisation(run(peak_flops=1e12), torch.nn.Linear(4, 4))
    assert plain.of(1000.0, 10.0) is None and not plain.said  # no FLOPs known: nothing to say
