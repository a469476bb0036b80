"""The start-up every process a test starts runs first (tests/support/startup/sitecustomize.py): the cyclic garbage
collector off while the main module imports, on again (what exists frozen) once the job's own code imports, as it is
in the process of a user; and tests/jobs/run_many.py collecting what a failed run left, frozen or not, before the
next run; whole lines from processes sharing a pipe. Through plain python processes that import nothing heavy."""

from __future__ import annotations

import json
import re

from conftest import JOBS, clean_env, python, split_jobs

# A job's shape: imports, then its code, which imports lazily (the trainer's modules do).
STAGES = """
import gc, json, threading
import email.mime.text  # an import statement of the main module: still starting up
starting = [gc.isenabled(), gc.get_freeze_count()]
def in_a_thread():
    import html.parser  # another thread's import says nothing of the main module
thread = threading.Thread(target=in_a_thread)
thread.start(), thread.join()
threaded = [gc.isenabled(), gc.get_freeze_count()]
def job():
    import xml.dom.minidom  # the job's code imports: it has begun
job()
print(json.dumps([starting, threaded, [gc.isenabled(), gc.get_freeze_count() > 10000]]))
"""


def test_the_collector_is_off_while_the_main_module_imports_and_on_once_its_code_runs(tmp_path):
    script = tmp_path / "stages.py"
    script.write_text(STAGES)
    stages = json.loads(python(script).stdout)
    assert stages == [[False, 0], [False, 0], [True, True]]


# A run that fails holding an object in a reference cycle, made before its code's first lazy import (so frozen):
# the run after it must find it finalized, as it would be had the failed run had a process of its own.
HOLDS = """
import sys
import email.mime.text  # a module not imported yet: this run starts up as a process would
class Held:
    def __init__(self):
        self.me = self  # only the cyclic collector frees it
    def __del__(self):
        open(sys.argv[1], "w").write("released")
held = Held()
def job():
    import xml.dom.minidom
job()
raise SystemExit(3)
"""
LOOKS = "import sys, pathlib; print('found', pathlib.Path(sys.argv[1]).exists())"


def test_a_failed_runs_frozen_cycle_is_collected_before_the_next_run(tmp_path):
    holds, looks, mark = tmp_path / "holds.py", tmp_path / "looks.py", tmp_path / "released"
    holds.write_text(HOLDS)
    looks.write_text(LOOKS)
    result = python(JOBS, json.dumps([[str(holds), str(mark)], [str(looks), str(mark)]]), expect_ok=False)
    assert "=== job 0 exit 3 ===" in result.stderr, result.stderr
    assert split_jobs(result.stdout)[1].strip() == "found True"


# Two processes printing onto one pipe, as the ranks of a launch do.
RANKS = """
import subprocess, sys
code = "import sys\\nfor i in range(2000): print(f'LINE {sys.argv[1]} {i} ' + 'x' * 40)"
children = [subprocess.Popen([sys.executable, "-c", code, str(rank)]) for rank in range(2)]
sys.exit(max(child.wait() for child in children))
"""


def test_processes_sharing_a_pipe_write_whole_lines_even_when_asked_for_unbuffered_output(tmp_path):
    """Unbuffered, print() writes a line's text and its newline apart, and two ranks' lines run together: a test
    reading them misreads both."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    lines = python(script, env=clean_env(PYTHONUNBUFFERED="1")).stdout.splitlines()
    torn = [line for line in lines if not re.fullmatch(r"LINE [01] \d+ x{40}", line)]
    assert len(lines) == 4000 and not torn, torn[:3]
