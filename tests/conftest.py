"""Helpers that run jobs as real processes: plain python, `accelerate launch` and torchrun, 2 CPU processes."""

from __future__ import annotations

import ast
import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The job scripts the tests launch (tests/jobs/), what they lean on (tests/support/), and the test modules of every
# folder, imported by name (from test_checkpoint import final_weights) wherever the importer is.
TESTS = ROOT / "tests"
sys.path[:0] = [
    str(path) for path in sorted(TESTS.iterdir()) if path.is_dir() and path.name not in ("fixtures", "__pycache__")
]
CONFIGS = ROOT / "accelerate_configs"
SAME_UPDATES = ROOT / "examples" / "same_updates.py"
SCENARIOS = ROOT / "tests" / "jobs" / "scenarios.py"
JOBS = ROOT / "tests" / "jobs" / "run_many.py"  # several runs in one process
STARTUP = ROOT / "tests" / "support" / "startup"  # on every started process's PYTHONPATH

# Variables a launcher sets; a test must not inherit them from whatever launched pytest.
# (ACCELERATE_* variables go too.)
LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


def pytest_configure(config):
    """With pytest-xdist's -n, each test module runs whole on one worker (``--dist loadscope``), so that a
    module-scoped launch its tests share (tests/parallel/test_fsdp.py's, ...) runs once rather than once per worker.
    (``xdist_group`` marks did this until pytest 9.2, whose node ids no longer take the group's suffix that
    pytest-xdist 3.8 adds: every worker ran each shared launch again.)"""
    if getattr(config.option, "dist", "no") == "load":  # the controller: the scheduler it will make
        config.option.dist = "loadscope"


# What starts a process: this file's helpers, subprocess's and pexpect's.
STARTS_PROCESSES = {
    "run",
    "run_together",
    "accelerate_node",
    "python",
    "accelerate_launch",
    "torchrun",
    "accelerate_config",
    "launch_jobs",
}


@functools.cache
def launching(path: Path) -> frozenset[str]:
    """The functions (fixtures too) of a test module that start processes, directly or through another of them."""
    functions = {node.name: node for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}

    def called(function: ast.FunctionDef) -> set[str]:
        names = set()
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                names.add(node.func.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id in ("subprocess", "pexpect"):
                    names.add("run")
        return names

    calls = {name: called(function) for name, function in functions.items()}
    found = {name for name, names in calls.items() if names & STARTS_PROCESSES}
    while grown := {name for name, names in calls.items() if names & found} - found:
        found |= grown
    return frozenset(found)


def pytest_collection_modifyitems(items):
    """``launches`` on every test that starts processes (itself, or a fixture of its module or of one it imports
    from): ``-m "not launches"`` is the in-process rest, a minute or two. The modules that launch most run first,
    each in its own order: under ``-n 2`` a long module started last would leave the other worker idle at the end."""
    fixtures = set().union(*(launching(Path(item.fspath)) for item in items), launching(Path(__file__)))
    launches: dict[str, int] = {}
    for item in items:
        own = launching(Path(item.fspath))
        launched = getattr(item, "originalname", item.name) in own or set(item.fixturenames) & fixtures
        if launched:
            item.add_marker(pytest.mark.launches)
        launches[item.fspath] = launches.get(item.fspath, 0) + bool(launched)
    items.sort(key=lambda item: -launches[item.fspath])


def pytest_terminal_summary(terminalreporter):
    """The releases the suite ran on, last (with -q too): a test that breaks on a fresh install names them."""
    from importlib.metadata import PackageNotFoundError, version

    names = ("torch", "accelerate", "transformers", "datasets", "wandb", "safetensors", "peft", "torchao")
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} absent")
    terminalreporter.write_line("releases: " + ", ".join(found))


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768 and up): a port the OS hands out (bind to 0) it may
    hand out again, to another test's connection, before the job binds it (seen once: accelerate launch refused
    "another process is utilizing it"). Drawn from the OS's randomness: in-process tests seed ``random``."""
    draw = random.SystemRandom()
    while True:
        port = draw.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a test's job. GPUs are hidden (CUDA_VISIBLE_DEVICES=""), so each job runs on the CPU,
    over gloo, the same on every host: 2 processes on a 1-GPU host would otherwise be refused, and figures
    compared across runs would mix devices. tests/test_gpu.py runs the GPU paths, and pretend_gpus() the host
    checks."""
    # Not PYTHONUNBUFFERED: its print() writes a line in two (tests/support/startup/sitecustomize.py).
    skip = {*LAUNCHER_VARS, "PYTHONUNBUFFERED"}
    env = {k: v for k, v in os.environ.items() if k not in skip and not k.startswith("ACCELERATE_")}
    env.update(
        OMP_NUM_THREADS="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        CUDA_VISIBLE_DEVICES="",
    )
    env.update(extra)
    # tests/support/startup/sitecustomize.py: a process exits without walking its objects once more (and pretends
    # GPUs where pretend_gpus() asks).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STARTUP), env.get("PYTHONPATH")]))
    return env


def pretend_gpus(count: int, **extra: str) -> dict[str, str]:
    """clean_env() on a pretend host with ``count`` GPUs (tests/support/startup/fake_gpu.py): torch.cuda says they
    exist, and any real CUDA work fails, so a job that should stay on the CPU but reaches for the GPU fails loudly."""
    env = clean_env(FAKE_GPUS=str(count), **extra)
    env.pop("CUDA_VISIBLE_DEVICES")
    return env


def run(cmd: list[str], expect_ok: bool | None = True, timeout: int = 300, env: dict | None = None, cwd: Path = ROOT):
    """Run a command; fail the test with its output if its exit status is not what was expected (``expect_ok``:
    0, not 0, or None: either).

    The command gets its own process group, killed whole on a timeout: a launcher's workers must not outlive it.
    """
    process = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))}\ntimed out after {timeout} s\n{stdout}\n{stderr}")
    result = subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)
    if expect_ok is not None and expect_ok != (result.returncode == 0):
        pytest.fail(f"{' '.join(map(str, cmd))}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def run_together(
    commands: list[tuple[list, Path]], expect_ok: bool = True, timeout: int = 300, env: dict | None = None
) -> list[subprocess.CompletedProcess]:
    """Start every ``(command, cwd)`` at once, as the nodes of one job, and wait for all of them.

    Output goes to files, not pipes: a node blocked on a full pipe would hold up the others at a collective.
    """
    started = []
    for cmd, cwd in commands:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        cmd = [str(c) for c in cmd]
        process = subprocess.Popen(
            cmd, cwd=cwd, env=env or clean_env(), stdout=out, stderr=err, text=True, start_new_session=True
        )
        started.append((process, out, err))
    deadline, results = time.monotonic() + timeout, []
    for process, out, err in started:
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _, _ in started:
                os.killpg(other.pid, signal.SIGKILL)
            process.wait()
        out.seek(0), err.seek(0)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read()))
    for result in results:
        if expect_ok != (result.returncode == 0):
            pytest.fail(f"{' '.join(result.args)}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}")
    return results


def accelerate_node(machine_rank: int, port: int, *script_and_args, machines: int = 2) -> list:
    """One node's ``accelerate launch`` of multi_node.yaml, one process per node, node 0 on this host."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        CONFIGS / "multi_node.yaml",
        "--num_machines",
        machines,
        "--num_processes",
        machines,
        "--machine_rank",
        machine_rank,
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        port,
        *script_and_args,
    ]


def python(script: Path, *args: str, **kw):
    return run([sys.executable, str(script), *map(str, args)], **kw)


def launch_command(
    script: Path,
    *args: str,
    config: str = "multi_gpu.yaml",
    run_args: tuple[str, ...] | list[str] = (),
    launcher: str = "accelerate.commands.launch",
) -> list[str]:
    """``accelerate launch --config_file accelerate_configs/<config> [run_args] script args``, as a command
    (``launcher``: another module taking accelerate launch's arguments, ``trainer.launch``)."""
    cmd = [
        sys.executable,
        "-m",
        launcher,
        "--config_file",
        str(CONFIGS / config),
        "--main_process_port",
        str(free_port()),
        *run_args,
    ]
    return [*cmd, str(script), *map(str, args)]


def accelerate_launch(
    script: Path,
    *args: str,
    config: str = "multi_gpu.yaml",
    num_processes: int | None = None,
    run_args: tuple[str, ...] | list[str] = (),
    **kw,
):
    """``accelerate launch --config_file accelerate_configs/<config> [run_args] script args``, run."""
    if num_processes is not None:
        run_args = [*run_args, "--num_processes", str(num_processes)]
    return run(launch_command(script, *args, config=config, run_args=run_args), **kw)


def torchrun(script: Path, *args: str, nproc: int = 2, run_args: tuple[str, ...] | list[str] = (), **kw):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        *run_args,
    ]
    return run([*cmd, str(script), *map(str, args)], **kw)


def split_jobs(output: str) -> list[str]:
    """The output of each run of a tests/jobs/run_many.py process or launch, in order, cut at its ``=== job N ===``
    lines (every process of a launch writes them: what follows each process's line N is run N's)."""
    parts = re.split(
        r"^=== job (\d+) ===\n", re.sub(r"^=== job \d+ exit \d+ ===\n", "", output, flags=re.M), flags=re.M
    )
    runs: dict[int, str] = {}
    for number, text in zip(parts[1::2], parts[2::2], strict=True):
        runs[int(number)] = runs.get(int(number), "") + text
    return [runs[number] for number in sorted(runs)]


def job_exits(stderr: str, runs: int) -> list[int | None]:
    """Each run's exit status in a tests/jobs/run_many.py process or launch, from its ``=== job N exit K ===`` lines
    (the largest of the processes'); None for a run no process saw end (the process ended inside it, or before it)."""
    exits: list[int | None] = [None] * runs
    for number, status in re.findall(r"^=== job (\d+) exit (\d+) ===$", stderr, flags=re.M):
        exits[int(number)] = max(exits[int(number)] or 0, int(status))
    return exits


def once_per_suite(tmp_path_factory, name: str, make) -> Path:
    """The folder ``make(folder)`` filled, made once for the whole suite: the first worker of ``-n 2`` (or the
    one process) to ask makes it, the other waits and reads it (a reference run several modules compare with)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' folders share this run's parent, and only theirs
        root = root.parent
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            make(folder)
            done.touch()
    return folder


def launch_jobs(runs: dict[str, list], *, one_process: bool = False, **kw) -> dict[str, subprocess.CompletedProcess]:
    """Every run of ``runs`` (name: [script, arg, ...]) in one ``accelerate launch`` of tests/jobs/run_many.py (``kw``:
    accelerate_launch's), or in one plain python process: each run's exit status, stdout and stderr, by name, as if
    run alone."""
    jobs = json.dumps([[str(part) for part in args] for args in runs.values()])
    result = (
        python(JOBS, jobs, expect_ok=None, **kw) if one_process else accelerate_launch(JOBS, jobs, expect_ok=None, **kw)
    )
    outs, errs = split_jobs(result.stdout), split_jobs(result.stderr)
    if len(outs) != len(runs) or len(errs) != len(runs):  # the launch itself failed: every run's words, as they came
        pytest.fail(f"{len(runs)} runs, {len(outs)} begun; exit {result.returncode}\n{result.stdout}\n{result.stderr}")
    # A run that never said its end ended the process (os._exit, a signal): the process's status is its own.
    exits = [(result.returncode or -1) if code is None else code for code in job_exits(result.stderr, len(runs))]
    ended = zip(runs.items(), exits, outs, errs, strict=True)
    return {name: subprocess.CompletedProcess(args, code, out, err) for (name, args), code, out, err in ended}


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "same_updates.json").read_text())


# ------------------------------------------------------------- `accelerate config`, interactive, through a pty

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def accelerate_config(path, answers: dict[str, str], expect_ok: bool = True) -> list[tuple[str, str]]:
    """Answer ``accelerate config`` as a person at a terminal would: ``answers`` by a part of the question (a menu
    entry's label for menus), Enter (the default) for the rest. Returns the questions asked and the answers; with
    ``expect_ok=False``, also accelerate's last words when it stopped without writing the file."""
    pexpect = pytest.importorskip("pexpect")
    command = ["-m", "accelerate.commands.accelerate_cli", "config", "--config_file", str(path)]
    child = pexpect.spawn(sys.executable, command, env=clean_env(), encoding="utf-8", timeout=60, dimensions=(50, 200))
    menu = r"arrow or number keys.*?\n((?:.*\n)*?.*)\x1b\[\d+A"  # the options, then the cursor moves back up
    question = r"([^\n]*)((\[[^\]\n]*\]|\? ?|\)): ?|main process\? )$"  # (two about the main process end "? ")
    asked, title = [], ""
    while child.expect([menu, question, pexpect.EOF]) != 2:
        if child.match.re.pattern == menu:
            lines = [line for line in ANSI.sub("", child.before).splitlines() if line.strip()]
            text = ([ANSI.sub("", title)] + [line for line in lines if "Please select a choice" not in line])[-1]
            title = ""
            shown = [ANSI.sub("", line) for line in child.match.group(1).splitlines() if ANSI.sub("", line).strip()]
            options = [line.replace("➔", "").strip() for line in shown]
            at = next(i for i, line in enumerate(shown) if "➔" in line)  # the menu opens at its default
            wanted = next((v for k, v in answers.items() if k in text), options[at])
            asked.append((text.strip("- "), wanted))
            moves = options.index(wanted) - at
            reading_keys(child)
            child.send(("\x1b[B" * moves if moves > 0 else "\x1b[A" * -moves) + "\r")  # arrows, then Enter
        else:
            prompt = child.match.group(0)
            # A menu's title may read as a prompt ("What should be your FSDP version? [2]: ") where the terminal
            # hands it over before the rest of its line (seen under load); a prompt is followed by nothing until
            # answered, so a line's end at once makes it the title of the menu that follows.
            if child.expect([r"\A ?\r?\n", pexpect.TIMEOUT], timeout=0.05) == 0:
                title = prompt
                continue
            text = ANSI.sub("", prompt).strip()
            reply = next((v for k, v in answers.items() if k in text), "")
            asked.append((text, reply))
            child.send(reply + "\r")
    last_words = ANSI.sub("", child.before or "").strip().splitlines()[-1:]
    child.close()
    assert (child.exitstatus == 0) == expect_ok, (asked, last_words)
    return asked if expect_ok else asked + [("stopped", last_words[0] if last_words else "")]


def reading_keys(child, timeout: float = 60) -> None:
    """Wait until the menu reads keys (its terminal in raw mode): accelerate's menu enters raw mode with
    ``tty.setraw``, which throws away what was typed before it, so keys sent as soon as the menu is drawn can be lost
    and the menu waits for ever (seen where the menu's first key read imported ``tty`` slowly)."""
    import termios

    deadline = time.monotonic() + timeout
    while termios.tcgetattr(child.child_fd)[3] & termios.ICANON:
        if time.monotonic() > deadline:
            pytest.fail(f"accelerate config drew a menu but did not read keys within {timeout} s")
        time.sleep(0.005)


def resign(folder: Path) -> None:
    """Checkpoint ``folder``'s manifest rewritten to match its files as they are now (their sizes and CRC-32), so
    that a crafted file looks like what was written and only the trainer's own checks can refuse it."""
    import zlib

    state = json.loads((folder / "trainer_state.json").read_text())
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "trainer_state.json"]
    state["files"] = {p.relative_to(folder).as_posix(): p.stat().st_size for p in files}
    state["crc32"] = {p.relative_to(folder).as_posix(): f"{zlib.crc32(p.read_bytes()):08x}" for p in files}
    (folder / "trainer_state.json").write_text(json.dumps(state))
