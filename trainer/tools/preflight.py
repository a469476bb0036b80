"""Preflight: what a launch would do, and, inside a real launch, what breaks multi-node jobs before it costs a day.

    python -m trainer.check --config_file accelerate_configs/multi_node.yaml              # read the config
    accelerate launch --config_file my.yaml -m trainer.check --output_dir runs/x           # every rank, for real
    accelerate launch --config_file my.yaml -m trainer.check --wandb_project my-project   # ... and wandb from each node
    accelerate launch --config_file my.yaml -m trainer.check --checkpoint_storage s3://b/x  # ... and the bucket

Read alone, the config says machines, processes, backend, mixed precision, the mesh (what each process holds, which
replicas each machine runs) and rendezvous, checked against this host.
Launched, every rank joins the job and reports its host, local rank and device; the check then asks: did the world
come out as configured, can every rank be reached (a collective with a short timeout), is ``output_dir`` one
filesystem shared by all nodes (checkpoints are written by one process and read by all; with a bucket,
``--checkpoint_storage``, it need not be, and every rank must write to the bucket), and, for a job that logs to
wandb (``--wandb_project``, or WANDB_PROJECT set), can each node reach it. It ends with one line per problem and
exits 1, or says none were found and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from trainer.errors import ShardingError
from trainer.launch.accelerate_config import NO_FP16, NO_OFFLOAD, refusal_of_the_file
from trainer.launch.mesh import mesh_lines, requested_layout
from trainer.tools.launch_probe import Problems, check_launch


def describe_config(
    path: str,
    launched: bool,
    num_processes: Optional[int] = None,
    *,
    num_machines: Optional[int] = None,
    rdzv_backend: Optional[str] = None,
) -> tuple[list[str], Problems, Optional[int]]:
    """What ``accelerate launch --config_file path`` would start, checked against this host: the lines to print,
    the problems, and the number of processes the config asks for. ``num_processes`` / ``num_machines`` override
    the file as the same flags of ``accelerate launch`` do, and ``rdzv_backend`` is its ``--rdzv_backend`` (the
    file's ``rdzv_backend`` is not read by accelerate launch: without the flag it is static). Inside a launch the
    rendezvous evidently worked (and may have come from --main_process_ip), so its settings are not judged."""
    config, unreadable = _read(path)
    if config is None:
        return [], [unreadable], None
    machines = num_machines or config.num_machines
    processes = num_processes or config.num_processes
    if not isinstance(processes, int) or processes < 1 or not isinstance(machines, int) or machines < 1:
        return [], [f"num_processes {processes!r} and num_machines {machines!r} must each be at least 1"], None
    gpus = visible_gpus(getattr(config, "gpu_ids", None))
    kind = config.distributed_type.value
    # accelerate launches MULTI_GPU and FSDP files through torchrun, anything else through its one-process launcher
    through_torchrun = kind.startswith("MULTI_") and kind != "MULTI_CPU" or kind == "FSDP"
    on_cpu = gpus == 0 or (config.use_cpu and not through_torchrun)
    per_machine = processes // max(machines, 1)
    fsdp_version = int((config.fsdp_config or {}).get("fsdp_version", 1)) if kind == "FSDP" else None
    how = "sharded (FSDP2)" if fsdp_version else "as DDP"
    lines = [
        f"config {path}: {machines} machine(s) x {per_machine} process(es) = {processes} processes",
        f"  backend: {'gloo on CPU' if on_cpu else 'nccl on GPU'}"
        + (f" (no GPU visible: the trainer runs the processes {how} on CPU)" if on_cpu and through_torchrun else ""),
        f"  mixed precision: {config.mixed_precision}",
    ]
    dynamo = (getattr(config, "dynamo_config", None) or {}).get("dynamo_backend")
    fp8_backend = (getattr(config, "fp8_config", None) or {}).get("backend")
    if (refused := refusal_of_the_file(kind, config.mixed_precision, dynamo, fp8_backend=fp8_backend)) is not None:
        # What the launch would say, and nothing it would not reach.
        return lines, [refused], processes
    sharded, problems = _sharding(config, fsdp_version, processes=processes, per_machine=per_machine)
    lines += sharded
    if processes % max(machines, 1):
        problems.append(
            f"num_processes {processes} is not a multiple of num_machines {machines}: every machine runs "
            "num_processes / num_machines processes"
        )
    if not on_cpu and per_machine > gpus:
        problems.append(f"{per_machine} processes per machine, but this machine has {gpus} GPU(s)")
    if not through_torchrun:
        problems += _one_process_launcher(config, machines=machines, per_machine=per_machine)
    if config.mixed_precision == "bf16" and not on_cpu and not torch.cuda.is_bf16_supported():
        problems.append("mixed_precision bf16, but this machine's GPU has no bf16: use fp16.yaml")
    if machines > 1:
        met, unmet = _machines(config, rdzv_backend, launched)
        lines, problems = lines + met, problems + unmet
    return lines, problems, processes


def _read(path: str) -> tuple[Any, Optional[str]]:
    """accelerate's reading of the config file at ``path``, or None and the one line that says why not."""
    from accelerate.commands.config.config_args import load_config_from_file

    if Path(path).is_dir():
        return None, f"config file {path} is a folder: pass an accelerate config file (accelerate config writes one)"
    if not Path(path).is_file():
        return None, f"config file not found: {path}"
    if not Path(path).read_text().strip():
        return None, f"config file {path} is empty: write one with `accelerate config --config_file {path}`"
    try:
        return load_config_from_file(path), None
    # Invalid YAML, an unknown distributed_type, a key of the wrong kind: what accelerate says.
    except Exception as err:
        said = " ".join(line.strip() for line in str(err).strip().splitlines()) or type(err).__name__
        return None, f"config file {path} cannot be read by accelerate: {said[:300]}"


def _sharding(
    config: Any, fsdp_version: Optional[int], *, processes: int, per_machine: int
) -> tuple[list[str], Problems]:
    """An FSDP file's mesh and blocks, and what the trainer refuses in it; a DDP file's parallelism_config."""
    section = {k.removeprefix("parallelism_config_"): v for k, v in (config.parallelism_config or {}).items()}
    sizes = {name: int(value) for name, value in section.items() if name.endswith("_size")}
    if fsdp_version is None:
        ddp = "accelerate launch takes a parallelism_config section only with distributed_type: FSDP "
        ddp += "(fsdp_version: 2): remove it for DDP, or use an FSDP config (accelerate_configs/hsdp.yaml)"
        return [], [ddp] if sizes else []
    lines, problems = [], []
    try:
        lines += mesh_lines(requested_layout(processes, True, sizes), per_machine, processes)
    except ShardingError as err:
        problems.append(str(err))
    fsdp = config.fsdp_config or {}
    if wrap := str(fsdp.get("fsdp_transformer_layer_cls_to_wrap") or "").strip():
        lines.append(
            f"  blocks: {wrap} (fsdp_transformer_layer_cls_to_wrap), not checked: this check builds no model; "
            "a launch refuses a class the model has no module of, in one line"
        )
    if str(fsdp.get("fsdp_offload_params", False)).lower() == "true":
        problems.append(NO_OFFLOAD)
    if config.mixed_precision == "fp16":
        problems.append(NO_FP16)
    if fsdp_version != 2:
        problems.append(
            f"fsdp_version {fsdp_version}: the trainer shards with FSDP2; convert the file with "
            "`accelerate to-fsdp2 --config_file <yours> --output_file <new>`"
        )
    return lines, problems


def _one_process_launcher(config: Any, *, machines: int, per_machine: int) -> Problems:
    """accelerate's launcher for a file it does not hand to torchrun starts one process, or several through mpirun."""
    if (config.mpirun_config or {}).get("mpirun_hostfile"):
        return []
    if machines > 1:
        return [
            f"accelerate launch starts each machine's process alone for this multi-CPU file of {machines} "
            "machines: its CPU launcher joins machines only through mpirun (mpirun_hostfile). For "
            "several machines over gloo use a multi-GPU file (accelerate_configs/multi_node.yaml): where "
            "a machine has no GPU, the trainer runs its processes on the CPU"
        ]
    if per_machine > 1:
        return [
            f"accelerate launch starts 1 process for this file, not {per_machine}: its CPU launcher "
            "starts several only through mpirun (mpirun_hostfile). For K processes on the CPU over gloo "
            "use accelerate_configs/cpu.yaml with --num_processes K"
        ]
    return []


def _machines(config: Any, rdzv_backend: Optional[str], launched: bool) -> tuple[list[str], Problems]:
    """Where several machines meet and over which network, and, outside a launch, whether they can."""
    lines, problems = _rendezvous_lines(config, rdzv_backend), []
    if (rdzv_backend or "static").startswith("etcd") and importlib.util.find_spec("etcd") is None:
        problems.append(
            f"--rdzv_backend {rdzv_backend}: torchrun's etcd rendezvous needs the python-etcd package "
            "(pip install python-etcd) and an etcd server at main_process_ip:main_process_port; "
            "c10d needs neither"
        )
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    unset = (
        "  network: GLOO_SOCKET_IFNAME is not set: gloo (the trainer's CPU agreements) uses the interface "
        "this host's name resolves to; where that one does not reach the other nodes, export "
        "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME)"
    )
    lines.append(f"  network: gloo on {interface}" if interface else unset)
    if not launched:
        problems += _rendezvous_problems(config.main_process_ip, config.main_process_port)
    return lines, problems


def visible_gpus(gpu_ids: Optional[str]) -> int:
    """GPUs the launched processes will see: accelerate turns ``gpu_ids`` other than "all" into
    CUDA_VISIBLE_DEVICES, and CUDA stops at the first index that is not a device (cpu.yaml's '-1,-1')."""
    installed = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpu_ids in (None, "all"):
        return installed
    visible = 0
    for item in str(gpu_ids).split(","):
        if not item.strip().isdigit() or int(item) >= installed:
            break
        visible += 1
    return visible


def _rendezvous_lines(config: object, flag: Optional[str]) -> list[str]:
    """Where the nodes meet. accelerate launch takes the rendezvous backend from its --rdzv_backend flag alone: the
    file's ``rdzv_backend`` (which ``accelerate config`` asks for when the machines are not on one network) is
    not read, and the launch meets with torchrun's static rendezvous."""
    backend, written = flag or "static", getattr(config, "rdzv_backend", None) or "static"
    where = f"{config.main_process_ip}:{config.main_process_port}"
    ranks = "each node passes its own --machine_rank" if backend == "static" else "ranks given as nodes join"
    lines = [f"  rendezvous: {backend} at {where}; {ranks}"]
    if flag is None and written != "static":
        lines.append(
            f"  note: this file's rdzv_backend {written} is not used: accelerate launch reads the rendezvous "
            f"backend from its command line alone (pass --rdzv_backend {written} on every node)"
        )
    return lines


def _rendezvous_problems(address: Optional[str], port: Optional[int]) -> Problems:
    if not address:
        return ["main_process_ip is not set: every node must reach node 0 at it (or pass --main_process_ip)"]
    problems = []
    try:
        if ipaddress.ip_address(socket.gethostbyname(address)).is_loopback:
            problems.append(
                f"main_process_ip {address} is a loopback address: other machines cannot reach it "
                "(pass --main_process_ip <node 0's address> on every node)"
            )
    except (socket.gaierror, ValueError):
        problems.append(f"main_process_ip {address} does not resolve on this host")
    if not port or not 0 < int(port) < 65536:
        problems.append(f"main_process_port {port} is not a port number")
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    proof = (
        "python -m trainer.check --resume-proof [--config_file F] script.py [args]: prove that a script resumes exactly"
    )
    parser = argparse.ArgumentParser(prog="python -m trainer.check", description=__doc__.splitlines()[0], epilog=proof)
    parser.add_argument("--config_file", "--config-file", help="an accelerate config YAML to describe and check")
    parser.add_argument("--output_dir", "--output-dir", help="check that every node shares this directory")
    parser.add_argument(
        "--wandb_project",
        "--wandb-project",
        default=os.environ.get("WANDB_PROJECT"),
        help="the job logs to wandb: check that every node reaches it (default: $WANDB_PROJECT)",
    )
    parser.add_argument(
        "--checkpoint_storage", "--checkpoint-storage", help="check that every rank can write to this bucket (s3://...)"
    )
    parser.add_argument("--num_processes", "--num-processes", type=int, help="as accelerate launch's, over the file")
    parser.add_argument("--num_machines", "--num-machines", type=int, help="as accelerate launch's, over the file")
    parser.add_argument("--rdzv_backend", "--rdzv-backend", help="as accelerate launch's (the file's is not read)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a rank may take to answer")
    args = parser.parse_args(argv)

    launched = "LOCAL_RANK" in os.environ or "WORLD_SIZE" in os.environ
    lines, problems, expected = [], [], None
    if args.config_file:
        lines, problems, expected = describe_config(
            args.config_file,
            launched,
            args.num_processes,
            num_machines=args.num_machines,
            rdzv_backend=args.rdzv_backend,
        )
    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process and lines:
        print("\n".join(lines))
    if launched:
        problems += check_launch(
            args.output_dir,
            expected,
            args.timeout,
            uses_wandb=bool(args.wandb_project),
            storage=args.checkpoint_storage,
        )
    elif not args.config_file:
        parser.error("give --config_file, or run it inside a launch (accelerate launch ... -m trainer.check)")
    if main_process:
        print("\n".join(f"PROBLEM: {p}" for p in problems) if problems else "preflight: no problems found")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
