"""The job of PyTorch's DDP tutorial series (pytorch/examples ddp-tutorial-series) on the trainer: a small MLP on
2,048 random examples. Arguments as in the tutorial: total epochs, then how often to save a checkpoint (in epochs).

    python examples/mlp.py 50 10
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/mlp.py 50 10
    torchrun --standalone --nproc_per_node 2 examples/mlp.py 50 10 --batch_size 32

Every process prints the tutorial's line at the start of each epoch, ``[GPU0] Epoch 0 | Batchsize: 32 | Steps: 32``
(``[CPU0]`` on a CPU). Started again with the same output directory, it picks up where it stopped: from the
latest checkpoint, mid-epoch if that is where it was, under any launcher.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from trainer import TrainConfig, Trainer  # noqa: E402

NUM_EXAMPLES = 2048


class RandomData(torch.utils.data.Dataset):
    """The tutorial's MyTrainDataset: (20 random inputs, 1 random target) pairs, fixed by the seed."""

    def __init__(self, size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.rand(size, 20, generator=generator), torch.rand(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def mse(model: torch.nn.Module, batch) -> torch.Tensor:
    source, targets = batch
    return torch.nn.functional.mse_loss(model(source), targets)


class TutorialLine:
    """``[GPU{rank}] Epoch {e} | Batchsize: {b} | Steps: {n}`` from every process, as the tutorial prints it."""

    def on_epoch_begin(self, trainer: Trainer) -> None:
        device = trainer.accelerator.device.type
        tag = "GPU" if device == "cuda" else device.upper()
        line = (
            f"[{tag}{trainer.accelerator.process_index}] Epoch {trainer.epoch} | "
            f"Batchsize: {trainer.config.batch_size} | Steps: {trainer.batches_per_epoch}\n"
        )
        sys.stdout.write(line)  # one write: print() writes the newline separately, and ranks share the terminal
        sys.stdout.flush()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="the DDP tutorial series' MLP job on the trainer")
    parser.add_argument("total_epochs", type=int, help="how many epochs to train")
    parser.add_argument("save_every", type=int, help="save a checkpoint every this many epochs")
    parser.add_argument("--batch_size", type=int, default=32, help="per process (default: 32)")
    parser.add_argument("--output_dir", default="runs/mlp")
    args = parser.parse_args(argv)

    # save_every counts optimizer steps in the trainer; the tutorial counts epochs. Each process reads
    # ceil(N / processes) examples an epoch (DistributedSampler), in batches of batch_size.
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    steps_per_epoch = math.ceil(math.ceil(NUM_EXAMPLES / processes) / args.batch_size)
    config = TrainConfig(
        output_dir=args.output_dir,
        experiment_name="mlp",
        epochs=args.total_epochs,
        batch_size=args.batch_size,
        optimizer="sgd",
        lr=1e-3,
        resume="auto",
        save_every=args.save_every * steps_per_epoch,
        log_every=steps_per_epoch,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    trainer = Trainer(model, config, train_data=RandomData(NUM_EXAMPLES), loss_fn=mse, callbacks=[TutorialLine()])
    result = trainer.fit()
    trainer.accelerator.print(f"done: step {result['global_step']}, final model in {args.output_dir}/final")
    return result


if __name__ == "__main__":
    main()
