#!/usr/bin/env bash
# GPT-2 124M (seed 004's model, from a GPT2Config: nothing downloaded) on one GPU in bf16: our Trainer (through
# accelerate_configs/bf16.yaml with 1 process) against a hand-written loop (bf16 autocast, pinned non-blocking
# copies, fused AdamW), 1024 tokens x 16 sequences a step. Prints tokens/s and MFU against the GPU's bf16 peak.
#   bash benchmarks/gpu.sh              # after the README's set-up, on a machine with one NVIDIA GPU
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import json, os, subprocess, sys, time

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "examples")
import torch
from compare import WORKLOADS, flops_per_token
from gpt2 import PEAK_FLOPS

name = torch.cuda.get_device_name(0)
peak = next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
per_token = flops_per_token(WORKLOADS["gpt2-124m"])
print(f"{name}: bf16 peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s; {per_token / 1e9:.2f} GFLOP per token")
launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/bf16.yaml",
          "--num_processes", "1"]
runs = {"raw loop (bf16 autocast, fused AdamW)": [sys.executable],
        "our Trainer (bf16.yaml, 1 process)": launch}
for rounds in range(2):
    for label, prefix in runs.items():
        env = {**os.environ, "BENCH_LAUNCHED_AT": repr(time.time()), "WANDB_MODE": "disabled"}
        variant = "torch" if prefix == [sys.executable] else "ours"
        out = subprocess.run([*prefix, "benchmarks/compare.py", "--worker", variant, "--workload", "gpt2-124m"],
                             capture_output=True, text=True, env=env)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{label}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(line[7:])
        mfu = f"{r['tokens_per_s'] * per_token / peak:.1%}" if peak else "n/a"
        print(f"round {rounds + 1} | {label}: {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
              f"{1000 * r['step_s']:.0f} ms/step, start-up {r['startup_s']:.0f} s", flush=True)
PY
