"""What our Trainer costs on a GPU: GPT-2 124M in bf16 through a hand-written PyTorch loop, a raw Accelerate loop,
our Trainer and the trainers users would pick instead (transformers' and Lightning's, each with its fastest settings;
rows left out where one is not installed), as transformers' GPT2LMHeadModel and as a compact GPT
(benchmarks/compact_gpt.py, whose fast step shows a trainer's own per-step cost), in three modes: eager, compiled
(the whole model) and blocks (each block's forward compiled on its own: torchtitan's recipe, accelerate's regional
compilation); and GPT2LMHeadModel sharded with FSDP2 (eager and per block), through a hand-written ``fully_shard``
loop and through our Trainer with fsdp.yaml's settings, on a mesh of the one GPU. One table: tokens/s, MFU, ms/step,
peak memory, and each variant's speed and memory against the raw PyTorch loop.

    bash benchmarks/gpu.sh                       # the whole grid on one GPU: 25-30 minutes (--modes splits it)
    python benchmarks/gpu.py --models hf --modes blocks --batches 16 --variants torch,ours,fsdp_torch,fsdp_ours
    python benchmarks/gpu.py --smoke             # the same code on a tiny model, on the CPU, in a few minutes
    python benchmarks/gpu.py --size cpu --models hf --modes compiled,blocks --batches 8 --variants torch,ours \
        --steps 30 --warmup 10                   # a 2-block GPT-2 with GPT-2's vocabulary (the logits' weight), CPU

Every variant: the same weights and tokens (seed 0), 1024 tokens x B sequences a step, AdamW (fused on the GPU,
no weight decay, as the Trainer's default), a constant lr, bf16 autocast (the raw loop's own; accelerate's and ours
from ACCELERATE_MIXED_PRECISION=bf16, as `accelerate launch --config_file accelerate_configs/bf16.yaml` sets it),
batches from a DataLoader with pinned memory and non-blocking copies, the loss read on the host every 25 steps.
Each run is a fresh process; rounds alternate the variants. Timed: the steps after warm-up, between two device
synchronisations; the warm-up ends with the first log (its one-time costs), and two more logs fall in the window.
Peak memory: CUDA's peak allocated bytes; on a CPU the worker's peak resident memory over the timed steps (Linux's
high-water mark, reset after warm-up; large blocks go back to the system when freed, MALLOC_MMAP_THRESHOLD_).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
VARIANTS = {
    "torch": "raw PyTorch loop",
    "accelerate": "raw Accelerate loop",
    "ours": "our Trainer",
    "hf_trainer": "transformers' Trainer",
    "lightning": "Lightning's Trainer",
    "fsdp_torch": "hand-written fully_shard loop",
    "fsdp_ours": "our Trainer, FSDP2",
}
PEERS = {"hf_trainer": "transformers", "lightning": "lightning"}  # each optional where it is not installed
SHARDED = ("fsdp_torch", "fsdp_ours")  # GPT2LMHeadModel, eager: one process as a 1-GPU mesh (sharding costs, no gain)
FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}
LOG_EVERY = 25  # the warm-up is one log period: every variant logs twice in the timed window
SIZES = {
    "full": dict(n_layer=12, n_embd=768, n_head=12, seq=1024, vocab=50304),
    "smoke": dict(n_layer=2, n_embd=64, n_head=2, seq=64, vocab=512),
    "cpu": dict(n_layer=2, n_embd=256, n_head=4, seq=256, vocab=50304),
}


def build(model_name: str, size: dict, examples: int):
    import torch

    torch.manual_seed(0)
    if model_name == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=size["vocab"],
                n_positions=size["seq"],
                n_embd=size["n_embd"],
                n_layer=size["n_layer"],
                n_head=size["n_head"],
                # No key-value cache in training (our Trainer turns it off): each block's cache would recompile
                # a per-block compiled block, past dynamo's limit of 8, and the rest run eagerly.
                use_cache=False,
            )
        )
    else:
        from compact_gpt import CompactGPT

        model = CompactGPT(size["vocab"], size["seq"], size["n_layer"], size["n_embd"], size["n_head"])
    tokens = torch.randint(0, size["vocab"], (examples, size["seq"]), generator=torch.Generator().manual_seed(0))
    return model, [{"input_ids": t, "labels": t} for t in tokens]


def flops_per_token(model, size: dict) -> float:
    """6N (forward + backward) plus attention's 12 x layers x width x sequence, N counting tied weights once."""
    n_params = sum(p.numel() for p in model.parameters())
    return 6 * n_params + 12 * size["n_layer"] * size["n_embd"] * size["seq"]


class Clock:
    """Called after every optimizer step: synchronises the device after warm-up and at the end, and times between."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total, self.steps = warmup, total, 0
        self.started = self.seconds = None

    def tick(self) -> None:
        import torch

        self.steps += 1
        if self.steps in (self.warmup, self.total):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if self.steps == self.warmup:
                reset_peak_memory()
                self.started = time.perf_counter()
            else:
                self.seconds = (time.perf_counter() - self.started) / (self.total - self.warmup)


def reset_peak_memory() -> None:
    """The peak from here on: CUDA's, or this process's resident set's high-water mark (Linux: clear_refs 5)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    elif Path("/proc/self/clear_refs").exists():
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_gb() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    status = Path("/proc/self/status")
    high = [line for line in status.read_text().splitlines() if line.startswith("VmHWM")] if status.exists() else []
    return int(high[0].split()[1]) / 2**20 if high else float("nan")


def blocks_of(model) -> list:
    return list(model.transformer.h if hasattr(model, "transformer") else model.blocks)


def compile_blocks(model) -> None:
    """torchtitan's recipe: each block's forward compiled on its own, and the loss (a transformers model's
    ``loss_function``; the compact GPT computes its loss in its forward, eagerly)."""
    import torch

    for block in blocks_of(model):
        block.forward = torch.compile(block.forward)
    if hasattr(type(model), "loss_function"):
        model.loss_function = torch.compile(model.loss_function)


def run_torch(model, data, batch: int, mode: str, clock: Clock, sharded: bool = False) -> None:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device)
    if mode == "blocks":  # before fully_shard where sharded
        compile_blocks(model)
    if sharded:  # torch's FSDP2 recipe: each block, then the root; bf16 compute, fp32 masters and reduction
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in blocks_of(model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, fused=cuda or None)
    forward = torch.compile(model) if mode == "compiled" else model
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, pin_memory=cuda)
    model.train()
    for step, examples in enumerate(loader, 1):
        examples = {k: v.to(device, non_blocking=True) for k, v in examples.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(**examples).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            loss.item()
        clock.tick()
        if step == clock.total:
            return


def run_accelerate(model, data, batch: int, mode: str, clock: Clock) -> None:
    """As accelerate's examples write it: prepare, then backward through the Accelerator; its loader's copies
    non-blocking from pinned memory, as the docstring promises for every variant (accelerate's default blocks)."""
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import TorchDynamoPlugin

    compiled = {"eager": "no", "compiled": "inductor", "blocks": "inductor"}[mode]
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
        dynamo_plugin=TorchDynamoPlugin(backend=compiled, use_regional_compilation=mode == "blocks"),
    )  # bf16 from the environment
    model.to(accelerator.device)
    cuda = accelerator.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, fused=cuda or None)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, pin_memory=cuda)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for step, examples in enumerate(loader, 1):
        loss = model(**examples).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % LOG_EVERY == 0:
            loss.item()
        clock.tick()
        if step == clock.total:
            return


def run_hf_trainer(model, data, batch: int, mode: str, clock: Clock) -> None:
    """transformers' Trainer with its fastest settings: bf16, fused AdamW, pinned memory, torch_compile when compiled
    (the whole model; for "blocks" its Accelerator reads ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION as ours does and
    compiles the blocks alone, its loss eager)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    cuda = torch.cuda.is_available()
    arguments = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        max_steps=clock.total + 1,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        bf16=True,
        torch_compile=mode != "eager",
        logging_steps=LOG_EVERY,
        save_strategy="no",
        report_to=[],
        dataloader_pin_memory=cuda,
        disable_tqdm=True,
        use_cpu=not cuda,
    )
    Trainer(model=model, args=arguments, train_dataset=data, callbacks=[Tick()]).train()


def run_lightning(model, data, batch: int, mode: str, clock: Clock) -> None:
    """Lightning's Trainer with its fastest settings: bf16-mixed, fused AdamW, pinned memory, the model compiled when
    compiled (each block's forward on its own for "blocks", as the raw loop does)."""
    import lightning as L
    import torch

    cuda = torch.cuda.is_available()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, examples, index):
            loss = self.model(**examples).loss
            if (index + 1) % LOG_EVERY == 0:
                self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.0, fused=cuda or None)

    class Tick(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, examples, index):
            clock.tick()

    if mode == "blocks":
        compile_blocks(model)
    elif mode == "compiled":  # the model in place: torch.compile of the LightningModule itself fails in dynamo
        model.compile()
    module = Module()
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, pin_memory=cuda)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=clock.total + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=LOG_EVERY,
        callbacks=[Tick()],
    )
    trainer.fit(module, loader)


def run_fsdp_torch(model, data, batch: int, mode: str, clock: Clock) -> None:
    run_torch(model, data, batch, mode, clock, sharded=True)


def run_fsdp_ours(model, data, batch: int, mode: str, clock: Clock) -> None:
    run_ours(model, data, batch, mode, clock)  # FSDP2 from the environment, as fsdp.yaml sets it (always per block)


def run_ours(model, data, batch: int, mode: str, clock: Clock) -> None:
    """compile: true; per block as the accelerate config's dynamo_use_regional_compilation asks (measure())."""
    from trainer import TrainConfig, Trainer

    class Tick:
        def on_step_end(self, trainer):
            clock.tick()

    # One step past the window: the Trainer also logs at its last step, which the raw loops do not.
    config = TrainConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=clock.total + 1,
        batch_size=batch,
        lr=3e-4,
        log_every=LOG_EVERY,
        compile=mode != "eager",
        stall_warning_s=None,
    )
    trainer = Trainer(model, config, train_data=data, callbacks=[Tick()])
    trainer.save_model = lambda *a, **kw: None  # the 500 MB export at the end is not part of a step
    trainer.fit()


def worker(args) -> None:
    size = SIZES[args.size]
    model, data = build(args.model, size, (args.steps + 2) * args.batch)
    per_token = flops_per_token(model, size)
    clock = Clock(args.warmup, args.steps)
    globals()[f"run_{args.variant}"](model, data, args.batch, args.mode, clock)
    print(
        "RESULT "
        + json.dumps(
            {
                "step_s": clock.seconds,
                "tokens_per_s": args.batch * size["seq"] / clock.seconds,
                "flops_per_token": per_token,
                "peak_gb": peak_memory_gb(),
            }
        ),
        flush=True,
    )


def measure(variant: str, model: str, mode: str, batch: int, args) -> dict | None:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--model",
        model,
        "--mode",
        mode,
        "--batch",
        str(batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--size",
        args.size,
    ]
    env = {
        **os.environ,
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "WANDB_MODE": "disabled",
        "TRANSFORMERS_VERBOSITY": "error",
        "MALLOC_MMAP_THRESHOLD_": "1048576",
    }
    if variant in SHARDED:  # a process group of one (as torchrun would make it), FSDP2 for ours
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(29500 + os.getpid() % 1000),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            **(FSDP2_ENV if variant == "fsdp_ours" else {}),
        )
    if mode == "blocks":
        env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = "true"
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        sys.stderr.write(f"{variant} {model} {mode} B={batch} failed:\n{done.stderr[-3000:]}\n")
        return None
    print(f"{variant} {model} {mode} B={batch}: {line.removeprefix('RESULT ')}", flush=True)  # kept if cut short
    return json.loads(line.removeprefix("RESULT "))


def peak_flops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    from trainer.telemetry.mfu import peak_flops_of  # dense bf16 peaks of common GPUs

    return peak_flops_of(torch.cuda.get_device_name(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="hf,compact", help="hf (GPT2LMHeadModel), compact (compact_gpt.py)")
    parser.add_argument("--modes", default="eager,compiled,blocks", help="blocks: each block compiled on its own")
    parser.add_argument("--batches", default="16,32", help="sequences per step (compact: the first only)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=75, help="steps in all, warm-up included")
    parser.add_argument("--warmup", type=int, default=LOG_EVERY)
    parser.add_argument("--size", choices=SIZES, default="full", help="cpu: 2 blocks of 256, GPT-2's vocabulary")
    parser.add_argument("--smoke", action="store_true", help="--size smoke: a tiny model, to try the script")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.size = "smoke" if args.smoke else args.size
    if args.worker:
        args.variant = args.worker
        return worker(args)

    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    peak = peak_flops()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(
        f"{device}, torch {torch.__version__}; bf16 peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s; "
        f"{args.steps - args.warmup} timed steps after {args.warmup}, {args.rounds} round(s)",
        flush=True,
    )
    batches = [int(b) for b in args.batches.split(",")]
    grid = [
        (model, mode, batch)
        for model in args.models.split(",")
        for mode in args.modes.split(",")
        for batch in (batches if model == "hf" else batches[:1])
    ]
    results: dict[tuple, dict[str, list[dict]]] = {}
    for _ in range(args.rounds):
        for key in grid:
            for variant in args.variants.split(","):
                if variant in SHARDED and (key[0] != "hf" or key[1] == "compiled"):
                    continue
                if variant == "hf_trainer" and key[0] != "hf":  # it reads the loss off a dict or ModelOutput only
                    continue
                if variant in PEERS and importlib.util.find_spec(PEERS[variant]) is None:
                    print(f"{VARIANTS[variant]}: not installed ({PEERS[variant]}), its rows left out", flush=True)
                    continue
                measured = measure(variant, *key, args)
                if measured:
                    results.setdefault(key, {}).setdefault(variant, []).append(measured)

    print("\n(FSDP2 rows: one process, a mesh of one GPU: what sharding's machinery costs, against DDP's row)")
    print(
        "| model | mode | B | variant | tokens/s | MFU | ms/step | peak GB | speed vs raw PyTorch | "
        "memory vs raw PyTorch |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (model, mode, batch), runs in results.items():
        base = runs.get("torch")
        for variant, measured in runs.items():
            step_s = statistics.median(m["step_s"] for m in measured)
            tokens = statistics.median(m["tokens_per_s"] for m in measured)
            memory = max(m["peak_gb"] for m in measured)
            mfu = f"{tokens * measured[0]['flops_per_token'] / peak:.1%}" if peak else "n/a"
            speed = statistics.median(b["step_s"] for b in base) / step_s if base else float("nan")
            memory_ratio = memory / max(b["peak_gb"] for b in base) if base else float("nan")
            name = "GPT2LMHeadModel" if model == "hf" else "compact GPT"
            print(
                f"| {name} | {mode} | {batch} | {VARIANTS[variant]} | {tokens:,.0f} | {mfu} | {1000 * step_s:.1f} | "
                f"{memory:.2f} | {speed:.3f} | {memory_ratio:.3f} |",
                flush=True,
            )
    out = ROOT / "runs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps({" ".join(map(str, k)): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
