#!/usr/bin/env bash
# GPT-2 124M on one GPU in bf16: a hand-written PyTorch loop, a raw Accelerate loop, our Trainer, transformers' and
# Lightning's Trainers (where installed), eager, compiled whole and compiled per block, GPT2LMHeadModel at 16 and 32
# sequences of 1024 tokens and a compact GPT at 16, and FSDP2 rows (a hand-written fully_shard loop and our Trainer,
# GPT2LMHeadModel eager and per block) (benchmarks/gpu.py): one table of tokens/s, MFU, ms/step, peak memory and the
# ratios to the raw PyTorch loop. 25-30 minutes.
#   bash benchmarks/gpu.sh                      # after the README's set-up, on a machine with an NVIDIA GPU
#   bash benchmarks/gpu.sh --rounds 2           # any benchmarks/gpu.py option
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu.py "$@"
