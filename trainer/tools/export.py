"""``python -m trainer.export CHECKPOINT DIRECTORY``: a checkpoint's weights as a model you can load anywhere, on one
process, with no process group and no merge tool (docs/checkpoints.md)::

    python -m trainer.export runs/gpt2/checkpoints/step-00000200 exported/
    python -m trainer.export s3://bucket/gpt2/step-00000200 exported/   # checkpoint_storage's: downloaded first
    # exported/model.safetensors (+ config.json for a transformers model: AutoModel*.from_pretrained("exported"))

into a new or empty folder (``--replace``: any, replaced whole; never one inside the checkpoint). The checkpoint is
verified first; past 5 GB the weights go into numbered files with transformers' index. A PEFT model's checkpoint
exports as its adapter, or with ``--merged`` as the base model with the adapter folded in.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional

from trainer.checkpoint.export import export
from trainer.checkpoint.hf_files import ADAPTER_FILE, MODEL_CONFIG


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", help="a checkpoint folder, <output_dir>/checkpoints/step-N, or its URL in checkpoint_storage"
    )
    parser.add_argument(
        "directory", type=Path, help="where to write model.safetensors (and config.json): a new or empty folder"
    )
    parser.add_argument("--replace", action="store_true", help="replace what the folder holds, whole")
    parser.add_argument(
        "--merged",
        action="store_true",
        help="a PEFT model's checkpoint: the base model with the "
        "adapter folded in (merge_and_unload), not the adapter alone",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trainer-export-") as downloads:
        checkpoint = Path(args.checkpoint)
        if "://" in args.checkpoint:
            from trainer.checkpoint.bucket import Bucket

            parent, _, name = args.checkpoint.rstrip("/").rpartition("/")
            # Every object checked against the manifest (size, CRC-32) as it is downloaded.
            checkpoint = Bucket(parent).fetch(name, Path(downloads))
        written = export(checkpoint, args.directory, replace=args.replace, merged=args.merged)
    if written.name == ADAPTER_FILE:
        loads = "PeftModel.from_pretrained(base_model, directory)"
    elif (args.directory / MODEL_CONFIG).is_file():
        loads = "AutoModel*.from_pretrained"
    else:
        loads = "safetensors.torch.load_file"
    sys.stdout.write(f"exported {args.checkpoint} to {written} ({loads})\n")


if __name__ == "__main__":
    main()
