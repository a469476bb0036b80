"""Every host read of a tensor during ``fit()`` (``.item()``, ``.tolist()``, ``bool()``, ``float()``, ``int()``,
``.numpy()``, ``.cpu()``), attributed to the optimizer step it happened in: on a GPU each is a wait for the device,
so the steps that do not log must make none. Reads by the data pipeline (host data before it reaches the device)
and by the optimizer's own step counters (CPU tensors) are not the trainer's and are left out.

    accelerate launch --config_file accelerate_configs/fsdp.yaml tests/jobs/host_reads.py --out runs/reads

Two jobs in the same processes: FSDP2 with the model's own token-weighted loss, and DDP with a ``(loss_sum,
count)`` loss; both with accumulation, clipping and two figures of the user's (``trainer.log``) at every step.
Writes <out>/reads.json on the main process: {job: {"logging_steps": [...], "reads": {step: ["file:line what",
...]}}}; the reads of an evaluate() after ``fit()`` are under "evaluate".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ragged_lm import pair_loss, ragged_rows, tiny_gpt2  # noqa: E402

from trainer import TrainConfig, Trainer  # noqa: E402

READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}
NOT_OURS = ("/torch/utils/data/", "/torch/optim/")  # the data pipeline's host tensors; AdamW's CPU step counters
PACKAGE = str(Path(__file__).resolve().parents[2] / "trainer") + "/"
TORCH = str(Path(torch.__file__).parent) + "/"


class CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.step, self.reads = 0, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            frames = traceback.extract_stack()[:-1]
            files = [frame.filename for frame in frames]
            # Whose read: the innermost caller outside torch (transformers' model code reads its own inputs).
            caller = next((frame for frame in reversed(frames) if not frame.filename.startswith(TORCH)), None)
            ours = caller is not None and caller.filename.startswith(PACKAGE)
            if ours and not any(part in name for name in files for part in NOT_OURS):
                where = f"{Path(caller.filename).name}:{caller.lineno} {func.__name__}"
                self.reads.setdefault(self.step, []).append(where)
        return func(*args, **(kwargs or {}))


def job(out: str, loss: str) -> dict:
    rows = ragged_rows(48)
    config = TrainConfig(
        output_dir=out,
        batch_size=2,
        gradient_accumulation_steps=2,
        optimizer="adamw",
        lr=0.01,
        max_grad_norm=1.0,
        max_steps=6,
        log_every=3,
        shuffle=False,
        preemption_signals="",
    )
    collate = lambda batch: {k: v for k, v in torch.utils.data.default_collate(batch).items() if k != "index"}  # noqa: E731

    class Figures:  # two figures of the user's, as device tensors, at every step: read at the log, once
        def on_step_end(self, trainer):
            weight = next(trainer.model.parameters())
            trainer.log({"weight_mean": weight.detach().mean(), "weight_max": weight.detach().max()})

    trainer = Trainer(
        tiny_gpt2(),
        config,
        train_data=rows,
        collate_fn=collate,
        loss_fn=pair_loss if loss == "pair" else None,
        callbacks=[Figures()],
    )
    counter = CountReads()
    run, after = trainer.steps.run, trainer._after_step

    def counted_run(window, step, *, measure_norm):
        counter.step = step
        return run(window, step, measure_norm=measure_norm)

    def counted_after(bar):
        counter.step = trainer.global_step
        return after(bar)

    trainer.steps.run, trainer._after_step = counted_run, counted_after
    with counter:
        trainer.fit()
        counter.step = "evaluate"  # 9 rows: 5 and 4 per process, 3 and 2 batches (a sharded model's in lockstep)
        trainer.evaluate(rows[:9])
    return {"logging_steps": [step for step in range(1, 7) if trainer._logs(step)], "reads": counter.reads}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    found = {"fsdp, the model's loss": job(f"{args.out}/fsdp", "default")}
    sharding = os.environ.pop("ACCELERATE_USE_FSDP", None)
    found["ddp, (loss_sum, count)"] = job(f"{args.out}/ddp", "pair")
    if sharding is not None:
        os.environ["ACCELERATE_USE_FSDP"] = sharding
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "reads.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
