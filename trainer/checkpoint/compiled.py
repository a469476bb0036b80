"""Compiled graphs kept in the checkpoint: a compiled run (``compile: true``, whole or per block) saves torch's compile
artefacts (``torch.compiler.save_cache_artifacts``: the FX graphs and kernels compiled so far) with each checkpoint,
each rank its own, beside a key (torch's version, the device, the compile settings). ``resume: auto`` loads them into
torch's caches before the first step compiles, and says how many it took; a key that differs compiles cold, said in
a line (docs/checkpoints.md#compiled-graphs). A preempted job then pays its first compile once, not at every restart.

The artefacts are code torch runs (generated kernels, pickled graphs): they are loaded only from the run's own
checkpoints (``resume: auto``), never from a path given by hand, as the rest of a checkpoint is read without running
anything it holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from trainer.console import say

if TYPE_CHECKING:
    from trainer.launch.run import Run

KEY = "compiled.json"


def artefacts(rank: int) -> str:
    return f"compiled_{rank}.bin"


class CompiledGraphs:
    """What ``ModelPart`` saves and loads of a compiled model's graphs; ``for_run`` gives None for an eager run."""

    def __init__(self, run: Run, compilation: Any):
        # The run's own checkpoints (a bucket's are downloaded there too): the only ones whose graphs are loaded.
        self.rank, self.auto = run.rank, run.config.resume == "auto"
        self.own = Path(run.config.output_dir, "checkpoints").resolve()
        device = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else run.device.type
        self.key = json.loads(
            json.dumps(
                {"torch": torch.__version__, "device": device, "compile": compilation.kwargs},
                default=str,
            )
        )
        # Graphs loaded from a checkpoint into torch's caches (None: none loaded); saved: this process saved some.
        self.loaded: Optional[int] = None
        self.saved = False

    @classmethod
    def for_run(cls, run: Run) -> Optional["CompiledGraphs"]:
        from trainer.parallel.compiling import Compilation

        compilation = Compilation.of(run.config.compile)
        return cls(run, compilation) if compilation is not None else None

    def save(self, folder: Path) -> None:
        """This rank's artefacts (those compiled in this process and those it loaded), and the key."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        self.saved = True
        (folder / artefacts(self.rank)).write_bytes(saved[0])
        if self.rank == 0:
            (folder / KEY).write_text(json.dumps(self.key))

    def load(self, folder: Path) -> None:
        """Into torch's caches before anything compiles: this rank's artefacts (else the first rank's), when the
        checkpoint is the run's own and its key is this run's; otherwise the first step compiles cold."""
        file = folder / artefacts(self.rank)
        file = file if file.is_file() else folder / artefacts(0)
        # A spike's rollback reloads a checkpoint mid-run: this process's caches hold its graphs already.
        if not file.is_file() or not (folder / KEY).is_file() or self.saved or self.loaded is not None:
            return
        if not (self.auto and folder.resolve().is_relative_to(self.own)):
            say(
                "compiled cold: compiled graphs are taken from the run's own checkpoints only (resume: auto)", once=True
            )
            return
        try:
            theirs = json.loads((folder / KEY).read_text())
        except ValueError:
            theirs = {}
        theirs = theirs if isinstance(theirs, dict) else {}
        if theirs != self.key:
            differs = ", ".join(
                f"{name} {theirs.get(name)} -> {mine}" for name, mine in self.key.items() if theirs.get(name) != mine
            )
            say(f"compiled cold: the checkpoint's graphs were compiled otherwise ({differs})", once=True)
            return
        try:
            info = torch.compiler.load_cache_artifacts(file.read_bytes())
        # Artefacts torch cannot read back cost the warm start, not the resume.
        except Exception as err:
            say(f"compiled cold: the checkpoint's graphs could not be loaded ({type(err).__name__}: {err})", once=True)
            return
        self.loaded = len(getattr(info, "inductor_artifacts", ()) or ()) if info is not None else 0
        say(f"compiled graphs: {self.loaded} taken from the checkpoint into torch's cache (the first step uses them)")


def graph_cache_hits() -> dict[str, Any]:
    """torch's own counts of FX graphs taken from its cache and compiled afresh in this process."""
    from torch._dynamo.utils import counters

    return {"hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"]}
