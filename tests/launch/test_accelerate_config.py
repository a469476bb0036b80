"""Every path of ``accelerate config`` a user can take here, answered through a pty as a person at a terminal
answers it: the file it writes, what ``python -m trainer.check`` says of that file, and what a launch of it does
(a few steps of training, or one ``trainer:`` line naming the setting). The README's CPU walk-through and the
multi-CPU answers are in tests/launch/test_hosts.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from trainer.launch.accelerate_config import DEEPSPEED, FP8, MEGATRON, XLA

from conftest import JOBS, ROOT, SCENARIOS, accelerate_config, free_port, job_exits, run, run_together, split_jobs

GPUS = {"Which type of machine": "multi-GPU", "How many GPU(s)": "2"}
FSDP = {**GPUS, "FullyShardedDataParallel": "yes"}


def preflight(path, ok: bool = False) -> str:
    """What ``python -m trainer.check`` says of the file (its exit status: 0 when ``ok``)."""
    return run([sys.executable, "-m", "trainer.check", "--config_file", str(path)], expect_ok=ok).stdout


def launch_command(path, *args) -> list:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        path,
        "--main_process_port",
        free_port(),
        SCENARIOS,
        *args,
    ]


def test_fsdp_with_enter_for_every_default_trains_sharded(tmp_path):
    """The answers a new user gives: FSDP, then Enter. accelerate writes fsdp_version 2 and a blank block class,
    which is no class named (the model's own, else one group, said in a line), and the launch trains sharded."""
    path = tmp_path / "fsdp.yaml"
    accelerate_config(path, FSDP)
    written = path.read_text()
    assert "fsdp_version: 2" in written and "fsdp_transformer_layer_cls_to_wrap: ''" in written
    assert "preflight: no problems found" in preflight(path, ok=True)
    result = run([str(c) for c in launch_command(path, "outputs", "--output_dir", tmp_path / "out")])
    assert "device cpu (FSDP2)" in result.stdout and "names no block class" in result.stdout
    moved = json.loads(result.stdout.split("RESULT ")[-1].splitlines()[0])
    assert moved["dict"] > 1e-3, "the sharded weights trained"


def test_torch_dynamo_and_checked_collectives_train_as_ddp(tmp_path):
    """Yes to torch dynamo (Enter for its backend: inductor, which compiles on a CPU too) and to checking distributed
    operations: DDP, the whole model compiled by the strategy (in place: its weights keep their names), trained."""
    path = tmp_path / "dynamo.yaml"
    accelerate_config(path, {**GPUS, "torch dynamo": "yes", "checked while running": "yes"})
    assert "dynamo_backend: INDUCTOR" in path.read_text() and "debug: true" in path.read_text()
    assert "preflight: no problems found" in preflight(path, ok=True)
    run([str(c) for c in launch_command(path, "job", "--output_dir", tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "result.json").read_text())
    assert report["world_size"] == 2 and report["result"]["eval_loss"] < report["before"]["eval_loss"]


def test_torch_dynamo_with_fsdp_compiles_the_sharded_model_and_trains(tmp_path):
    """Yes to FSDP and to torch dynamo (aot_eager: dynamo's tracing without inductor's code generation, for time):
    the strategy compiles the sharded model (each block; this classifier has none, so the whole of it) and trains."""
    path = tmp_path / "fsdp_dynamo.yaml"
    accelerate_config(path, {**FSDP, "torch dynamo": "yes", "dynamo backend": "aot_eager"})
    assert "dynamo_backend: AOT_EAGER" in path.read_text()
    assert "preflight: no problems found" in preflight(path, ok=True)
    result = run([str(c) for c in launch_command(path, "outputs", "--output_dir", tmp_path / "out")])
    assert "device cpu (FSDP2, compiled whole (aot_eager))" in result.stdout
    moved = json.loads(result.stdout.split("RESULT ")[-1].splitlines()[0])
    assert moved["dict"] > 1e-3 and moved["dataclass"] > 1e-3, "the sharded weights trained"


def test_torch_dynamo_makes_a_changing_sequence_length_dynamic_rather_than_a_graph_for_each(tmp_path):
    """Torch dynamo from accelerate config, torch.compile's defaults left alone (dynamic shapes never asked for):
    accelerate launch passes dynamic=False all the same (huggingface/accelerate#4254), and torch.compile then compiles
    one graph for every new sequence length until dynamo gives up at 8 and runs eagerly. Here a size that changes is
    made dynamic, as torch.compile does by default: 6 lengths a process (batches of one), 2 graphs, whole or per
    block (the block's and the loss's); the strategy used to make one for each length."""
    path = tmp_path / "dynamo.yaml"
    accelerate_config(path, {**GPUS, "torch dynamo": "yes", "dynamo backend": "aot_eager"})
    assert "dynamo_use_dynamic" not in path.read_text()
    whole = run([str(c) for c in launch_command(path, "lengths", "--output_dir", tmp_path / "whole")])
    assert "(MULTI_CPU, compiled whole (aot_eager))" in whole.stdout
    assert "GRAPHS 2 for 12 lengths" in whole.stdout, whole.stdout
    regional = launch_command(path, "lengths", "--output_dir", tmp_path / "blocks")
    regional[regional.index("--config_file") : regional.index("--config_file")] = ["--dynamo_use_regional_compilation"]
    blocks = run([str(c) for c in regional])
    assert "compiled per block: 1 x GPT2Block and the loss (aot_eager)" in blocks.stdout
    assert "GRAPHS 4 for 12 lengths" in blocks.stdout, blocks.stdout


REFUSED = {  # answers, what the preflight says, what the launch's one trainer: line says
    "fsdp version 1": (
        {**FSDP, "FSDP version": "1"},
        "fsdp_version 1: the trainer shards with FSDP2",
        "the accelerate config asks for FSDP version 1; this trainer shards with FSDP2",
    ),
    "fsdp, parameters offloaded to the CPU": (
        {**FSDP, "offload parameters": "yes"},
        "fsdp_offload_params",
        "the accelerate config sets fsdp_offload_params: CPU offload is not",
    ),
    "a dynamo backend torch dropped": (
        {**GPUS, "torch dynamo": "yes", "dynamo backend": "nvprims_nvfuser"},
        "dynamo_backend: NVPRIMS_NVFUSER, which torch",
        "dynamo_backend: NVPRIMS_NVFUSER, which torch",
    ),
    "megatron-lm": ({**GPUS, "Megatron-LM": "yes"}, MEGATRON, MEGATRON),
    "multi-CPU on 2 machines": (
        {
            "Which type of machine": "multi-CPU",
            "How many different machines": "2",
            "IP address": "127.0.0.1",
            "port you will use": "29500",
            "How many processes": "2",
        },
        "starts each machine's process alone",
        "but started ONE",
    ),
}


def test_answers_the_trainer_does_not_run_stop_the_preflight_and_the_launch_in_one_line(tmp_path):
    paths = {name: tmp_path / f"{i}.yaml" for i, name in enumerate(REFUSED)}
    for name, (answers, _, _) in REFUSED.items():
        accelerate_config(paths[name], answers)
    # Every preflight in one process (tests/jobs/run_many.py): each is `python -m trainer.check --config_file FILE`.
    check = str(ROOT / "trainer" / "check.py")
    jobs = [[check, "--config_file", str(paths[name])] for name in REFUSED]
    checked = run([sys.executable, str(JOBS), json.dumps(jobs)], expect_ok=False)
    assert all(job_exits(checked.stderr, len(REFUSED))), checked.stderr
    for (name, (_, said, _)), verdict in zip(REFUSED.items(), split_jobs(checked.stdout), strict=True):
        assert "PROBLEM: " in verdict and said in verdict, (name, verdict)
    launches = run_together(
        [
            (launch_command(paths[name], "job", "--output_dir", tmp_path / f"out{i}"), tmp_path)
            for i, name in enumerate(REFUSED)
        ],
        expect_ok=False,
    )
    for (name, (_, _, line)), result in zip(REFUSED.items(), launches, strict=True):
        output = result.stdout + result.stderr
        said = [text for text in output.splitlines() if text.startswith("trainer: ") and line in text]
        assert result.returncode != 0 and said, (name, output[-2000:])
        assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output, (name, output[-2000:])


@pytest.mark.parametrize(
    "answer, package, refusal",
    [
        ({**GPUS, "DeepSpeed?": "yes"}, "DeepSpeed is not installed", DEEPSPEED),
        ({"Which type of machine": "TPU"}, None, XLA),
    ],
)
def test_deepspeed_and_tpu_answers_are_refused_by_name(tmp_path, answer, package, refusal):
    """DeepSpeed: accelerate config itself stops without it; the file it writes where it is installed (the same
    keys) is refused by the preflight, as the launch refuses it (tests/parallel/test_fsdp.py). A TPU file (XLA) is
    written here, and refused."""
    path = tmp_path / "answered.yaml"
    asked = accelerate_config(path, answer, expect_ok=package is None)
    if package is not None:
        assert package in asked[-1][1] and not path.exists()
        path.write_text(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: 'no'\n"
            "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\ngpu_ids: all\nuse_cpu: false\n"
            "deepspeed_config:\n  zero_stage: 3\n"
        )
    assert f"PROBLEM: {refusal}" in preflight(path)


def test_fp8_answered_writes_torchaos_backend_which_passes_the_preflight(tmp_path):
    """fp8, then Enter: accelerate writes torchao's backend (AO), which the trainer runs (tests/parallel/test_fsdp.py).
    Without torchao accelerate config itself stops, and a file that says fp8 is refused by name, naming the extra."""
    path = tmp_path / "fp8.yaml"
    if importlib.util.find_spec("torchao") is None:
        asked = accelerate_config(path, {**GPUS, "mixed precision": "fp8"}, expect_ok=False)
        assert "FP8 (either torchao, Transformer Engine or MSAMP) is not installed" in asked[-1][1]
        path.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp8\n")
        assert f"PROBLEM: {FP8}" in preflight(path)
        return
    accelerate_config(path, {**GPUS, "mixed precision": "fp8"})
    written = path.read_text()
    assert "mixed_precision: fp8" in written and "backend: AO" in written, written
    assert "preflight: no problems found" in preflight(path, ok=True)


def test_two_machines_meet_as_accelerate_launch_does_whatever_rendezvous_backend_the_file_names(tmp_path):
    """Two machines not on one network: ``accelerate config`` asks for a rendezvous backend and writes it, but
    accelerate launch reads the backend from its --rdzv_backend flag alone, so every such file meets at the static
    rendezvous. The preflight says so, and names what the flag's etcd would need; the two machines of an etcd file
    (no etcd server anywhere here) train as one job, each launched with its own file, as on two hosts."""
    port = str(free_port())
    machines = {
        **GPUS,
        "How many different machines": "2",
        "IP address": "127.0.0.1",
        "port you will use": port,
        "same local network": "no",
    }
    for backend, rank in (("c10d", 0), ("etcd", 0), ("etcd", 1)):
        path = tmp_path / f"{backend}-{rank}.yaml"
        accelerate_config(path, {**machines, "rendezvous backend": backend, "rank of this machine": str(rank)})
        assert f"rdzv_backend: {backend}" in path.read_text() and f"machine_rank: {rank}" in path.read_text()
    for backend in ("c10d", "etcd"):
        said = preflight(tmp_path / f"{backend}-0.yaml")  # (and: 127.0.0.1 cannot be reached from another host)
        assert f"rendezvous: static at 127.0.0.1:{port}" in said, said
        assert f"this file's rdzv_backend {backend} is not used" in said, said
    flagged = run(
        [
            sys.executable,
            "-m",
            "trainer.check",
            "--config_file",
            str(tmp_path / "etcd-0.yaml"),
            "--rdzv_backend",
            "etcd",
        ],
        expect_ok=False,
    ).stdout
    assert "PROBLEM: --rdzv_backend etcd: torchrun's etcd rendezvous needs the python-etcd package" in flagged
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    job = [SCENARIOS, "job", "--output_dir", tmp_path / "out"]
    launches = run_together([([*launch, tmp_path / f"etcd-{r}.yaml", *job], node) for r, node in enumerate(nodes)])
    assert "trainer | 2 process(es) on 2 machine(s)" in launches[0].stdout, launches[0].stdout
    report = json.loads((tmp_path / "out" / "result.json").read_text())
    assert report["world_size"] == 2 and report["result"]["eval_loss"] < report["before"]["eval_loss"]


def test_the_accelerate_configs_ship_with_the_package_and_a_project_outside_the_clone_gets_them(tmp_path):
    """A project that installed the trainer with pip has no clone, so no accelerate_configs/ (it had to copy the
    folder before). The wheel holds every config; ``python -m trainer.configs`` (run outside the clone, four times
    in one process) lists them, writes one into the project, never over a file, and gives a shipped one's path."""
    import zipfile

    pytest.importorskip("setuptools")
    configs = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
    # Built from a copy of what the build reads (it leaves a build/ folder where it runs); the package's link to the
    # configs copied as a link.
    source, pycache = tmp_path / "source", shutil.ignore_patterns("__pycache__")
    for folder in ("trainer", "accelerate_configs"):
        shutil.copytree(ROOT / folder, source / folder, symlinks=True, ignore=pycache)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path, source])
    with zipfile.ZipFile(next(tmp_path.glob("*.whl"))) as wheel:
        for config in configs:
            assert wheel.read(f"trainer/accelerate_configs/{config.name}") == config.read_bytes(), config.name
    command = str(ROOT / "trainer" / "configs.py")
    jobs = [[command], [command, "fsdp.yaml"], [command, "fsdp"], [command, "multi_gpu", "--path"]]
    project = tmp_path / "project"
    project.mkdir()
    result = run([sys.executable, str(JOBS), json.dumps(jobs)], expect_ok=False, cwd=project)
    assert job_exits(result.stderr, 4) == [0, 0, 1, 0], result.stderr
    listed, wrote, again, path = split_jobs(result.stdout)
    assert [line.split()[0] for line in listed.splitlines()] == [config.name for config in configs], listed
    assert "fsdp.yaml        FSDP2 on one machine" in listed
    copy = project / "accelerate_configs" / "fsdp.yaml"
    assert copy.read_bytes() == (ROOT / "accelerate_configs" / "fsdp.yaml").read_bytes(), wrote
    assert "trainer: accelerate_configs/fsdp.yaml already exists: edit it, or pass --to" in split_jobs(result.stderr)[2]
    assert Path(path.strip()).read_bytes() == (ROOT / "accelerate_configs" / "multi_gpu.yaml").read_bytes()
