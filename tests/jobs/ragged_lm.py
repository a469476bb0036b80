"""Same updates on a language model's real data: a tiny GPT-2 (2 layers, no dropout) on 48 sequences of 3-32 tokens
padded to 32 (labels -100 on the padding), trained by our Trainer or, as the outside oracle, transformers' own.

    python tests/jobs/ragged_lm.py --out runs/a --batch_size 8                       # ours, 1 process
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml tests/jobs/ragged_lm.py --out runs/b \\
        --batch_size 2 --accumulation 2                                       # ours, 2 processes
    python tests/jobs/ragged_lm.py --trainer hf --out runs/c --batch_size 2 --accumulation 4   # transformers' Trainer

Data in order (no shuffle), so every split reads the same global batches. ``--data``: ``map`` (a list), ``stream``
(a datasets IterableDataset, one shard), ``torch_stream`` (a torch IterableDataset; ``--stateless`` without
state_dict). ``--loss pair``: a loss_fn returning (sum over tokens, tokens). The main process writes
<out>/ragged.json: per-step losses and lrs, the final weights, and the example indices each process read.
``--variants '{"a": [flags], "b": [flags]}'`` runs one job per entry in the same processes, into <out>/a, <out>/b.
Under an FSDP launch (accelerate_configs/fsdp.yaml) ``--ddp`` runs a job as DDP, the exact reference at 2 processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import ConfigError, TrainConfig, Trainer  # noqa: E402
from trainer.errors import Refusal  # noqa: E402

SEQ, VOCAB = 32, 64


def ragged_rows(count: int) -> list[dict]:
    """``count`` sequences of 3-32 random tokens, right-padded with 0 to 32; labels -100 on the padding."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for index in range(count):
        length = int(torch.randint(3, SEQ + 1, (), generator=g))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        labels = ids.masked_fill(mask == 0, -100)
        rows.append({"index": index, "input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def tiny_gpt2(
    classifier: bool = False,
    build: str = "cpu",
    pretrained: str | None = None,
    width: int = 32,
    layers: int = 2,
    arch: str = "gpt2",
) -> torch.nn.Module:
    """The language model, or (``classifier``) GPT-2 classifying each sequence into 3 classes: a transformers
    model whose forward takes **kwargs but computes its loss inline, a mean over its examples. ``build``: on the
    CPU (seed 0), on the meta device, or on the CPU seeded with each process's rank (nanoGPT's way);
    ``pretrained``: ``from_pretrained`` of that folder (a classifier gets a new head). ``width`` and ``layers``: a
    larger model, where the weights outweigh what every process holds anyway. ``arch="llama"``: a Llama of the same
    size instead, which has a tensor-parallel plan."""
    torch.manual_seed(int(os.environ.get("RANK", "0")) if build == "seeded_per_rank" else 0)
    kind = GPT2ForSequenceClassification if classifier else GPT2LMHeadModel
    if arch == "llama":  # a model with a tensor-parallel plan of its own (GPT-2 has none)
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        )
        with torch.device("meta" if build == "meta" else "cpu"):
            return LlamaForCausalLM(config)
    if pretrained:
        return kind.from_pretrained(pretrained, num_labels=3)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        num_labels=3,
    )
    with torch.device("meta" if build == "meta" else "cpu"):
        return kind(config)


class TorchStream(torch.utils.data.IterableDataset):
    """The rows as a plain torch stream; with ``stateful``, it says where it is as datasets' streams do."""

    def __init__(self, rows: list[dict], stateful: bool):
        self.rows, self.next, self.resume_from = rows, 0, 0
        if not stateful:
            self.state_dict = self.load_state_dict = None

    def __iter__(self):
        start, self.resume_from = self.resume_from, 0
        for i in range(start, len(self.rows)):
            self.next = i + 1
            yield self.rows[i]

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.resume_from = state["next"]


class Seen:
    """Records the example indices of each batch read (then drops them: the model takes no index)."""

    def __init__(self):
        self.indices: list[list[int]] = []

    def __call__(self, rows):
        batch = torch.utils.data.default_collate(rows)
        self.indices.append(batch.pop("index").tolist())
        return batch


def pair_loss(model, batch):
    """Sum of the token losses and the tokens counted: the trainer weighs each by its count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:].to(logits.device)  # (a sharded model moved its inputs to its device)
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1), reduction="sum")
    return total, labels.ne(-100).sum()


def inject_out_of_memory(model: torch.nn.Module, args, running: dict) -> list:
    """torch.OutOfMemoryError in training forwards (or backwards) of micro-batches above ``args.oom_above`` examples,
    on rank ``args.oom_rank`` (-1: every rank), as a GPU's allocator raises it; returns the list it notes each in."""
    raised = []

    def too_large(inputs: dict) -> bool:
        rank = running["trainer"].accelerator.process_index if "trainer" in running else 0
        ids = inputs.get("input_ids")
        return model.training and ids is not None and ids.shape[0] > args.oom_above and args.oom_rank in (-1, rank)

    def in_forward(module, positional, inputs):
        running["large"] = too_large(inputs)  # for the hook on a block's output, which has no input_ids
        if args.oom_in == "forward" and too_large(inputs):
            raised.append("forward")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    def fail(grad):
        raised.append("backward")
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    def in_backward(module, positional, inputs, output):
        if args.oom_in == "backward" and too_large(inputs):
            output.logits.register_hook(fail)

    def in_middle_block(module, positional, output):  # its backward: after later blocks' reduce-scatters
        if args.oom_in == "middle_block_backward" and running.get("large"):
            (output[0] if isinstance(output, tuple) else output).register_hook(fail)

    model.register_forward_pre_hook(in_forward, with_kwargs=True)
    model.register_forward_hook(in_backward, with_kwargs=True)
    blocks = model.transformer.h
    blocks[len(blocks) // 2].register_forward_hook(in_middle_block)
    return raised


class History:
    """Every step's weights, whole (collective under FSDP2: every process records)."""

    def __init__(self):
        self.steps: list[dict[str, list]] = []

    def on_step_end(self, trainer) -> None:
        self.steps.append(weights(trainer.unwrapped_model))


class CrashAfter:
    """The last rank dies after ``step`` and any checkpoint of it (in the next step, whose checkpoint would come after
    its on_step_end; once: not again where ``marker`` says it did, as a restarted run would)."""

    def __init__(self, step: int, marker: Path | None = None):
        self.step, self.marker = step, marker

    def on_step_end(self, trainer) -> None:
        last_rank = trainer.accelerator.num_processes - 1
        if trainer.global_step == self.step + 1 and trainer.accelerator.process_index == last_rank:
            if self.marker is not None:
                if self.marker.exists():
                    return
                self.marker.touch()
            print(f"CRASH after step {self.step}", flush=True)
            os._exit(1)


def ours(args) -> dict:
    rows = ragged_rows(args.examples)
    if args.model == "classifier":
        rows = [{**row, "labels": torch.tensor(row["index"] % 3)} for row in rows]
    if args.data == "stream":
        from datasets import Dataset

        data = Dataset.from_list([{k: v.tolist() if torch.is_tensor(v) else v for k, v in r.items()} for r in rows])
        data = data.to_iterable_dataset(num_shards=1).with_format("torch")
    elif args.data == "torch_stream":
        data = TorchStream(rows, stateful=not args.stateless)
    else:
        data = rows
    config = TrainConfig(
        output_dir=args.out,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.weight_decay,
        lr_scheduler=args.schedule,
        warmup_steps=args.warmup,
        max_grad_norm=args.clip,
        min_lr_ratio=args.min_lr_ratio,
        epochs=args.epochs,
        max_steps=args.max_steps,
        shuffle=False,
        log_every=1,
        save_every=args.save_every,
        keep_last=args.keep_last,
        save_async=args.save_async,
        activation_checkpointing=args.recompute,
        reduce_every_micro_batch=args.reduce_every,
        eval_every=args.eval_every or (args.save_every if args.best else None),
        keep_best=("eval_tail_loss" if args.eval_sets else "eval_loss") if args.best else None,
        keep_best_mode="max",
        stall_warning_s=args.stall_warning_s or (1.0 if args.stall_in_block else 60.0),
        ema_decay=args.ema,
        ema_start_step=args.ema_start,
        auto_microbatch=args.auto_microbatch,
        compile=args.compile,
        resume=args.resume_from or ("auto" if args.save_every else None),
        checkpoint_storage=args.storage,
    )
    seen, history = Seen(), History()
    floor = reset_peak_memory() if args.peak else None
    from torch._dynamo.utils import counters

    if args.count_graphs:  # this job's graphs only: none reused from an earlier job's compiles
        torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    model = tiny_gpt2(args.model == "classifier", args.build, args.pretrained, args.width, args.layers, args.arch)
    if args.bf16_model:
        model.to(torch.bfloat16)
    computed = set()  # the dtype of the weights a matmul of the first block sees in forward
    first = next(m for m in model.modules() if type(m).__name__ in ("Conv1D", "Linear"))
    first.register_forward_pre_hook(lambda module, inputs: computed.add(str(module.weight.dtype)))
    running = {}  # the Trainer, once built
    ooms = inject_out_of_memory(model, args, running) if args.oom_above is not None else []
    if args.stall_in_block:  # rank 1 stuck inside the first block's forward at step 2, as a hung kernel would be

        def stuck(module, inputs):
            trainer = running.get("trainer")
            if trainer and trainer.model.training and trainer.global_step == 1 and trainer.accelerator.process_index:
                print(f"STALL rank 1 inside block 0 at step 2 for {args.stall_in_block} s", flush=True)
                time.sleep(args.stall_in_block)

        model.transformer.h[0].register_forward_pre_hook(stuck)
    if args.step_sleep:  # a job long enough for something to happen while it trains, each step slower
        model.register_forward_pre_hook(lambda module, inputs: time.sleep(args.step_sleep))
    own_split = split_mlps if args.parallelize_fn else None
    factories = nanogpt_factories(args.lr, args.warmup, args.max_steps) if args.nanogpt else {}
    trainer = Trainer(
        model,
        config,
        train_data=None if args.evaluate_only else data,
        collate_fn=seen,
        parallelize_fn=own_split,
        **factories,
        eval_data={"head": rows[:10], "tail": rows[10:45]}
        if args.eval_sets
        else rows[: args.eval_examples]
        if args.eval
        else None,
        loss_fn=pair_loss if args.loss == "pair" else None,
        callbacks=[CrashAfter(args.crash_at, Path(args.out, "crashed") if args.crash_once else None)]
        if args.crash_at
        else [history]
        if args.history
        else [],
    )
    running["trainer"] = trainer
    initial = weights(trainer.unwrapped_model) if args.initial else None
    result = trainer.evaluate() if args.evaluate_only else trainer.fit()
    refused = None
    if args.evaluate_only:  # a Trainer without train_data refuses to train
        try:
            trainer.fit()
        except ConfigError as err:
            refused = str(err)
    peak = peak_memory() if args.peak else None  # before the summary gathers whole weights
    from accelerate.utils import gather_object

    kept = "transformer.h.0." if args.peak else ""  # a large model: its first block stands for the rest
    summary = {
        "losses": [row["train_loss"] for row in trainer.log_history],
        "lrs": [row["lr"] for row in trainer.log_history],
        "weights": weights(trainer.unwrapped_model, kept),
        "grad_norms": [row.get("grad_norm") for row in trainer.log_history],
        "seen": gather_object([seen.indices]),
        "world_size": trainer.accelerator.num_processes,
        "held": sum(local(p).numel() for p in trainer.model.parameters()),
        "computed": sorted(computed),
        "graphs": counters["stats"]["unique_graphs"] - graphs,
        "dtypes": sorted({str(local(p).dtype) for p in trainer.model.parameters()}),
        "optimizer_dtypes": sorted(
            {str(local(v).dtype) for state in trainer.optimizer.state.values() for v in state.values() if v.dim() > 0}
        ),
    }
    if args.peak:  # every process's peak memory during this job
        summary["peaks"], summary["floors"] = gather_object([peak]), gather_object([floor])
    if initial is not None:
        summary["initial"] = initial
        plain = trainer.unwrapped_model  # weights tied before are one weight still (GPT-2's embeddings and head)
        summary["tied"] = plain.get_input_embeddings().weight is getattr(plain.get_output_embeddings(), "weight", 0)
    if args.history:
        summary["history"] = history.steps
    if args.auto_microbatch:
        summary["ooms"], summary["pieces"] = len(ooms), trainer.steps.split.pieces
    if args.evaluate_only:
        summary["fit_refused"] = refused
    if args.eval_sets:  # each set's figures at the last evaluation
        summary["evaluations"] = {key: value for key, value in result.items() if key.startswith("eval_")}
    if args.eval:  # the eval loss over every counted token once, and the same figure computed here directly
        summary["eval_loss"] = result["eval_loss"]
        summary["eval_reference"] = token_mean_loss(trainer.unwrapped_model, rows[: args.eval_examples])
    if args.predict:  # every example's most likely next tokens, in order
        predicted = trainer.predict(
            rows[: args.eval_examples],
            lambda model, batch: model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits.argmax(-1),
        )
        summary["predicted"] = predicted.tolist()
    return summary


def nanogpt_lr(step: int, lr: float, warmup: int, steps: int, floor: float = 0.1) -> float:
    """nanoGPT's get_lr (train.py): linear warm-up from lr / (warmup + 1), then cosine down to floor x lr."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    ratio = (step - warmup) / (steps - warmup)
    return floor * lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - floor * lr)


def nanogpt_factories(lr: float, warmup: int, steps: int) -> dict:
    """nanoGPT's optimizer (AdamW, betas 0.9 / 0.95, weight decay 0.1 on the groups the trainer makes) and its exact
    schedule, as factories the trainer calls once the model is wrapped or sharded."""
    return {
        "optimizer": lambda groups: torch.optim.AdamW(
            [{**g, "weight_decay": g.get("weight_decay", 0.1)} for g in groups], lr=lr, betas=(0.9, 0.95)
        ),
        "lr_scheduler": lambda optimizer, total: torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: nanogpt_lr(step, lr, warmup, total) / lr
        ),
    }


def split_mlps(model: torch.nn.Module, tp_mesh) -> None:
    """A user's own tensor-parallel split of the Llama: its MLPs only (the attention stays whole)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.model.layers:
        parallelize_module(
            block.mlp,
            tp_mesh,
            {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()},
        )


def reset_peak_memory() -> int:
    """Start this process's peak memory (VmHWM: the peak RSS, a CPU process's device memory) from what it holds now,
    freed memory given back first; return that."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return peak_memory()


def peak_memory() -> int:
    """This process's peak RSS in bytes since :func:`reset_peak_memory`."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


@torch.no_grad()
def token_mean_loss(model: torch.nn.Module, rows: list[dict]) -> float:
    """The mean cross-entropy over every counted (shifted) token of ``rows``: each token once."""
    batch = torch.utils.data.default_collate([{k: v for k, v in r.items() if k != "index"} for r in rows])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].double()
    labels = batch["labels"][:, 1:].to(logits.device)  # (a sharded model moved its inputs to its device)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item()


def hf(args) -> dict:
    """transformers' Trainer on the same model and data, in order, its tokens counted after the causal shift."""
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments

    class InOrder(HFTrainer):
        def _get_train_sampler(self, *a, **kw):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = tiny_gpt2()
    model.loss_type = "ForCausalLM"  # GPT-2's class name maps to no loss type: without it, unshifted counting
    rows = [{k: v for k, v in r.items() if k != "index"} for r in ragged_rows(args.examples)]
    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        optim="adamw_torch" if args.optimizer == "adamw" else "sgd",
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        lr_scheduler_type=args.schedule,
        warmup_steps=args.warmup,
        max_grad_norm=args.clip or 0.0,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps or -1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = InOrder(model=model, args=training, train_dataset=rows)
    trainer.train()
    logged = [row for row in trainer.state.log_history if "loss" in row]
    return {
        "losses": [row["loss"] for row in logged],
        "lrs": [row["learning_rate"] for row in logged],
        "weights": weights(model),
        "world_size": 1,
    }


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of a tensor (its shard of a sharded one)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def weights(model: torch.nn.Module, only: str = "") -> dict[str, list]:
    """Every weight (whose name starts with ``only``), whole (a sharded model's gathered from its processes: call it
    on every process)."""
    whole = {
        name.replace("_checkpoint_wrapped_module.", ""): p.full_tensor() if hasattr(p, "full_tensor") else p
        for name, p in model.named_parameters()
        if name.startswith(only)
    }
    return {name: p.detach().cpu().flatten().tolist() for name, p in whole.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["ours", "hf"], default="ours")
    parser.add_argument("--out", default="runs/ragged")
    parser.add_argument("--data", choices=["map", "stream", "torch_stream"], default="map")
    parser.add_argument("--stateless", action="store_true")
    parser.add_argument("--loss", choices=["default", "pair"], default="default")
    parser.add_argument("--model", choices=["lm", "classifier"], default="lm")
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--optimizer", choices=["sgd", "adamw", "muon"], default="sgd")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--schedule", default="constant")
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=None)
    parser.add_argument("--save_every", type=int, default=None)
    parser.add_argument("--keep_last", type=int, default=2)
    parser.add_argument("--save_async", action="store_true")
    parser.add_argument("--storage", default=None, help="checkpoint_storage: an object store's URL")
    parser.add_argument("--recompute", action="store_true", help="activation_checkpointing: true")
    parser.add_argument("--eval_examples", type=int, default=None, help="evaluate on the first N rows only")
    parser.add_argument("--predict", action="store_true", help="predict() the evaluation rows after training")
    parser.add_argument("--evaluate_only", action="store_true", help="evaluate() the loaded weights instead of fit()")
    parser.add_argument("--resume_from", default=None, help="a checkpoint to continue from")
    parser.add_argument("--crash_at", type=int, default=0)
    parser.add_argument("--step_sleep", type=float, default=0, help="each forward takes this much longer (seconds)")
    parser.add_argument("--crash_once", action="store_true", help="not again in a run restarted after the crash")
    parser.add_argument("--eval", action="store_true", help="evaluate on the training rows after training")
    parser.add_argument("--ddp", action="store_true", help="under an FSDP launch: this job as DDP (the reference)")
    parser.add_argument("--bf16_model", action="store_true", help="build the model in bf16")
    parser.add_argument("--expect_refusal", action="store_true", help="a refusal is this job's result")
    parser.add_argument("--auto_microbatch", action="store_true")
    parser.add_argument("--oom_above", type=int, default=None, help="out of memory above this many examples")
    parser.add_argument("--oom_rank", type=int, default=-1, help="on this rank (-1: every rank)")
    parser.add_argument("--oom_in", choices=["forward", "backward", "middle_block_backward"], default="forward")
    parser.add_argument("--eval_every", type=int, default=None, help="evaluate every N steps while training")
    parser.add_argument("--ema", type=float, default=None, help="ema_decay")
    parser.add_argument("--stall_warning_s", type=float, default=None)
    parser.add_argument("--ema_start", type=int, default=0, help="ema_start_step")
    parser.add_argument("--history", action="store_true", help="record every step's weights")
    parser.add_argument("--best", action="store_true", help="keep_best the highest eval loss (the first, as it falls)")
    parser.add_argument("--reduce_every", action="store_true", help="reduce_every_micro_batch: true")
    parser.add_argument("--compile", action="store_true", help="compile: true")
    parser.add_argument("--count_graphs", action="store_true", help="count the graphs this job's compile makes")
    parser.add_argument("--width", type=int, default=32, help="the model's width (see tiny_gpt2)")
    parser.add_argument("--layers", type=int, default=2, help="the model's blocks")
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2", help="see tiny_gpt2")
    parser.add_argument("--parallelize_fn", action="store_true", help="split the Llama's MLPs by split_mlps")
    parser.add_argument("--min_lr_ratio", type=float, default=None)
    parser.add_argument("--eval_sets", action="store_true", help="evaluate on two named sets, rows 0-9 and 10-44")
    parser.add_argument("--nanogpt", action="store_true", help="nanoGPT's optimizer and schedule, as factories")
    parser.add_argument("--stall_in_block", type=float, default=0, help="rank 1 sleeps this long in block 0, step 2")
    parser.add_argument("--peak", action="store_true", help="write every process's peak memory during the job")
    parser.add_argument("--build", choices=["cpu", "meta", "seeded_per_rank"], default="cpu", help="see tiny_gpt2")
    parser.add_argument("--pretrained", default=None, help="from_pretrained of this folder (see tiny_gpt2)")
    parser.add_argument("--initial", action="store_true", help="also write the weights before training")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE set for this job (an FSDP setting)")
    parser.add_argument("--variants", default="{}", help='JSON {"name": [flags]}: one job each, in <out>/<name>')
    args, rest = parser.parse_known_args()
    variants = json.loads(args.variants) or {"": []}  # several jobs in one launch: the start-up paid once
    for name, flags in variants.items():
        job = parser.parse_args(rest + flags, namespace=argparse.Namespace(**{**vars(args), "env": list(args.env)}))
        job.out = str(Path(args.out, name))
        saved = dict(os.environ)
        if job.ddp:
            os.environ.pop("ACCELERATE_USE_FSDP", None)
        os.environ.update(setting.split("=", 1) for setting in job.env)
        if job.pretrained:  # the process group up before from_pretrained, as the examples have it
            from trainer import distributed_state

            distributed_state()
        try:
            summary = ours(job) if job.trainer == "ours" else hf(job)
        except Refusal as err:  # said the same way on every rank: the launch goes on to the next job
            if not job.expect_refusal:
                raise
            summary = {"refused": str(err)}
        os.environ.clear()
        os.environ.update(saved)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(job.out).mkdir(parents=True, exist_ok=True)
            Path(job.out, "ragged.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
