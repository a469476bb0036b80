"""A training script of this project (examples/gpt2.py unless --script says) under Ray Train, on the Ray cluster this
machine is part of (or a local one): Ray's TorchTrainer starts one worker per process and their process group;
each worker takes the accelerate config's settings (``trainer.accelerate_env``: DDP or FSDP2, mixed precision,
compile, the mesh) and runs the script as ``python script ARGS`` would. A worker that dies is restarted
(``--max-failures``), and the job resumes from its last checkpoint (gpt2.py resumes by default; pass
``--resume auto`` to a script that does not). The output directory must be on storage every node sees.

    pip install -e ".[ray]"
    python examples/ray/train.py --workers 2 --config-file accelerate_configs/multi_gpu.yaml -- --max-steps 50
    python examples/ray/train.py --workers 16 --gpu --config-file accelerate_configs/fsdp.yaml \\
        -- --output-dir /shared/runs/gpt2          # 16 GPU workers, the model sharded

Ray's own records of the run go to ``--storage-path``; checkpoints are the trainer's, in the script's output
directory (docs/clusters.md#ray).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def train_loop_per_worker(config: dict) -> None:
    from trainer import accelerate_env

    os.environ.update(accelerate_env(config["config_file"]))
    sys.argv = [config["script"], *config["args"]]
    runpy.run_path(config["script"], run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="processes in all (one per GPU with --gpu)")
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--config-file", default=str(ROOT / "accelerate_configs" / "multi_gpu.yaml"))
    parser.add_argument("--script", default=str(ROOT / "examples" / "gpt2.py"))
    parser.add_argument("--max-failures", type=int, default=3, help="restarts after a worker dies (-1: no limit)")
    parser.add_argument("--storage-path", default=None, help="where Ray keeps its records (default ~/ray_results)")
    args, script_args = parser.parse_known_args()
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    result = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config_file": str(Path(args.config_file).resolve()),
            "script": str(Path(args.script).resolve()),
            "args": [arg for arg in script_args if arg != "--"],
        },
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(storage_path=args.storage_path, failure_config=FailureConfig(args.max_failures)),
    ).fit()
    sys.exit(1 if result.error else 0)


if __name__ == "__main__":
    main()
