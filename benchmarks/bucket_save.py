"""How long a checkpoint takes to a bucket (``checkpoint_storage: s3://...``) against the local disk, and how long a
resume from each takes: a sharded (FSDP2) GPT-2 of 24M parameters (276 MB with AdamW state) on 2 processes, both
stores in the same processes, rounds alternating. The bucket is moto's S3 server on loopback, in a process of its
own: a stand-in that measures this trainer's part (each rank's upload, the CRC-32 of every byte, the commit, the
download and its check), not a cloud's network.

    pip install -e ".[test]"; python benchmarks/bucket_save.py     # 2 processes through torchrun, about 2 minutes
"""

from __future__ import annotations

import os
import shutil
import socket
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
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def build(out: str, storage: str | None, resume: str | None):
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=10_000, n_positions=128))
    tokens = torch.randint(0, 10_000, (8, 128))
    config = TrainConfig(
        output_dir=out,
        max_steps=1,
        batch_size=2,
        keep_last=1,
        preemption_signals="",
        checkpoint_storage=storage,
        resume=resume,
    )
    return Trainer(model, config, train_data=[{"input_ids": row, "labels": row} for row in tokens])


def worker(out: str, url: str) -> None:
    stores = {"local disk": None, "bucket": url}
    trainers = {name: build(f"{out}/{name}", storage, None) for name, storage in stores.items()}
    for trainer in trainers.values():
        trainer.fit()  # the optimizer state exists
    saves = {name: [] for name in stores}
    resumes = {name: [] for name in stores}
    for _ in range(ROUNDS):
        for name, trainer in trainers.items():
            started = time.perf_counter()
            trainer.save_checkpoint()
            saves[name].append(time.perf_counter() - started)
    for _ in range(ROUNDS):
        for name, storage in stores.items():
            started = time.perf_counter()
            build(f"{out}/{name}-resumed-{len(resumes[name])}", storage, "auto" if storage else None)
            if storage is None:  # the disk's resume: the same checkpoint, loaded by path
                trainers[name].load_checkpoint(trainers[name].last_checkpoint)
            resumes[name].append(time.perf_counter() - started)
    disk = trainers["local disk"]
    if disk.accelerator.is_main_process:
        size = sum(f.stat().st_size for f in disk.last_checkpoint.rglob("*") if f.is_file())
        print(f"checkpoint of {size / 1e6:.0f} MB, {disk.accelerator.num_processes} processes, medians of {ROUNDS}:")
        for what, timings in (("save", saves), ("resume (a Trainer built and loaded)", resumes)):
            for name, values in timings.items():
                print(f"  {what}, {name}: {statistics.median(values):.2f} s  ({', '.join(f'{v:.2f}' for v in values)})")
            ratio = statistics.median(timings["bucket"]) / statistics.median(timings["local disk"])
            print(f"  {what}: the bucket takes x{ratio:.2f} the local disk's time")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3])
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    out = tempfile.mkdtemp(prefix="bucket-save-", dir=Path("runs").resolve() if Path("runs").is_dir() else None)
    try:
        os.environ.update(env)
        import fsspec

        for _ in range(50):  # the server up
            try:
                fsspec.filesystem("s3").mkdir("bench")
                break
            except Exception:
                time.sleep(0.2)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        command += [__file__, "--worker", out, "s3://bench/run"]
        status = subprocess.run(command, env={**env, **FSDP2_ENV}).returncode
    finally:
        server.kill()
        shutil.rmtree(out, ignore_errors=True)
    raise SystemExit(status)


if __name__ == "__main__":
    main()
