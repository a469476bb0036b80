"""How long a step waits for a sharded (FSDP2) checkpoint: written in the step (``save_checkpoint()``) against
written in the background (``save_async``: the step waits for the copy to CPU memory only), side by side in the same
processes, rounds alternating. A GPT-2 of 24M parameters (92 MB of weights; 276 MB with AdamW state).

    python benchmarks/sharded_save.py            # 2 processes through torchrun, about a minute on a 2-core CPU
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROUNDS = 3
FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}


def worker(out: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=10_000, n_positions=128))
    tokens = torch.randint(0, 10_000, (8, 128))
    config = TrainConfig(output_dir=out, max_steps=1, batch_size=2, save_async=True, keep_last=1, preemption_signals="")
    trainer = Trainer(model, config, train_data=[{"input_ids": row, "labels": row} for row in tokens])
    trainer.fit()  # the optimizer state exists
    timings = {"in the step": [], "background: the step waits": [], "background: until committed": []}
    for _ in range(ROUNDS):
        started = time.perf_counter()
        trainer.save_checkpoint()
        timings["in the step"].append(time.perf_counter() - started)
        started = time.perf_counter()
        trainer.save_checkpoint(wait=False)
        timings["background: the step waits"].append(time.perf_counter() - started)
        trainer.wait_for_checkpoint()
        timings["background: until committed"].append(time.perf_counter() - started)
    if trainer.accelerator.is_main_process:
        size = sum(f.stat().st_size for f in trainer.last_checkpoint.rglob("*") if f.is_file())
        print(f"checkpoint of {size / 1e6:.0f} MB, {trainer.accelerator.num_processes} processes, medians of {ROUNDS}:")
        for name, values in timings.items():
            print(f"  {name}: {statistics.median(values):.2f} s  ({', '.join(f'{v:.2f}' for v in values)})")
        ratio = statistics.median(timings["background: the step waits"]) / statistics.median(timings["in the step"])
        print(f"  the step waits x{ratio:.2f} of a save in the step")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **FSDP2_ENV}
    out = tempfile.mkdtemp(prefix="sharded-save-", dir=Path("runs").resolve() if Path("runs").is_dir() else None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        "--worker",
        out,
    ]
    status = subprocess.run(command, env=env).returncode
    shutil.rmtree(out, ignore_errors=True)  # 311 MB of checkpoints that were only timed
    raise SystemExit(status)


if __name__ == "__main__":
    main()
