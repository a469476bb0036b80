"""The accelerate configs shipped with the package, for a project that installed it with pip (docs/launching.md):

python -m trainer.configs                     # each config and what it is for
python -m trainer.configs fsdp.yaml           # a copy in ./accelerate_configs/, to edit (never over a file)
python -m trainer.configs fsdp.yaml --to cfg  # the copy in cfg/
accelerate launch --config_file "$(python -m trainer.configs fsdp.yaml --path)" train.py   # as shipped
"""

from __future__ import annotations

import argparse
import shutil
import sys
from importlib import resources
from pathlib import Path
from typing import Optional

from trainer.errors import ConfigError


def shipped() -> dict[str, Path]:
    """Every shipped config by file name."""
    folder = Path(str(resources.files("trainer") / "accelerate_configs"))
    return {path.name: path for path in sorted(folder.glob("*.yaml"))}


def about(path: Path) -> str:
    """What a config is for: its first comment line, up to its first colon."""
    first = next((line for line in path.read_text().splitlines() if line.startswith("#")), "# ")
    return first.lstrip("# ").split(": ")[0].strip().rstrip(".")


def named(name: str) -> Path:
    configs, name = shipped(), name if name.endswith(".yaml") else f"{name}.yaml"
    if name not in configs:
        raise ConfigError(f"no accelerate config {name} ships with the trainer; these do: {', '.join(configs)}")
    return configs[name]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.configs", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", help="a shipped config (fsdp.yaml, or fsdp); none: list them")
    parser.add_argument("--to", type=Path, default=Path("accelerate_configs"), help="the folder the copy goes in")
    parser.add_argument("--path", action="store_true", help="print the shipped file's path, copy nothing")
    args = parser.parse_args(argv)
    if args.name is None:
        configs = shipped()
        width = max(map(len, configs))
        sys.stdout.write("".join(f"{name:<{width}}  {about(path)}\n" for name, path in configs.items()))
        return
    source = named(args.name)
    if args.path:
        sys.stdout.write(f"{source}\n")
        return
    copy = args.to / source.name
    if copy.exists():
        raise ConfigError(f"{copy} already exists: edit it, or pass --to another folder")
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, copy)
    sys.stdout.write(f"wrote {copy}: edit it, then accelerate launch --config_file {copy} your_script.py\n")
