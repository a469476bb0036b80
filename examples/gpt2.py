"""The distributed-training guide's GPT-2 job (train_llm.py) on the trainer, runnable offline out of the box.

With no flags it trains a small GPT-2 (built from a GPT2Config) on real English text every machine already has:
Python's own reference documentation, shipped with CPython as ``pydoc_data.topics`` (about 460 KB), with a
byte-level BPE tokenizer trained on it in a second. It prints the loss falling, the eval loss and perplexity,
tokens/s and model FLOPs utilisation, a generated sample, and saves model + tokenizer under <output_dir>/final
(loadable with AutoModelForCausalLM / AutoTokenizer). Started again with the same output directory it continues
from its latest checkpoint (``--resume auto`` is this example's default). On a GPU it allows TF32 matmuls and reads
32 sequences a process per step instead of 8 (unless ``--batch-size`` says); the Trainer puts MFU on the step line
where it knows the device's peak (a GPU in its table, or ``--peak-flops``).

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/gpt2.py    # 2 processes
    torchrun --standalone --nproc_per_node 2 examples/gpt2.py
    accelerate launch --config_file accelerate_configs/fsdp.yaml examples/gpt2.py        # the model sharded (FSDP2)
    python examples/gpt2.py

Its run on a node of GPUs (needs the hub; bf16 from the accelerate config):

    OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/bf16.yaml --num_processes 8 \
        examples/gpt2.py --experiment-name gpt2-openwebtext-A100 --dataset-name Skylion007/openwebtext \
        --model-name openai-community/gpt2 --batch-size 64 --seq-len 1024

Every TrainConfig field is a flag too (``--lr``, ``--max-steps``, ``--save-every``; hyphens or underscores), and
``--config run.yaml`` reads TrainConfig keys from a file (flags win). Local text: ``--train-file a.txt b.jsonl``.

``--streaming`` reads the text as a stream (datasets' IterableDataset: a hub corpus of millions of documents without
downloading it first), tokenised as it is read, each process its own part; a resume continues the stream where the
checkpoint left it. With no data flags it streams the built-in text::

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/gpt2.py --streaming

``--pack-documents`` keeps documents apart: each (in pieces of ``--seq-len`` at most) attends to itself alone,
a micro-batch's documents flattened into one row without padding by transformers' DataCollatorWithFlattening
(``position_ids`` restart at each document), where the default blocks run across document boundaries.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# trainer before the libraries: it quiets what they say at import that no user can act on (torchao's).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from trainer import TrainConfig, Trainer, distributed_state  # noqa: E402
from trainer.config import read_yaml  # noqa: E402
from trainer.hf import no_progress_bars_off_a_terminal  # noqa: E402

# isort: split
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorWithFlattening,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
)

EOS = "<|endoftext|>"
TOKENIZER_TEXTS = 20_000  # documents of a stream a new tokenizer is trained on

# This example's own TrainConfig defaults (a --config file and flags override them). Global batch: 8 sequences
# x 128 tokens x processes on CPU (about 50 optimizer steps an epoch on the built-in text with 2 processes); on a
# GPU 32 sequences a process, since 8 would leave it idling between kernel launches.
EXAMPLE_DEFAULTS = dict(
    output_dir="runs/gpt2",
    experiment_name="gpt2",
    batch_size=8,
    max_steps=300,
    lr=2e-3,
    weight_decay=0.1,
    betas=(0.9, 0.95),
    lr_scheduler="cosine",
    warmup_steps=30,
    max_grad_norm=1.0,
    log_every=25,
    eval_every=100,
    save_every=100,
    resume="auto",
)
GPU_BATCH_SIZE = 32


@dataclass
class GPT2Args:
    config: Optional[str] = field(default=None, metadata={"help": "a YAML file of TrainConfig keys"})
    model_name: Optional[str] = field(default=None, metadata={"help": "hub name or local path of a causal LM"})
    dataset_name: Optional[str] = field(default=None, metadata={"help": "a datasets hub name"})
    dataset_config: Optional[str] = None
    text_column: str = "text"
    train_file: Optional[list[str]] = field(default=None, metadata={"help": "local .txt or .jsonl files"})
    streaming: bool = field(default=False, metadata={"help": "read the text as a stream, tokenised as it is read"})
    eval_blocks: int = field(default=64, metadata={"help": "with --streaming: held-out sequences to evaluate on"})
    pack_documents: bool = field(
        default=False,
        metadata={
            "help": "each document (in pieces of seq_len at most) attends to itself alone: a micro-batch's documents "
            "flattened into one row by DataCollatorWithFlattening, instead of blocks that cross them"
        },
    )
    seq_len: int = 128
    eval_fraction: float = 0.05
    num_proc: int = 1  # processes for tokenising with datasets.map
    # the from-scratch model's size (ignored with --model-name)
    vocab_size: int = 4096
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    prompt: str = "The"
    sample_tokens: int = field(
        default=60, metadata={"help": "tokens sampled after --prompt at the end (at most what the context has left)"}
    )


def parse_args(argv=None) -> tuple[GPT2Args, TrainConfig]:
    parser = HfArgumentParser([GPT2Args, TrainConfig])
    betas = next(a for a in parser._actions if a.dest == "betas")
    betas.type, betas.nargs = float, 2  # HfArgumentParser reads tuple[float, float] as characters
    on_gpu = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true")
    parser.set_defaults(**{**EXAMPLE_DEFAULTS, **({"batch_size": GPU_BATCH_SIZE} if on_gpu else {})})
    config_file = argparse.ArgumentParser(add_help=False)
    config_file.add_argument("--config")
    path = config_file.parse_known_args(argv)[0].config
    if path:  # keys from the file over the example's defaults, checked as strictly as TrainConfig checks them
        from_file = read_yaml(path)  # a missing file, a list, a repeated key: a ConfigError naming the file
        TrainConfig.from_dict({**EXAMPLE_DEFAULTS, **from_file}, source=path)
        parser.set_defaults(**from_file)
    args, config = parser.parse_args_into_dataclasses(args=argv)
    if args.pack_documents and args.streaming:
        parser.error("--pack-documents takes a data set held whole, not --streaming")
    return args, config


def load_texts(args: GPT2Args):
    """A datasets.Dataset with a "text" column: local files, a hub data set, or Python's own documentation; with
    ``--streaming`` a datasets.IterableDataset (the built-in text in 8 shards, so 1, 2, 4 or 8 processes each read
    whole shards)."""
    from datasets import Dataset, disable_progress_bars, load_dataset

    disable_progress_bars()  # one bar per map per process, for seconds of work: noise in the log

    if args.train_file:
        kind = "json" if args.train_file[0].endswith((".json", ".jsonl")) else "text"
        texts = load_dataset(kind, data_files=args.train_file, split="train", streaming=args.streaming)
    elif args.dataset_name:
        texts = load_dataset(args.dataset_name, args.dataset_config, split="train", streaming=args.streaming)
    else:
        from pydoc_data.topics import topics

        texts = Dataset.from_dict({"text": list(topics.values())})
        if args.streaming:
            texts = texts.to_iterable_dataset(num_shards=8)
    if args.text_column != "text":
        texts = texts.rename_column(args.text_column, "text")
    return texts.select_columns(["text"])


def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE (GPT-2's scheme) trained on ``texts`` (a stream's first TOKENIZER_TEXTS), as a transformers
    tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # every byte, so no text is ever out of vocabulary
    bpe_trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False, initial_alphabet=alphabet
    )
    sample = texts["text"] if hasattr(texts, "__len__") else (row["text"] for row in texts.take(TOKENIZER_TEXTS))
    bpe.train_from_iterator(sample, trainer=bpe_trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def tokenize_and_pack(texts, tokenizer, args: GPT2Args, seed: int):
    """Token ids of every document, each ended by EOS, concatenated and cut into ``seq_len`` blocks; a held-out
    eval split. Labels are the inputs: the model shifts them. With ``--pack-documents``: each document in pieces
    of ``seq_len`` at most, left as lists for DataCollatorWithFlattening to flatten a micro-batch at a time."""
    tokenize, pack = packing(tokenizer, args.seq_len)
    tokens = texts.map(tokenize, batched=True, remove_columns=["text"], num_proc=args.num_proc)
    if args.pack_documents:
        pieces = tokens.map(
            lambda batch: {
                "input_ids": [
                    ids[i : i + args.seq_len] for ids in batch["input_ids"] for i in range(0, len(ids), args.seq_len)
                ]
            },
            batched=True,
            num_proc=args.num_proc,
        )
        split = pieces.train_test_split(test_size=args.eval_fraction, seed=seed)
        return split["train"], split["test"]
    blocks = tokens.map(pack, batched=True, batch_size=1000, num_proc=args.num_proc)
    split = blocks.train_test_split(test_size=args.eval_fraction, seed=seed)
    return split["train"].with_format("torch"), split["test"].with_format("torch")


def stream_and_pack(texts, tokenizer, args: GPT2Args):
    """The same blocks from a stream, tokenised and packed as it is read (each process its own part: the Trainer
    splits it). Documents whose hash falls in ``eval_fraction`` are held out; the first ``eval_blocks`` of theirs
    are the eval set, read once."""
    from datasets import Dataset

    tokenize, pack = packing(tokenizer, args.seq_len)
    every = max(1, round(1 / args.eval_fraction))

    def held_out(row) -> bool:
        return zlib.crc32(row["text"].encode()) % every == 0

    def blocks(part):
        return part.map(tokenize, batched=True, remove_columns=["text"]).map(pack, batched=True, batch_size=1000)

    train = blocks(texts.filter(lambda row: not held_out(row))).with_format("torch")
    evaluation = Dataset.from_list(list(blocks(texts.filter(held_out)).take(args.eval_blocks)))
    return train, evaluation.with_format("torch")


def packing(tokenizer, seq_len: int):
    """(tokenize, pack) for batched datasets.map: documents to ids ended by EOS; ids to blocks of ``seq_len``."""

    def tokenize(batch):
        return {"input_ids": [ids + [tokenizer.eos_token_id] for ids in tokenizer(batch["text"])["input_ids"]]}

    def pack(batch):
        stream = [token for ids in batch["input_ids"] for token in ids]
        blocks = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
        return {"input_ids": blocks, "labels": blocks}

    return tokenize, pack


def main(argv=None) -> dict:
    args, config = parse_args(argv)
    state = distributed_state(config.collective_timeout_s)  # rank and main_process_first before the Trainer
    if state.device.type == "cuda":  # what a GPU user expects: fp32 matmuls on the tensor cores (autocast aside)
        torch.set_float32_matmul_precision("high")
        state.print("gpt2 | TF32 matmuls on")
    texts = load_texts(args)
    tokenizer_dir = Path(config.output_dir) / "tokenizer"
    with state.main_process_first():  # one process builds the tokenizer and the tokenised data; the rest reuse
        if args.model_name:
            tokenizer = AutoTokenizer.from_pretrained(args.model_name)
        elif (tokenizer_dir / "tokenizer.json").is_file():  # a resumed run must tokenise as the first did
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        else:
            tokenizer = train_tokenizer(texts, args.vocab_size)
            if state.is_main_process:
                tokenizer.save_pretrained(tokenizer_dir)
        if args.streaming:
            train_data, eval_data = stream_and_pack(texts, tokenizer, args)
        else:
            train_data, eval_data = tokenize_and_pack(texts, tokenizer, args, config.seed)

    torch.manual_seed(config.seed)
    if args.model_name:
        model = AutoModelForCausalLM.from_pretrained(args.model_name)
    else:
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=len(tokenizer),
                n_positions=args.seq_len,
                n_embd=args.n_embd,
                n_layer=args.n_layer,
                n_head=args.n_head,
                bos_token_id=tokenizer.eos_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        )
    train_size = "streamed" if args.streaming else f"{len(train_data):,}"
    what = (
        f"documents of {args.seq_len} tokens at most" if args.pack_documents else f"sequences of {args.seq_len} tokens"
    )
    state.print(
        f"gpt2 | {sum(p.numel() for p in model.parameters()):,} parameters, {train_size} train and "
        f"{len(eval_data):,} eval {what}"
    )
    flatten = DataCollatorWithFlattening() if args.pack_documents else None  # position_ids restart per document
    trainer = Trainer(model, config, train_data=train_data, eval_data=eval_data, collate_fn=flatten)
    result = trainer.fit()

    final = Path(config.output_dir) / "final"
    if state.is_main_process:
        tokenizer.save_pretrained(final)
        print(f"eval loss {result['eval_loss']:.4f}, perplexity {result['eval_perplexity']:.2f}")
        # From the exported model: the trained one may be sharded over the processes (FSDP2), and this is one.
        with no_progress_bars_off_a_terminal():
            exported = GPT2LMHeadModel.from_pretrained(final).to(trainer.accelerator.device)
        print(f"sample: {sample(exported, tokenizer, args.prompt, args.sample_tokens)!r}")
        print(f"model and tokenizer saved to {final} (AutoModelForCausalLM / AutoTokenizer .from_pretrained)")
    return result


@torch.no_grad()
def sample(model: torch.nn.Module, tokenizer, prompt: str, new_tokens: int) -> str:
    """The prompt and up to ``new_tokens`` sampled after it, no more than the model's context holds (GPT-2's
    positions end at n_positions: past them its embedding has no row)."""
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt").to(next(model.parameters()).device)
    new_tokens = min(new_tokens, model.config.n_positions - inputs["input_ids"].shape[1])
    generator_seed = torch.random.get_rng_state()
    torch.manual_seed(0)  # the same sample for the same weights
    output = model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        do_sample=True,
        top_k=40,
        temperature=0.8,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.random.set_rng_state(generator_seed)
    return tokenizer.decode(output[0], skip_special_tokens=True)


if __name__ == "__main__":
    main()
