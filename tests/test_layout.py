"""The package's shape, checked as code is: every module at most 300 lines and the Trainer class at most 250 of code,
read in one file; the parts every module takes typed; no formatter markers, FSDP2 named only inside the parallelism
package, a bucket only inside the checkpoints' storage, the old checkpoint format only in its own module,
keyword-only arguments past the third, and no import cycle among the package's modules or its folders (read with
ast, imports inside functions included); the tests laid out as the package is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trainer"
MODULES = sorted(PACKAGE.rglob("*.py"))


def name_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: name_of(path))
def test_each_module_is_at_most_300_lines_with_no_formatter_markers(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 300
    assert "fmt: skip" not in text and "fmt: off" not in text


def test_the_trainer_class_is_at_most_250_lines_of_code():
    """Its code, that is: docstrings, comments and blank lines are a reader's help, not its length."""
    text = (PACKAGE / "trainer.py").read_text()
    (trainer,) = [node for node in ast.parse(text).body if isinstance(node, ast.ClassDef)]
    docstrings = set()
    for node in ast.walk(trainer):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            docstrings |= set(range(body[0].lineno, body[0].end_lineno + 1))
    lines = text.splitlines()[trainer.lineno - 1 : trainer.end_lineno]
    code = [
        line
        for number, line in enumerate(lines, start=trainer.lineno)
        if number not in docstrings and line.strip() and not line.strip().startswith("#")
    ]
    assert len(code) <= 250, f"{len(code)} lines of code"


def test_the_trainer_is_read_in_one_file_without_reaching_into_its_parts_parts():
    """No base class elsewhere to learn it from, and no ``self.part.inner.x``: what the Trainer asks of a part's own
    part is named once, where the parts are built."""
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    (trainer,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert not trainer.bases

    def chain(node: ast.AST) -> list[str]:
        names = []
        while isinstance(node, ast.Attribute):
            names, node = [node.attr, *names], node.value
        return [node.id, *names] if isinstance(node, ast.Name) else []

    reaches = {".".join(names) for node in ast.walk(trainer) if len(names := chain(node)) > 3 and names[0] == "self"}
    assert not reaches


def test_only_the_storage_knows_a_bucket():
    """The checkpoint manager (and the Trainer) say what happens to a checkpoint, never where it is kept: object
    storage is named in code only by the storage (``checkpoint/storage.py``, ``bucket.py``, ``transfers.py``) and
    by the commands that check or read a bucket themselves (``tools/``)."""
    allowed = ("trainer.checkpoint.storage", "trainer.checkpoint.bucket", "trainer.checkpoint.transfers")
    knowing = set()
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = {getattr(node, field, None) for field in ("id", "attr", "arg", "name", "module")}
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {alias.name for alias in node.names}
            if any(isinstance(name, str) and "bucket" in name.lower() for name in names):
                knowing.add(name_of(path))
    assert {name for name in knowing if not name.startswith(("trainer.tools.", *allowed))} == set()


def test_only_the_legacy_module_reads_the_checkpoint_format_before_dcp():
    """A checkpoint is read through DCP's ``shards/`` and ``trainer_state.json`` everywhere; the layout written before
    (``model.safetensors`` read by safetensors, ``optimizer.bin``, a flat state) is read by ``checkpoint/legacy.py``
    alone, which the others call."""
    knowing = set()
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = {getattr(node, field, None) for field in ("id", "attr", "name")}
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {alias.name for alias in node.names}
            if names & {"load_file", "safe_open", "OPTIMIZER_FILE"}:
                knowing.add(name_of(path))
    assert knowing == {"trainer.checkpoint.legacy"}, knowing


def test_only_the_parallelism_package_knows_fsdp2():
    knowing = {
        name_of(path)
        for path in MODULES
        if any(word in path.read_text() for word in ("fully_shard", "FSDPModule", "DTensor"))
    }
    assert knowing and all(name.startswith("trainer.parallel.") for name in knowing), knowing


def test_arguments_past_the_third_are_keyword_only():
    """Dunder methods other than ``__init__`` keep the signatures their protocols give them."""
    found = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name.startswith("__") and node.name.endswith("__") and node.name != "__init__":
                continue
            positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(positional) > 3:
                found.append(f"{name_of(path)}.{node.name}({', '.join(positional)})")
    assert not found


def test_the_parts_every_module_takes_are_typed():
    """``run``, ``strategy``, ``optimization`` and ``loss_fn`` are the same objects wherever they are taken: each
    parameter of those names says its type (under ``if TYPE_CHECKING:`` where an import would close a cycle), so
    that go-to-definition works on them, not ``Any``."""
    untyped = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                for argument in arguments:
                    if argument.arg in ("run", "strategy", "optimization", "loss_fn") and (
                        argument.annotation is None or ast.unparse(argument.annotation) == "Any"
                    ):
                        untyped.append(f"{name_of(path)}.{node.name}({argument.arg})")
    assert not untyped


def imported(path: Path) -> set[str]:
    """The package's modules ``path`` imports (``from trainer.x import y`` names y or x.y, and x), at its top level
    and in its functions (an import deferred to a call is an edge all the same), not those for type checking alone
    (under ``if TYPE_CHECKING:``), which never run."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("trainer")}
    return found


def test_no_import_cycle_among_the_modules():
    names = {name_of(path): path for path in MODULES}
    # A package's __init__ is imported with any of its modules.
    edges = {
        name: {
            other for other in imported(path) if other in names and other != name and not name.startswith(other + ".")
        }
        for name, path in names.items()
    }
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for other in sorted(edges[name]):
            if state.get(other) == 1:
                cycle = trail[trail.index(other) :] if other in trail else trail
                pytest.fail("import cycle: " + " -> ".join([*cycle, other]))
            if other not in state:
                visit(other, [*trail, other])
        state[name] = 2

    for name in sorted(names):
        if name not in state:
            visit(name, [name])


def test_no_import_cycle_among_the_folders():
    """A folder (``checkpoint/``, ``loop/``, ...) or a top-level module (``console``, ``state``: the words every
    folder uses) imports from another only one way, so the folders stack in layers."""

    def unit(name: str) -> str:
        parts = name.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else name

    names = {name_of(path): path for path in MODULES}
    edges: dict[str, set[str]] = {}
    for name, path in names.items():
        # "trainer" itself: every module's parent package ("from trainer import console" names it too).
        for other in imported(path) & set(names):
            if unit(other) != unit(name) and other != "trainer":
                edges.setdefault(unit(name), set()).add(unit(other))
    state: dict[str, int] = {}

    def visit(here: str, trail: list[str]) -> None:
        state[here] = 1
        for other in sorted(edges.get(here, ())):
            if state.get(other) == 1:
                pytest.fail("folders in a cycle: " + " -> ".join([*trail[trail.index(other) :], other]))
            if other not in state:
                visit(other, [*trail, other])
        state[here] = 2

    for here in sorted(edges):
        if here not in state:
            visit(here, [here])


def test_the_tests_mirror_the_package():
    """A test module sits in the folder of what it tests (``tests/checkpoint/`` for ``trainer/checkpoint/``); at the
    top only what spans the package (its shape, docs, examples, a GPU) and the start-up of the tests' own processes;
    the job scripts the tests launch, what they lean on and stored data in their own folders."""
    tests = Path(__file__).resolve().parent
    folders = {path.name for path in tests.iterdir() if path.is_dir() and not path.name.startswith(("_", "."))}
    package = {path.name for path in PACKAGE.iterdir() if path.is_dir() and not path.name.startswith("_")}
    assert folders - {"jobs", "support", "fixtures"} <= package, folders - package
    top = {path.name for path in tests.glob("test_*.py")}
    spanning = {"test_layout.py", "test_docs.py", "test_examples.py", "test_gpt2.py", "test_gpu.py", "test_startup.py"}
    assert top <= spanning, top
    assert not list((tests / "jobs").glob("test_*.py")) and not list((tests / "support").glob("test_*.py"))
