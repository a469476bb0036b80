"""Documents packed into one row per micro-batch (transformers' ``DataCollatorWithFlattening``: ``position_ids``
restart at each document, no padding) against the same documents padded, through the Trainer on every process of
the launch, for a GPT-2 and a Llama: rank 0 writes each run's losses and weights to ``<out>/packing.json``. An OPT,
whose attention crosses the restarts, given the packed batches: the refusal's message, under ``"opt packed"``.

    accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 tests/jobs/packing.py \\
        --out runs/packing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import (
    DataCollatorWithFlattening,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import ConfigError, TrainConfig, Trainer  # noqa: E402

VOCAB = 64


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_positions=64,
                n_embd=32,
                n_layer=2,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    if arch == "opt":
        return OPTForCausalLM(
            OPTConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                word_embed_proj_dim=32,
                max_position_embeddings=64,
            )
        )
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )


def padded(rows: list[dict], length: int | None = None) -> dict:
    """The same documents, each in its own row, padded to the longest (or ``length``): attention_mask 0 and labels
    -100 there."""
    length = length or max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n], mask[i, :n] = torch.tensor(row["input_ids"]), 1
        labels[i, :n] = ids[i, :n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 24, (32,), generator=generator).tolist()
    documents = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=generator).tolist()} for n in lengths]
    runs = {}
    for arch in ("gpt2", "llama"):
        for name, collate in (("packed", DataCollatorWithFlattening()), ("padded", padded)):
            config = TrainConfig(
                output_dir=f"{args.out}/{arch}-{name}",
                batch_size=4,
                max_steps=4,
                optimizer="sgd",
                lr=0.5,
                log_every=1,
                shuffle=False,
            )
            trainer = Trainer(build(arch), config, train_data=documents, collate_fn=collate)
            trainer.fit()
            weights = {n: p.detach().flatten().tolist() for n, p in trainer.unwrapped_model.named_parameters()}
            losses = [row["train_loss"] for row in trainer.log_history if "train_loss" in row]
            history = trainer.log_history
            ratios = [row["examples_per_s"] / row["tokens_per_s"] for row in history if "tokens_per_s" in row]
            runs[f"{arch} {name}"] = {
                "losses": losses,
                "weights": weights,
                "examples_per_token": ratios,
                "lengths": lengths,
            }
    opt = Trainer(
        build("opt"),
        TrainConfig(output_dir=f"{args.out}/opt-packed", batch_size=4, max_steps=4, optimizer="sgd", shuffle=False),
        train_data=documents,
        collate_fn=DataCollatorWithFlattening(),
    )
    try:
        opt.fit()
        runs["opt packed"] = "trained"
    except ConfigError as refusal:
        runs["opt packed"] = str(refusal)
    if trainer.accelerator.is_main_process:
        Path(args.out, "packing.json").write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
