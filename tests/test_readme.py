"""README.md and docs/ stay true: the generated tables match the code, CI runs README's commands, README's usage
example runs as written, and README stays a front door."""
import os
import pathlib
import re
import subprocess
import sys

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README = ROOT / "README.md"
OWN_DOCS = ["README.md", "docs/reference.md", "docs/architecture.md", "docs/testing.md"]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)\n```", text, re.S)]


def test_generated_sections_match_the_code():
    # the capability matrix, error codes, environment variables, tolerances (docs/reference.md) and the runner table
    # (README.md) are regenerated and compared
    proc = subprocess.run([sys.executable, "scripts/update_readme.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"stale generated sections: run python scripts/update_readme.py\n{proc.stderr}"


def test_ci_runs_readme_commands():
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = _bash_blocks(readme)
    install, test = blocks[0], blocks[1]
    assert test == "python -m pytest -q -n auto --dist loadgroup"  # pytest-xdist: one worker a core
    assert test in ci.splitlines()
    *steps, main_job = install.split(" && ")
    for step in steps:  # the install steps
        assert step.replace("pip install", "python3 -m pip install -q") in ci, step
    assert " ".join(main_job.split()[:2]) in ci, main_job  # the main job (`moeflow bench`) runs in CI too


def test_readme_documents_the_quick_tier():
    assert 'python -m pytest -q -n auto --dist loadgroup -m "not slow"' in _bash_blocks(README.read_text())
    markers = (ROOT / "pyproject.toml").read_text()
    assert '"slow:' in markers and '"gpu:' in markers  # the markers the tiers select on are declared


def _usage_example() -> str:
    text = README.read_text()
    heading = re.search(r"^## Usage\s*$", text, re.M)
    assert heading, "README.md has no '## Usage' section"
    block = re.search(r"```python\n(.*?)\n```", text[heading.end():], re.S)
    assert block, "no ```python block after README's '## Usage'"
    return block.group(1)


def test_readme_usage_example_runs_on_a_cpu(tmp_path):
    """The first Python block under '## Usage' runs as written, in a fresh interpreter (every name it uses is
    defined in it), on a machine without a GPU."""
    code = _usage_example()
    assert len(code.splitlines()) <= 5, code
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "torch.Size([4, 256])" in proc.stdout, proc.stdout


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"


def test_docs_links_stay_in_the_repository():
    """Relative links of README and the docs it owns point at files of this repository (no sibling folders)."""
    for doc in OWN_DOCS:
        path = ROOT / doc
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file = (path.parent / target.split("#")[0]).resolve()
            assert file.is_relative_to(ROOT) and file.exists(), f"{doc} links to {target}"
