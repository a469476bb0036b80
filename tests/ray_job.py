"""tests/ragged_lm.py's job under Ray Train on a local Ray cluster of CPU workers: TorchTrainer starts the workers and
their process group (gloo), each worker takes the accelerate config's settings (trainer.accelerate_env) and runs
the job; with ``--crash_at N`` the last worker dies after step N in the first attempt only, and Ray's
FailureConfig restarts the workers, which resume from the job's last checkpoint (resume: auto).

    python tests/ray_job.py --out DIR --config_file accelerate_configs/fsdp.yaml [--crash_at N] -- [ragged_lm flags]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def train_loop_per_worker(config: dict) -> None:
    import os

    import torch.distributed as dist

    from trainer import accelerate_env

    os.environ.update(accelerate_env(config["config_file"]))
    sys.path.insert(0, str(TESTS))
    import ragged_lm

    marker = Path(config["out"]) / "crashed-once"
    first_attempt = not marker.exists()  # read by every rank before any writes it
    dist.barrier()
    flags = list(config["flags"])
    if config["crash_at"] and first_attempt:
        flags += ["--crash_at", str(config["crash_at"])]
        if dist.get_rank() == 0:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    sys.argv = ["ragged_lm.py", "--out", config["out"], *flags]
    ragged_lm.main()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config_file", required=True)
    parser.add_argument("--crash_at", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    args, flags = parser.parse_known_args()
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=True)
    result = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "out": args.out,
            "config_file": args.config_file,
            "crash_at": args.crash_at,
            "flags": [f for f in flags if f != "--"],
        },
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(
            name="ragged", storage_path=str(Path(args.out, "ray")), failure_config=FailureConfig(max_failures=1)
        ),
    ).fit()
    print("RAY RESULT", "error" if result.error else "ok", flush=True)
    ray.shutdown()
    sys.exit(1 if result.error else 0)


if __name__ == "__main__":
    main()
