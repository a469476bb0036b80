"""What our Trainer costs, side by side with a raw PyTorch loop, a raw Accelerate loop, transformers' Trainer and
(when installed: ``pip install -e ".[bench]"``) Lightning Fabric, on the same GPT-2 workloads.

    python benchmarks/compare.py          # the README's table: about 5 minutes on a 2-core CPU

Two workloads: compute-bound (GPT-2 4 layers x 256, 6 sequences of 256 tokens a step, ~0.5 s a step here:
tokens/s, and MFU against a matmul peak measured in this script) and overhead-bound (GPT-2 1 layer x 32, 4 x 32
tokens, a few ms a step: per-step Python work, host syncs and logging decide the speed), and the overhead-bound
one again on 2 processes over gloo (raw Accelerate and ours), so the cost of our DDP path shows.

How: on this machine two processes running the same loop differ by up to 20%, and so do minutes apart. So the
ratios come from one process: a host trainer (ours, then transformers') runs, and every few of its steps its
step-end hook runs the same number of steps of each hand-written loop (Python generators, each with its own
model, data and AdamW), timing each block. Adjacent blocks see the same machine; the table gives each variant's
median block-by-block ratio to the raw Accelerate loop, its range, and the milliseconds it adds per step. Start-up
(launch to the first optimizer step) and peak memory come from each variant run alone in a fresh process; a
2,000-step run of ours checks that memory does not grow. Every variant: the same model and data, AdamW, a constant
lr, no clipping, the loss read on the host every 50 steps. Raw measurements go to runs/benchmarks/compare.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOADS = {
    "compute": dict(n_layer=4, n_embd=256, n_head=4, seq=256, batch=6, vocab=4096, steps=8, warmup=2),
    "overhead": dict(n_layer=1, n_embd=32, n_head=2, seq=32, batch=4, vocab=512, steps=1000, warmup=50),
    # benchmarks/gpu.sh: GPT-2 124M as the distributed-training guide trains it, on one GPU in bf16
    "gpt2-124m": dict(n_layer=12, n_embd=768, n_head=12, seq=1024, batch=16, vocab=50257, steps=30, warmup=5),
}
LOG_EVERY = 50  # every variant reads the loss on the host this often, as a logging trainer does
VARIANTS = ("torch", "accelerate", "ours", "hf_trainer", "fabric")
LABELS = {
    "torch": "raw PyTorch loop",
    "accelerate": "raw Accelerate loop",
    "ours": "our Trainer",
    "hf_trainer": "transformers Trainer",
    "fabric": "Lightning Fabric",
}


# ----------------------------------------------------------------------------- the worker: one measurement


def build(workload: dict):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=workload["vocab"],
            n_positions=workload["seq"],
            n_embd=workload["n_embd"],
            n_layer=workload["n_layer"],
            n_head=workload["n_head"],
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    examples = (workload["steps"] + workload["warmup"] + 1) * workload["batch"] * 2
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, workload["vocab"], (examples, workload["seq"]), generator=generator)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    return model, data


class StepClock:
    """Times every optimizer step's end; the rate is taken over the steps after warm-up. With ``track_rss`` it also
    samples the process's memory every 100 steps."""

    def __init__(self, warmup: int, track_rss: bool = False):
        self.warmup, self.ends, self.rss_mb = warmup, [], []
        self.first_end_wall = None
        self.track_rss = track_rss

    def tick(self) -> None:
        self.ends.append(time.perf_counter())
        if self.first_end_wall is None:
            self.first_end_wall = time.time()
        if self.track_rss and len(self.ends) % 100 == 0:
            import psutil

            self.rss_mb.append((len(self.ends), psutil.Process().memory_info().rss / 2**20))

    def result(self, workload: dict, processes: int) -> dict:
        measured = self.ends[self.warmup :]
        seconds = (measured[-1] - measured[0]) / (len(measured) - 1)
        return {
            "step_s": seconds,
            "steps_per_s": 1 / seconds,
            "tokens_per_s": workload["batch"] * workload["seq"] * processes / seconds,
            "startup_s": self.first_end_wall - float(os.environ["BENCH_LAUNCHED_AT"]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mb": self.rss_mb,
        }


def steps_torch(model, data, workload):
    """The loop a careful user writes by hand: on a GPU, bf16 autocast, pinned non-blocking copies, fused AdamW.
    A generator: it yields after every optimizer step, so a runner can interleave it with other variants."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device)
    loader = torch.utils.data.DataLoader(data, batch_size=workload["batch"], shuffle=True, pin_memory=cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda or None)
    model.train()
    step = 0
    while True:
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % LOG_EVERY == 0:
                loss.item()
            yield loss


def steps_accelerate(model, data, workload):
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    loader = torch.utils.data.DataLoader(data, batch_size=workload["batch"], shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    read = lambda loss: accelerator.reduce(loss.detach(), reduction="mean").item()  # noqa: E731
    yield from _framework_steps(model, loader, optimizer, accelerator.backward, read)


def steps_fabric(model, data, workload):
    import torch
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="auto", devices=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=workload["batch"], shuffle=True))
    yield from _framework_steps(model, loader, optimizer, fabric.backward, lambda loss: loss.item())


def _framework_steps(model, loader, optimizer, backward, read_loss):
    """The loop as a framework's examples write it, given the framework's backward and its way to read the loss."""
    model.train()
    step = 0
    while True:
        for batch in loader:
            loss = model(**batch).loss
            backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % LOG_EVERY == 0:
                read_loss(loss)
            yield loss


def _run_steps(steps_fn):
    """A one-shot runner for a generator variant: ``total`` steps, the clock ticking after each."""

    def run(model, data, workload, clock) -> None:
        import torch

        steps = steps_fn(model, data, workload)
        for _ in range(workload["steps"] + workload["warmup"] - 1):
            next(steps)
            clock.tick()
        loss = next(steps)
        if torch.cuda.is_available():
            loss.item()  # on a GPU the last step syncs, so the clock sees the work done
        clock.tick()

    return run


run_torch, run_accelerate, run_fabric = _run_steps(steps_torch), _run_steps(steps_accelerate), _run_steps(steps_fabric)


def run_ours(model, data, workload, clock) -> None:
    from trainer import TrainConfig, Trainer

    class Tick:
        def on_step_end(self, trainer):
            clock.tick()

    config = TrainConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=workload["steps"] + workload["warmup"],
        batch_size=workload["batch"],
        lr=3e-4,
        log_every=LOG_EVERY,
        stall_warning_s=None,
    )
    trainer = Trainer(model, config, train_data=data, callbacks=[Tick()])
    trainer.fit()


def run_hf_trainer(model, data, workload, clock) -> None:
    from transformers import Trainer as HFTrainer
    from transformers import TrainerCallback, TrainingArguments

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=workload["batch"],
        max_steps=workload["steps"] + workload["warmup"],
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=LOG_EVERY,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        optim="adamw_torch",
    )
    HFTrainer(model=model, args=args, train_dataset=data, callbacks=[Tick()]).train()


def worker(variant: str, workload_name: str, steps: int | None, track_rss: bool) -> None:
    """One measurement in this process; the main process prints one RESULT line of JSON."""
    workload = dict(WORKLOADS[workload_name])
    if steps:
        workload["steps"] = steps
    model, data = build(workload)
    clock = StepClock(workload["warmup"], track_rss)
    globals()[f"run_{variant}"](model, data, workload, clock)
    if int(os.environ.get("RANK", "0")) == 0:
        result = clock.result(workload, int(os.environ.get("WORLD_SIZE", "1")))
        print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------- interleaved in one process: the ratios that noise spares


class Interleave:
    """A host trainer's step-end hook that, every ``chunk`` host steps, runs ``chunk`` steps of each guest loop
    (generators), timing each block: adjacent blocks see the same machine, so their ratio is what counts here."""

    def __init__(self, guests: dict, chunk: int, warmup: int):
        self.guests, self.chunk, self.warmup = guests, chunk, warmup
        self.times = {"host": [], **{name: [] for name in guests}}  # seconds per step, block by block
        self.host_steps, self.since = 0, 0.0

    def step_end(self) -> None:
        self.host_steps += 1
        if self.host_steps < self.warmup or (self.host_steps - self.warmup) % self.chunk:
            return  # the host's own steps: as little as possible here, this time counts as the host's
        _sync()
        if self.host_steps == self.warmup:  # warm the guests up too, then start the clock
            for steps in self.guests.values():
                for _ in range(self.warmup):
                    next(steps)
        else:
            self.times["host"].append((time.perf_counter() - self.since) / self.chunk)
            for name, steps in self.guests.items():
                started = time.perf_counter()
                for _ in range(self.chunk):
                    next(steps)
                _sync()
                self.times[name].append((time.perf_counter() - started) / self.chunk)
        self.since = time.perf_counter()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleave(host: str, guests: list[str], workload_name: str, chunk: int, chunks: int) -> None:
    """Run ``host`` (ours or hf_trainer) with the guest loops interleaved; the main process prints the blocks."""
    workload = dict(WORKLOADS[workload_name], steps=chunk * chunks)
    generators = {}
    for name in guests:
        model, data = build(workload)
        generators[name] = globals()[f"steps_{name}"](model, data, workload)
    hook = Interleave(generators, chunk, workload["warmup"])
    model, data = build(workload)

    class Clock:  # what run_ours / run_hf_trainer call after every optimizer step
        def tick(self):
            hook.step_end()

    globals()[f"run_{host}"](model, data, workload, Clock())
    if int(os.environ.get("RANK", "0")) == 0:
        print("BLOCKS " + json.dumps({host if k == "host" else k: v for k, v in hook.times.items()}), flush=True)


# ------------------------------------------------------------------------ the runner: rounds and the table


def launch(args: list[str], processes: int = 1) -> subprocess.CompletedProcess:
    """This script in a fresh process (or ``processes`` of them through accelerate launch)."""
    from socket import socket

    cmd = [sys.executable, __file__, *args]
    if processes > 1:
        with socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / "multi_gpu.yaml"),
            "--num_processes",
            str(processes),
            "--main_process_port",
            str(port),
            *cmd[1:],
        ]
    env = {
        **os.environ,
        "BENCH_LAUNCHED_AT": repr(time.time()),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)


def _parse(done: subprocess.CompletedProcess, prefix: str, what: str):
    for line in done.stdout.splitlines():
        if line.startswith(prefix + " "):
            return json.loads(line.removeprefix(prefix + " "))
    sys.stderr.write(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}\n")
    return None


def measure(variant: str, workload: str, steps: int | None = None, track_rss: bool = False):
    """One variant alone in a fresh process: start-up (launch to its first optimizer step) and peak memory."""
    args = ["--worker", variant, "--workload", workload, *(["--steps", str(steps)] if steps else [])]
    return _parse(launch(args + (["--track-rss"] if track_rss else [])), "RESULT", f"{variant}/{workload}")


def blocks(host: str, guests: list[str], workload: str, chunk: int, chunks: int, processes: int = 1):
    args = [
        "--interleave",
        host,
        "--guests",
        ",".join(guests),
        "--workload",
        workload,
        "--chunk",
        str(chunk),
        "--chunks",
        str(chunks),
    ]
    return _parse(launch(args, processes), "BLOCKS", f"{host} with {guests} on {workload} x{processes}")


def matmul_peak_flops(size: int = 2048, repeats: int = 10) -> float:
    """The best fp32 matmul rate this process reaches with torch's default threads: the MFU denominator."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def flops_per_token(workload: dict) -> float:
    """6N for forward + backward, plus attention's 12 x layers x width x sequence (as examples/gpt2.py)."""
    model, _ = build(dict(workload, steps=0, warmup=0))
    n_params = sum(p.numel() for p in model.parameters())
    return 6 * n_params + 12 * workload["n_layer"] * workload["n_embd"] * workload["seq"]


def rows(times: dict[str, list[float]], workload: dict, processes: int = 1) -> dict[str, dict]:
    """Per variant, from blocks interleaved with the raw Accelerate loop: steps/s, tokens/s, and the median and
    range of the block-by-block ratio to the raw Accelerate loop, and the milliseconds added per step."""
    base = times["accelerate"]
    table = {}
    for variant, seconds in times.items():
        ratios = [b / v for v, b in zip(seconds, base, strict=True)]
        step_s = statistics.median(seconds)
        table[variant] = {
            "steps_per_s": 1 / step_s,
            "tokens_per_s": workload["batch"] * workload["seq"] * processes / step_s,
            "ratio": statistics.median(ratios),
            "low": min(ratios),
            "high": max(ratios),
            "added_ms": 1000 * statistics.median(v - b for v, b in zip(seconds, base, strict=True)),
        }
    return table


def print_table(title: str, table: dict[str, dict], key: str, unit: str, alone: dict, extra=None) -> None:
    print(f"\n{title}")
    print(
        f"| variant | {unit} | ratio to raw Accelerate, median (range) | ms added per step | start-up s | "
        "peak RSS MB |" + (" MFU |" if extra else "")
    )
    print("| --- | --- | --- | --- | --- | --- |" + (" --- |" if extra else ""))
    order = [v for v in VARIANTS if v in table]
    for variant in order:
        row, solo = table[variant], alone.get(variant) or {}
        line = (
            f"| {LABELS[variant]} | {row[key]:,.1f} | {row['ratio']:.3f} ({row['low']:.3f}-{row['high']:.3f}) "
            f"| {row['added_ms']:+.2f} | {solo.get('startup_s', float('nan')):.1f} | "
            f"{solo.get('peak_rss_mb', float('nan')):,.0f} |"
        )
        print(line + (f" {extra(row):.1%} |" if extra else ""), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", default="runs/benchmarks/compare.json", help="where the raw measurements go")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--interleave", choices=("ours", "hf_trainer"), help=argparse.SUPPRESS)
    parser.add_argument("--guests", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--track-rss", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.workload, args.steps, args.track_rss)
    if args.interleave:
        return interleave(args.interleave, args.guests.split(","), args.workload, args.chunk, args.chunks)

    import importlib.util

    import torch

    loops = ["torch", "accelerate"] + (["fabric"] if importlib.util.find_spec("lightning") else [])
    peak = matmul_peak_flops()
    print(
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads; measured fp32 "
        f"matmul peak {peak / 1e9:.1f} GFLOP/s; hand-written loops: {', '.join(loops)}",
        flush=True,
    )
    raw = {"peak": peak}
    plan = {"compute": (2, 12), "overhead": (50, 40)}  # (steps a block, blocks)
    for name, (chunk, chunks) in plan.items():
        ours = blocks("ours", loops, name, chunk, chunks)
        hf = blocks("hf_trainer", ["accelerate"], name, chunk, chunks)
        raw[name] = {"ours": ours, "hf_trainer": hf}
    raw["ddp"] = blocks("ours", ["accelerate"], "overhead", 50, 30, processes=2)
    raw["alone"] = {
        v: measure(v, "overhead", steps=100)
        for v in ("torch", "accelerate", "ours", "hf_trainer") + (("fabric",) if "fabric" in loops else ())
    }
    raw["long_run"] = measure("ours", "overhead", steps=2000, track_rss=True)
    saved = Path(args.save)
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(raw))
    print(f"raw measurements saved to {saved}")

    per_token = flops_per_token(WORKLOADS["compute"])
    for name, title in (
        ("compute", "compute-bound (GPT-2 4 x 256, 6 x 256 tokens a step), 1 process"),
        ("overhead", "overhead-bound (GPT-2 1 x 32, 4 x 32 tokens a step), 1 process"),
    ):
        table = rows(raw[name]["ours"], WORKLOADS[name])
        hf = rows(raw[name]["hf_trainer"], WORKLOADS[name])["hf_trainer"] if raw[name]["hf_trainer"] else None
        if hf:
            table["hf_trainer"] = hf
        key, unit = ("tokens_per_s", "tokens/s") if name == "compute" else ("steps_per_s", "steps/s")
        extra = (lambda row: row["tokens_per_s"] * per_token / peak) if name == "compute" else None
        print_table(title, table, key, unit, raw["alone"], extra)
        if hf:
            print(f"our Trainer / transformers Trainer: {table['ours']['ratio'] / hf['ratio']:.2f}x")
    if raw["ddp"]:
        ddp = rows(raw["ddp"], WORKLOADS["overhead"], processes=2)
        print_table("overhead-bound on 2 processes over gloo (global figures)", ddp, "steps_per_s", "steps/s", {})
        one = rows(raw["overhead"]["ours"], WORKLOADS["overhead"])["ours"]
        print(
            f"our Trainer, 2 processes / 1 process, global examples/s: "
            f"{2 * ddp['ours']['steps_per_s'] / one['steps_per_s']:.2f}"
        )
    if raw["long_run"]:
        samples = raw["long_run"]["rss_mb"]
        after_warmup = next(mb for step, mb in samples if step >= 200)
        print(
            f"memory: our Trainer over {samples[-1][0]} steps: {after_warmup:,.1f} MB at step 200, "
            f"{samples[-1][1]:,.1f} MB at the end ({samples[-1][1] - after_warmup:+.1f} MB)"
        )


if __name__ == "__main__":
    main()
