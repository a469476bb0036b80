"""The documentation site builds without a warning (broken links, missing anchors, API names that no longer exist
fail ``mkdocs build --strict``), and the README stays a short page for users."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_the_documentation_site_builds_strictly(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    assert "load_checkpoint" in api and "from_yaml" in api, "the API reference comes from the docstrings"


def test_the_readme_is_short_opens_with_the_two_set_up_commands_and_speaks_to_users():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[:2]
    assert commands == [
        "pip install torch==2.13.0 && pip install -e . && accelerate launch --config_file "
        "accelerate_configs/multi_gpu.yaml examples/gpt2.py",
        'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q -n 2',
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, ".ci/run runs the README's test command"
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert not re.search(r"\bseed 00\d", page.read_text(), re.I), f"{page.name} speaks of internal documents"
