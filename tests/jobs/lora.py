"""A LoRA adapter (PEFT's ``get_peft_model``) on a small GPT-2, trained by the Trainer: each job writes, from the
main process, ``<out>/<name>/lora.json``: the trainable tensors after training, whether the frozen ones stayed
as built, the files of ``final/``, and whether PEFT's own loader puts the same adapter back on a fresh base.

    accelerate launch --config_file accelerate_configs/fsdp.yaml tests/jobs/lora.py --out runs/lora \\
        --jobs '{"fsdp": [], "ddp": ["--ddp"]}'
    python tests/jobs/lora.py --out runs/lora --jobs '{"one": ["--accumulation", "2"]}'   # the same global batch
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import TrainConfig, Trainer  # noqa: E402


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )  # no dropout: any split, the same updates


def job(out: Path, resume_from: str | None, accumulation: int) -> None:
    model = get_peft_model(
        base_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    )
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    generator = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (48, 32), generator=generator)]
    config = TrainConfig(
        output_dir=str(out),
        batch_size=4,
        gradient_accumulation_steps=accumulation,
        max_steps=6,
        optimizer="sgd",
        lr=0.5,
        save_every=2,
        keep_last=4,
        log_every=1,
        shuffle=False,
        resume=resume_from,
    )
    trainer = Trainer(model, config, train_data=rows)
    trainer.fit()

    def whole(p: torch.Tensor) -> torch.Tensor:
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()

    trainer.save_model(out / "merged", merged=True)  # the base model with the adapter folded in, asked for
    params = dict(trainer.unwrapped_model.named_parameters())
    trained = {name: whole(p).flatten().tolist() for name, p in params.items() if p.requires_grad}
    kept = all(torch.equal(whole(params[name]), value) for name, value in frozen.items())  # collective: every rank
    if trainer.accelerator.is_main_process:
        loaded = PeftModel.from_pretrained(base_model(), out / "final")
        back = {name: p.detach().flatten().tolist() for name, p in loaded.named_parameters() if "lora_" in name}
        (out / "lora.json").write_text(
            json.dumps(
                {
                    "trained": trained,
                    "frozen_kept": kept,
                    "final": sorted(p.name for p in (out / "final").iterdir()),
                    "loaded_back": back == trained,
                    "losses": [row["train_loss"] for row in trainer.log_history],
                    "out": str(out),
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", default='{"": []}', help='JSON {"name": [flags]}: one job each, in <out>/<name>')
    args = parser.parse_args()
    for name, flags in json.loads(args.jobs).items():
        flag = argparse.ArgumentParser()
        flag.add_argument("--ddp", action="store_true", help="under an FSDP launch: this job as DDP")
        flag.add_argument("--resume_from", default=None)
        flag.add_argument("--accumulation", type=int, default=1)
        options = flag.parse_args(flags)
        saved = dict(os.environ)
        if options.ddp:
            os.environ.pop("ACCELERATE_USE_FSDP", None)
        job(Path(args.out, name), options.resume_from, options.accumulation)
        os.environ.clear()
        os.environ.update(saved)


if __name__ == "__main__":
    main()
