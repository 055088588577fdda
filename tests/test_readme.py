"""README.md stays true: its generated sections match the code, and CI runs its commands."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_sections_match_the_code():
    # the capability matrix and the error-code table are regenerated and compared
    proc = subprocess.run([sys.executable, "scripts/update_readme.py", "--check"], cwd=ROOT)
    assert proc.returncode == 0, "README.md is stale: run python scripts/update_readme.py"


def test_ci_runs_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    install, test = blocks[0].strip(), blocks[1].strip()
    assert test == "python -m pytest -q"
    assert test in ci.splitlines()
    for step in install.split(" && ")[:-1]:  # the install steps (the last one runs the main job)
        assert step.replace("pip install", "python3 -m pip install -q") in ci, step
