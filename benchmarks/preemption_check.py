"""What the per-step preemption check costs: a 2-process DDP step on a tiny MLP (gloo, CPU), with and without
``PreemptionWatch.agreed()`` after each step, run side by side in the same processes, rounds alternating.

    torchrun --standalone --nproc_per_node 2 benchmarks/preemption_check.py      # about 30 s on a 2-core CPU

The check is one asynchronous 4-byte all-reduce on a gloo group of its own, issued at step n and read at step n+1:
this measures what a step pays for it when checked at every step, and at the trainer's pace (once a second of
training, after the first log), as mean step times (the paced check's cost falls on one step in many).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer.launch.preemption import PreemptionWatch  # noqa: E402
from trainer.launch.run import host_group  # noqa: E402

STEPS, ROUNDS = 1000, 5


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 1)

    def steps(check) -> list[float]:
        times = []
        for step in range(1, STEPS + 1):
            started = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            check(step)
            times.append(time.perf_counter() - started)
        return times

    results = {"without": [], "every step": [], "paced": []}
    # What the watch reads of the job's Run: the configured signals, the grace, the host (gloo) group.
    config = SimpleNamespace(signal_names=("SIGTERM",), preemption_grace_s=180)
    run = SimpleNamespace(config=config, host=host_group(dist.get_world_size(), 1800.0))
    with PreemptionWatch(run) as watch:
        for _ in range(ROUNDS):
            results["without"] += steps(lambda step: None)
            watch.pace(float("inf"))  # a check every step
            watch.check_every = 1
            results["every step"] += steps(watch.agreed)
            # As the trainer paces it (one check a second), from a figure every rank has alike, as its log's gather
            step_time = torch.tensor(statistics.median(results["without"]))
            dist.all_reduce(step_time, op=dist.ReduceOp.MAX)
            watch.pace(step_time.item())
            watch.agreed(0)  # the pace takes over at the next check
            results["paced"] += steps(watch.agreed)
    if int(os.environ["RANK"]) == 0:
        base, every, paced = (statistics.mean(results[k]) * 1e6 for k in ("without", "every step", "paced"))
        print(
            f"2-process DDP step, tiny MLP on CPU (gloo), mean of {ROUNDS} x {STEPS} steps: {base:.0f} us without "
            f"the check; checked every step {every:.0f} us (x{every / base:.3f}); checked once a second as the "
            f"trainer does (every {watch.check_every} steps) {paced:.0f} us (x{paced / base:.3f})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
