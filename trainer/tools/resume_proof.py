"""The resume proof: your script, unchanged, run uninterrupted and run killed after a checkpoint and resumed, their
checkpoints compared byte for byte; then a resume without its data position, which must differ (docs/checkpoints.md).

    python -m trainer.check --resume-proof [--config_file my.yaml] [--steps 6] my_script.py [its args]

Each run gets ``output_dir``, ``max_steps``, ``save_every`` and ``resume`` through ``TRAINER_OVERRIDES``, which every
TrainConfig the script builds takes, in code or from YAML. Exit 0: the resumed run's checkpoints are the
uninterrupted run's and the control's are not; 1 otherwise, naming the first difference (step, then tensor or part).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from trainer.checkpoint.integrity import STATE_FILE, complete_checkpoints
from trainer.checkpoint.manager import CRASH_AFTER, WITHHOLD
from trainer.checkpoint.safe_dcp import safe_reader, sharded_weights
from trainer.config.reading import ENV_OVERRIDES

# What a run's checkpoint records that two equal runs differ in: where they were written, and the run's own name.
OWN = {"output_dir", "resume", "run_id"}
# DCP's index names the folder it was written to: compared by what it indexes, not its bytes.
INDEX = "shards/.metadata"
CAUSES = (
    "What usually causes it: state the script keeps outside the trainer (a counter, a running statistic, a schedule "
    "of its own: keep it in a callback with state_dict() and load_state_dict(), which every checkpoint holds), or "
    "randomness from a generator of the script's own (torch's, numpy's and random's global states are restored)."
)
UNEQUAL_RUNS = (
    "Two runs of the script disagree before any resume: it is not deterministic from run to run (a source of "
    "randomness not seeded, data whose order changes between runs, or, on a GPU, nondeterministic kernels: "
    "TrainConfig deterministic=True)."
)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.check --resume-proof", description=__doc__.split("\n")[0])
    parser.add_argument("--config_file", "--config-file", help="launch with accelerate launch and this config")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps each run trains (default 6)")
    parser.add_argument("--save_every", "--save-every", type=int, help="a checkpoint every so many (steps // 3)")
    parser.add_argument("--work_dir", "--work-dir", help="where the runs write (default: a new temporary folder)")
    parser.add_argument("script", help="the training script, run as it is")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    every = args.save_every or max(1, args.steps // 3)
    if args.steps < 2 * every:
        parser.error(f"--steps {args.steps} must hold two checkpoints of --save_every {every}: the resume's and one")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="resume-proof-")).resolve()
    proof = Proof(args.script, args.script_args, config_file=args.config_file, work=work)
    ok = proof.run(args.steps, every)
    if ok and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    elif not ok:
        print(f"the runs' logs and checkpoints are in {work}")
    return 0 if ok else 1


class Proof:
    """The four runs of ``script`` (under ``accelerate launch --config_file`` when given) in ``work``, and what
    their checkpoints say."""

    def __init__(self, script: str, script_args: list[str], *, config_file: Optional[str], work: Path):
        self.script, self.script_args, self.config_file, self.work = script, script_args, config_file, work

    def run(self, steps: int, every: int) -> bool:
        how = f"accelerate launch --config_file {self.config_file}" if self.config_file else "one process"
        print(f"resume proof: {self.script} ({how}), {steps} steps, a checkpoint every {every}", flush=True)
        common = {"max_steps": steps, "save_every": every, "keep_last": steps // every + 1, "save_async": False}
        common.update(checkpoint_storage=None, keep_best=None, load_best_at_end=None, wandb_project=None)
        plain, resumed, control = self.work / "uninterrupted", self.work / "resumed", self.work / "control"
        # A --work_dir used before: its runs start again.
        for folder in (plain, resumed, control):
            shutil.rmtree(folder, ignore_errors=True)
            folder.with_suffix(".log").unlink(missing_ok=True)
        first = f"step {every}'s checkpoint"
        if not self._launch("uninterrupted", plain, {**common, "resume": None}):
            return False
        crash = {CRASH_AFTER: str(every)}
        if self._launch(f"killed after {first}", resumed, {**common, "resume": None}, env=crash, killed=True):
            print(f"FAILED: the run was not killed: it wrote no {first} (does the script call fit() on its config?)")
            return False
        kept = _checkpoints(resumed).get(every)
        if kept is None:
            print(f"FAILED: the killed run left no committed checkpoint of step {every} in {resumed}")
            return False
        # Two runs that differ before any resume: nothing a resume does can be judged.
        unequal = first_difference(plain, resumed, upto=every)
        if unequal is not None:
            print(f"NOT EXACT: step {unequal[0]}'s checkpoint differs from the uninterrupted run's: {unequal[1]}.")
            print(UNEQUAL_RUNS)
            return False
        if not self._launch("resumed", resumed, {**common, "resume": "auto"}):
            return False
        exact = first_difference(plain, resumed)
        if exact is not None:
            print(f"NOT EXACT: step {exact[0]}'s checkpoint differs from the uninterrupted run's: {exact[1]}.")
            print(f"The resume was at step {every}. {CAUSES}")
            return False
        print(f"exact: every checkpoint after the resume at step {every} is the uninterrupted run's, byte for byte")
        withheld = {**common, "resume": str(kept)}
        if not self._launch("control: resumed without its data position", control, withheld, env={WITHHOLD: "data"}):
            return False
        differed = first_difference(plain, control)
        if differed is None:
            print(
                "INCONCLUSIVE: the control, resumed without its data position, came out the same too, so this "
                f"comparison could not have failed: step {every} is at an epoch's start, or every batch is alike; "
                "choose --save_every so that a checkpoint falls inside an epoch"
            )
            return False
        print(f"control differed, as it must: step {differed[0]}: {differed[1]}")
        return True

    def _launch(
        self,
        name: str,
        output_dir: Path,
        overrides: dict[str, Any],
        *,
        env: Optional[dict] = None,
        killed: bool = False,
    ) -> bool:
        """Run the script once; True when it exited 0 (its output in ``<work>/<output_dir's name>.log``); unless it
        is to be ``killed``, its log's end is said when it did not."""
        command = [sys.executable, self.script, *self.script_args]
        if self.config_file:
            launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", self.config_file]
            # (accelerate's default port taken on one machine, accelerate finds a free one itself)
            command = [*launch, self.script, *self.script_args]
        overrides = {**overrides, "output_dir": str(output_dir)}
        environ = {**os.environ, ENV_OVERRIDES: json.dumps(overrides), "WANDB_MODE": "disabled", **(env or {})}
        self.work.mkdir(parents=True, exist_ok=True)
        log, started = self.work / f"{output_dir.name}.log", time.monotonic()
        with open(log, "a") as out:
            out.write(f"\n=== {name}: {' '.join(command)}\n")
            out.flush()
            code = subprocess.run(command, env=environ, stdout=out, stderr=subprocess.STDOUT).returncode
        ended = "killed (SIGKILL)" if killed and code in (-9, 137) else f"exit {code}"
        print(f"  {name}: {ended} ({time.monotonic() - started:.0f} s)", flush=True)
        if code != 0 and not killed:
            tail = log.read_text().splitlines()[-15:]
            print(f"FAILED: the {name} run exited {code}; the end of {log}:\n" + "\n".join(tail))
        return code == 0


def _checkpoints(output_dir: Path) -> dict[int, Path]:
    return {int(p.name.split("-")[1]): p for p in complete_checkpoints(output_dir / "checkpoints")}


def first_difference(one: Path, other: Path, *, upto: Optional[int] = None) -> Optional[tuple[int, str]]:
    """The first step at which the two runs' checkpoints differ, and what differs there; None when every step both
    have (up to step ``upto``) is the same, the last one included."""
    mine, theirs = _checkpoints(one), _checkpoints(other)
    last = max(step for step in mine if upto is None or step <= upto)
    if last not in theirs:
        return last, f"{other} has no checkpoint of step {last}"
    for step in sorted(step for step in set(mine) & set(theirs) if step <= last):
        what = differences(mine[step], theirs[step])
        if what:
            return step, "; ".join(what[:3]) + (f"; and {len(what) - 3} more" if len(what) > 3 else "")
    return None


def differences(one: Path, other: Path) -> list[str]:
    """What differs between two checkpoints, the training position first, then each tensor by name."""
    state, theirs = (json.loads((p / STATE_FILE).read_text()) for p in (one, other))
    found = [_said(part, _plain(state.get(part)), _plain(theirs.get(part))) for part in _parts(state, theirs)]
    files, their_files = state["crc32"], theirs["crc32"]
    found += [f"{name} is in one checkpoint only" for name in sorted(set(files) ^ set(their_files))]
    changed = sorted(name for name in set(files) & set(their_files) if files[name] != their_files[name])
    if any(name.startswith("shards/") and name != INDEX for name in changed):
        found += [
            *_tensors(one, other, "model", word="model weight"),
            *_tensors(one, other, "optimizer", word="optimizer state"),
        ]
    if INDEX in changed and _index(one) != _index(other):
        found.append("DCP's index (the tensors' names, shapes or chunks)")
    found += [f"{_named(name)} ({name})" for name in changed if not name.startswith("shards/")]
    return found


def _parts(state: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The plain-data parts that differ (the run's settings, less what names each run's own folder)."""
    names = (set(state) | set(theirs)) - {"files", "crc32"}
    return [part for part in sorted(names) if _plain(state.get(part)) != _plain(theirs.get(part))]


def _said(part: str, mine: Any, theirs: Any) -> str:
    """A plain-data part that differs, in words: the training position, the run's settings, or the part's value."""
    if part == "train" and isinstance(mine, dict) and isinstance(theirs, dict):
        where = "step {global_step}, epoch {epoch}, batch {batches_into_epoch}"
        return f"the training position: {where.format(**mine)} against {where.format(**theirs)}"
    if part == "run" and isinstance(mine, dict) and isinstance(theirs, dict):
        mine, theirs = {**mine, **mine.get("config", {})}, {**theirs, **theirs.get("config", {})}
        keys = [key for key in mine if key != "config" and mine[key] != theirs.get(key)]
        return "the run's settings: " + ", ".join(f"{key} {mine[key]!r} against {theirs.get(key)!r}" for key in keys)
    if isinstance(mine, dict) and isinstance(theirs, dict):
        keys = sorted(key for key in set(mine) | set(theirs) if mine.get(key) != theirs.get(key))
        return f"the {part!r} part's {', '.join(keys)}"
    return f"the {part!r} part: {_short(mine)} against {_short(theirs)}"


def _short(value: Any) -> str:
    said = repr(value)
    return said if len(said) <= 80 else said[:77] + "..."


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items() if key not in OWN}
    return value


def _tensors(one: Path, other: Path, part: str, *, word: str) -> list[str]:
    """The tensors of ``part`` that differ, in the checkpoint's order, with the largest difference; read a few
    hundred MB at a time."""
    entries, read = sharded_weights(one, part)
    their_entries, read_theirs = sharded_weights(other, part)
    names, theirs = [name for name, _ in entries], dict(their_entries)
    found = [f"{word} {name} is in one checkpoint only" for name in sorted(set(names) ^ set(theirs))]
    batches: list[list[str]] = [[]]
    held = 0
    for name, size in entries:
        if name in theirs:
            if held + size > 1 << 28 and batches[-1]:
                batches.append([])
                held = 0
            batches[-1].append(name)
            held += size
    for batch in batches:
        mine, other_ones = read(batch), read_theirs(batch)
        found += [_compared(word, name, mine[name], b=other_ones[name]) for name in batch]
    return [line for line in found if line]


def _compared(word: str, name: str, a: torch.Tensor, *, b: torch.Tensor) -> str:
    """How tensor ``name`` differs between two checkpoints, or ""."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{word} {name}: {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
    if torch.equal(a, b):
        return ""
    if not a.is_floating_point():
        return f"{word} {name}"
    return f"{word} {name} (largest difference {(a.double() - b.double()).abs().max().item():.3g})"


def _index(folder: Path) -> Any:
    return {name: repr(entry) for name, entry in safe_reader(folder).read_metadata().state_dict_metadata.items()}


def _named(file: str) -> str:
    """What a checkpoint's file holds, in words."""
    rank = "".join(ch for ch in file.rsplit("_", 1)[-1] if ch.isdigit())
    if file.startswith("random_states_"):
        return f"rank {rank}'s random states"
    if file.startswith("callback_states_"):
        return f"the callbacks' states (rank {rank})"
    return {"scheduler.bin": "the lr schedule", "scaler.pt": "fp16's loss scaler"}.get(file, file)
