"""The minGPU exercise on the trainer: one process and K processes reach the same updates.

A linear model on a toy regression, trained by the Trainer. After every optimizer step the main process prints the
loss of the whole data set, so runs can be compared line by line; at the end it prints which examples each process
saw in each iteration (1-based, as the exercise's tables) and writes both to <output_dir>/same_updates.json.

    # SGD on a summed loss: K processes at batch B need lr x K to match one process at batch K x B
    python examples/same_updates.py --no_shuffle --epochs 3 --opt sgd --batch_size 10 --lr 1
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/same_updates.py \
        --no_shuffle --epochs 3 --opt sgd --batch_size 5 --lr 2
    torchrun --standalone --nproc_per_node 2 examples/same_updates.py --no_shuffle --epochs 3 --opt sgd \
        --batch_size 5 --lr 2

    # a mean loss (--loss mean) needs no lr scaling; neither does Adam (here with eps 0)
    python examples/same_updates.py --no_shuffle --epochs 3 --opt adam --batch_size 10 --lr 1 --eps 0
    torchrun --standalone --nproc_per_node 2 examples/same_updates.py --no_shuffle --epochs 3 --opt adam \
        --batch_size 5 --lr 1 --eps 0

    # the sharding tables: 9 examples, 2 processes, batch 3 (padded tail; then with --drop_last)
    torchrun --standalone --nproc_per_node 2 examples/same_updates.py --num_examples 9 --dim 1 --batch_size 3 \
        --epochs 1 --no_shuffle [--drop_last]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from accelerate.utils import gather_object

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from trainer import TrainConfig, Trainer  # noqa: E402


class RegressionData(torch.utils.data.Dataset):
    """``num_examples`` points of a noisy linear function; the same on every process for a given seed."""

    def __init__(self, num_examples: int, dim: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = 0.1 * torch.randn(num_examples, dim, generator=generator)
        self.y = self.x @ torch.randn(dim, generator=generator) + 0.01 * torch.randn(num_examples, generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"index": i, "x": self.x[i], "y": self.y[i]}


class SquaredError:
    """The loss; also records which examples this process saw in each micro-batch."""

    def __init__(self, reduction: str):
        self.reduction = reduction
        self.seen: list[list[int]] = []

    def __call__(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        self.seen.append(batch["index"].tolist())
        errors = (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        return errors.sum() if self.reduction == "sum" else errors.mean()


class FullDataLoss:
    """After each optimizer step: the mean squared error over every example, the same figure on any world size."""

    def __init__(self, data: RegressionData):
        self.data = data
        self.losses: list[float] = []

    @torch.no_grad()
    def on_step_end(self, trainer: Trainer) -> None:
        model = trainer.unwrapped_model
        device = next(model.parameters()).device
        prediction = model(self.data.x.to(device)).squeeze(-1).float().cpu()
        self.losses.append(((prediction - self.data.y) ** 2).mean().item())
        trainer.accelerator.print(f"iteration {trainer.global_step} | loss {self.losses[-1]:.8f}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no_shuffle", action="store_true", help="keep the data in order (the exercise's runs)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--opt", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--batch_size", type=int, default=10, help="per process")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--eps", type=float, default=1e-8, help="Adam's epsilon (0 makes Adam scale-invariant)")
    parser.add_argument("--num_examples", type=int, default=40)
    parser.add_argument("--dim", type=int, default=10)
    parser.add_argument("--drop_last", action="store_true", help="drop the M mod K tail examples instead of padding")
    parser.add_argument("--loss", choices=["sum", "mean"], default="sum", help="how a batch's errors are reduced")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="runs/same_updates")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = TrainConfig(
        output_dir=args.output_dir,
        experiment_name="same_updates",
        seed=args.seed,
        epochs=args.epochs,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        optimizer=args.opt,
        lr=args.lr,
        eps=args.eps,
        betas=(0.9, 0.999),
        shuffle=not args.no_shuffle,
        drop_last=args.drop_last,
        log_every=1000,
    )
    torch.manual_seed(args.seed)  # the same initial weights on every process and for every world size
    model = torch.nn.Linear(args.dim, 1, bias=False)  # no bias: a summed loss would give it curvature 2 x batch
    data = RegressionData(args.num_examples, args.dim, seed=args.seed)
    loss_fn, full_loss = SquaredError(args.loss), FullDataLoss(data)
    trainer = Trainer(model, config, train_data=data, loss_fn=loss_fn, callbacks=[full_loss])
    trainer.fit()

    seen_by_process = gather_object([loss_fn.seen])  # [process][micro-batch] -> example indices
    summary = {
        "world_size": trainer.accelerator.num_processes,
        "losses": full_loss.losses,
        "weights": torch.cat([p.detach().flatten().cpu() for p in trainer.unwrapped_model.parameters()]).tolist(),
        "seen": seen_by_process,
    }
    if trainer.accelerator.is_main_process:
        print("examples seen (1-based, as in the exercise's tables):")
        for i, batches in enumerate(zip(*seen_by_process, strict=True), start=1):
            shares = " | ".join(f"process {k + 1}: " + " ".join(f"x{j + 1}" for j in b) for k, b in enumerate(batches))
            print(f"  iteration {i} | {shares}")
        os.makedirs(args.output_dir, exist_ok=True)
        Path(args.output_dir, "same_updates.json").write_text(json.dumps(summary))
        print(f"final weights: {' '.join(f'{w:.6f}' for w in summary['weights'])}")
    return summary


if __name__ == "__main__":
    main()
