"""What each process holds of the model's weights, gradients and AdamW state, and its peak memory, at 1, 2 and 4
processes, for DDP and three ways into FSDP2: a model built on every process (``cpu``: each process builds it
whole, the first process's weights are sent), built on the meta device (``meta``: no process ever holds it whole),
and ``from_pretrained`` with ``fsdp_cpu_ram_efficient_loading``; and for two meshes of a parallelism_config, HSDP
(2 replicas, each sharded over K/2 processes) and tensor parallelism 2 under FSDP over K/2. The trainer's own runs
(a GPT-2, or a Llama of its shape with ``--model llama``; two steps), each process measuring the tensors it holds
after a step, and its peak: the peak RSS on a CPU host (where a process's memory is its device's), the CUDA peak on
a GPU.

    python benchmarks/memory.py                        # 13 runs of torchrun, a few minutes on a 2-core CPU
    python benchmarks/memory.py --layers 12 --width 768 --vocab 50257 --processes 1 2 4 8   # GPT-2 124M
    python benchmarks/memory.py --model llama --processes 4 --kinds DDP "FSDP2, meta" "HSDP 2 x K/2, meta" \
        "TP 2 x FSDP K/2, meta"                        # the meshes of a launch's parallelism_config
    python benchmarks/memory.py --chunked-loss ...     # every run with chunked_loss: true

FSDP2 holds about 1/K of DDP's 16 bytes a parameter (4 of weights, 4 of gradients, 8 of AdamW state) on each of
K processes; what it cannot shard (nothing here) and the unsharded weights of the block being computed come on top.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}
KINDS = {
    "DDP": ("cpu", {}),
    "FSDP2": ("cpu", FSDP2_ENV),
    "FSDP2, meta": ("meta", FSDP2_ENV),
    "FSDP2, pretrained": ("pretrained", {**FSDP2_ENV, "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}),
    "HSDP 2 x K/2, meta": ("meta", FSDP2_ENV),
    "TP 2 x FSDP K/2, meta": ("meta", FSDP2_ENV),
}
MESHES = {"HSDP 2 x K/2, meta": (2, 1), "TP 2 x FSDP K/2, meta": (1, 2)}  # (replicas, tensor-parallel size)


def mesh_settings(kind: str, processes: int) -> dict[str, str] | None:
    """The parallelism_config of ``kind`` on ``processes`` (PARALLELISM_CONFIG_*, as accelerate launch sets them):
    {} for a 1-D kind, None for a mesh that does not fit (its shards would be fewer than 2)."""
    if kind not in MESHES:
        return {}
    replicas, tp = MESHES[kind]
    if processes % (2 * replicas * tp):
        return None
    return {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": str(replicas),
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": str(processes // (replicas * tp)),
        "PARALLELISM_CONFIG_TP_SIZE": str(tp),
    }


def peak_bytes() -> int:
    """This process's peak memory so far: CUDA's peak allocation on a GPU, the peak RSS on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def local_bytes(tensors) -> int:
    """Bytes of the parts of ``tensors`` this process holds (a sharded tensor's shard)."""
    total = 0
    for tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += tensor.numel() * tensor.element_size()
    return total


class Measure:
    """After each step (the last one's kept: the first step's backward ran before AdamW had its state, so its peak
    is below a steady step's): the optimizer state; gradients are the trainable weights' size (zeroed by then)."""

    def __init__(self, process: int):
        self.figures, self.built, self.process = {}, 0, process

    def on_step_end(self, trainer) -> None:
        parameters = [p for p in trainer.model.parameters()]
        state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        self.figures = {
            "weights": local_bytes(parameters),
            "gradients": local_bytes(p for p in parameters if p.requires_grad),
            "optimizer": local_bytes(state),
            "peak": peak_bytes(),
            "built": self.built,
            "process": self.process,
        }


def worker(args) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer import TrainConfig, Trainer

    # The process before any model: torch, transformers, accelerate (a GPU's allocator counts none of it).
    process = peak_bytes()
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, vocab_size=args.vocab, n_positions=args.seq_len
    )
    if args.model == "llama":  # a model with a tensor-parallel plan (GPT-2 has none), of the same shape
        from transformers import LlamaConfig, LlamaForCausalLM

        config, GPT2LMHeadModel = (
            LlamaConfig(  # noqa: N806 - the class the rest of the worker builds
                hidden_size=args.width,
                intermediate_size=4 * args.width,
                num_hidden_layers=args.layers,
                num_attention_heads=args.width // 64,
                vocab_size=args.vocab,
                max_position_embeddings=args.seq_len,
                tie_word_embeddings=not args.untied,
            ),
            LlamaForCausalLM,
        )
    if args.start_from == "pretrained":  # the process group up first: transformers' cpu-RAM-efficient loading asks
        from trainer import distributed_state

        distributed_state()
        model = GPT2LMHeadModel.from_pretrained(args.pretrained)
    else:
        with torch.device("meta" if args.start_from == "meta" else "cpu"):
            model = GPT2LMHeadModel(config)
    built = peak_bytes()
    tokens = torch.randint(0, args.vocab, (64, args.seq_len))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    measure = Measure(process)
    measure.built = built
    config = TrainConfig(
        output_dir=args.out,
        max_steps=3,
        batch_size=args.batch_size,
        log_every=2,
        preemption_signals="",
        chunked_loss=args.chunked_loss,
        activation_checkpointing=args.activation_checkpointing,
    )
    trainer = Trainer(model, config, train_data=data, callbacks=[measure])
    trainer.fit()
    from accelerate.utils import gather_object

    rows = gather_object([measure.figures])
    if trainer.accelerator.is_main_process:
        print(
            "MEASURED "
            + json.dumps(
                {
                    "parameters": trainer.strategy.sharded.parameters
                    if getattr(trainer.strategy, "sharded", None)
                    else sum(p.numel() for p in model.parameters()),
                    "ranks": rows,
                }
            )
        )


def launch_measured(script: str, processes: int, flags: list[str], settings: dict[str, str], what: str) -> Any:
    """torchrun of ``script --worker flags`` on ``processes`` CPU processes; what its main process printed after
    ``MEASURED``. glibc's mmap threshold is fixed: its default raises it as large blocks are freed and then keeps
    freed memory, so the RSS would count tensors long gone (a GPU allocator's peak would not)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "MALLOC_MMAP_THRESHOLD_": "65536",
        **settings,
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        script,
        "--worker",
        *flags,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    line = next((line for line in result.stdout.splitlines() if line.startswith("MEASURED ")), None)
    if line is None:
        raise SystemExit(f"{what} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(line.removeprefix("MEASURED "))


def run(kind: str, processes: int, args) -> dict | None:
    start, settings = KINDS[kind]
    mesh = mesh_settings(kind, processes)
    if mesh is None or mesh.get("PARALLELISM_CONFIG_TP_SIZE", "1") != "1" and args.model != "llama":
        return None  # a mesh that does not fit these processes; tensor parallelism needs a plan (--model llama)
    settings = {**settings, **mesh}
    out = Path(args.out) / f"{kind.replace(', ', '-')}-{processes}"
    flags = [
        "--out",
        str(out),
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--vocab",
        str(args.vocab),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--start-from",
        start,
        "--pretrained",
        str(Path(args.out) / "pretrained"),
        "--model",
        args.model,
        *(["--chunked-loss"] if args.chunked_loss else []),
        *(["--activation-checkpointing"] if args.activation_checkpointing else []),
        *(["--untied"] if args.untied else []),
    ]
    return launch_measured(__file__, processes, flags, settings, f"{kind} x {processes}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument(
        "--model",
        choices=["gpt2", "llama"],
        default="gpt2",
        help="llama: the same shape with a tensor-parallel plan (the TP kind runs only with it)",
    )
    parser.add_argument("--chunked-loss", action="store_true", help="chunked_loss: true in every run")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recomputed blocks in every run")
    parser.add_argument("--untied", action="store_true", help="llama: its own embeddings and head, not tied")
    parser.add_argument("--out", default="runs/benchmark-memory")
    parser.add_argument("--start-from", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--pretrained", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if "FSDP2, pretrained" in args.kinds:  # the checkpoint from_pretrained reads
        from transformers import GPT2Config, GPT2LMHeadModel

        GPT2LMHeadModel(
            GPT2Config(
                n_layer=args.layers,
                n_embd=args.width,
                n_head=args.width // 64,
                vocab_size=args.vocab,
                n_positions=args.seq_len,
            )
        ).save_pretrained(Path(args.out) / "pretrained")
    mib = 2**20
    where = "GPU" if torch.cuda.is_available() else "RSS"
    print(
        f"| processes | kind | weights MiB | gradients MiB | AdamW state MiB | total MiB | vs DDP | peak {where} "
        f"MiB, built | peak {where} MiB, 3 steps | vs DDP | peak over the process MiB | vs DDP |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    parameters = 0
    for processes in args.processes:
        ddp_total = ddp_peak = ddp_above = None
        for kind in args.kinds:
            measured = run(kind, processes, args)
            if measured is None:
                continue
            rank0, parameters = measured["ranks"][0], measured["parameters"]
            total = rank0["weights"] + rank0["gradients"] + rank0["optimizer"]
            peak, built = max(r["peak"] for r in measured["ranks"]), max(r["built"] for r in measured["ranks"])
            # Each process's peak over its own start (torch and the libraries), the largest over the processes.
            above = max(r["peak"] - r["process"] for r in measured["ranks"])
            ddp_total, ddp_peak, ddp_above = ddp_total or total, ddp_peak or peak, ddp_above or above
            print(
                f"| {processes} | {kind} | {rank0['weights'] / mib:,.1f} | {rank0['gradients'] / mib:,.1f} | "
                f"{rank0['optimizer'] / mib:,.1f} | {total / mib:,.1f} | {total / ddp_total:.2f} | "
                f"{built / mib:,.0f} | {peak / mib:,.0f} | {peak / ddp_peak:.2f} | {above / mib:,.0f} | "
                f"{above / ddp_above:.2f} |",
                flush=True,
            )
    print(
        f"(tensors: rank 0 of each run; peaks: the largest over the ranks; {args.model} {parameters:,} "
        "parameters; the first kind of each row group is the baseline)"
    )


if __name__ == "__main__":
    main()
