"""End to end with the real ``pre-commit``: the hooks in .pre-commit-hooks.yaml install gpudoctor from
this working tree into pre-commit's own virtualenv (pip: needs PyPI for hatchling, libcst, rich) and
run on a scratch git repository.

``pre-commit try-repo <path>`` only carries *tracked* changes of a local repository into its shadow
commit, so the test commits a copy of the working tree (what ``git ls-files`` lists plus untracked,
not ignored files) into a temporary hook repository: it tests exactly the code being edited.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

PRE_COMMIT = shutil.which("pre-commit")
BAD = """\
import torch
from accelerate import Accelerator

accelerator = Accelerator(mixed_precision="fp16")
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for batch in loader:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""
GOOD = BAD.replace("    loss.backward()\n", "    accelerator.backward(loss)\n")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null", *args],
        cwd=cwd, check=True, capture_output=True, text=True, env=ENV,
    ).stdout


ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_NOSYSTEM": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}


def working_tree_files() -> list[str]:
    if (ROOT / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout
        return [p for p in out.split("\0") if p and (ROOT / p).is_file()]
    skip = {".git", "__pycache__", ".gpudoctor_cache", ".pytest_cache", ".venv", "build", "dist"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


@pytest.fixture(scope="module")
def hook_repo(tmp_path_factory) -> Path:
    if PRE_COMMIT is None:
        pytest.skip("the `pre-commit` tool is not installed (pip install pre-commit)")
    repo = tmp_path_factory.mktemp("hook-repo")
    for name in working_tree_files():
        if name.startswith(("tests/", "benchmarks/")):
            continue
        target = repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    assert (repo / ".pre-commit-hooks.yaml").is_file()
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "hook repo")
    return repo


@pytest.fixture(scope="module")
def pre_commit_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pre-commit-home")


def project(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "project")
    return tmp_path


def try_repo(hook_repo: Path, home: Path, cwd: Path, hook: str) -> subprocess.CompletedProcess:
    env = {**ENV, "PRE_COMMIT_HOME": str(home), "PRE_COMMIT_COLOR": "never", "NO_COLOR": "1"}
    return subprocess.run(
        [PRE_COMMIT, "try-repo", str(hook_repo), hook, "--all-files", "--verbose"],
        cwd=cwd, capture_output=True, text=True, env=env, timeout=900,
    )


def test_check_hook_fails_on_a_finding(hook_repo, pre_commit_home, tmp_path) -> None:
    repo = project(tmp_path, {"train.py": BAD, "clean.py": GOOD})
    result = try_repo(hook_repo, pre_commit_home, repo, "gpudoctor-check")
    output = result.stdout + result.stderr
    if result.returncode != 0 and "GD104" not in output and ("pip" in output or "CalledProcessError" in output):
        pytest.fail(f"pre-commit could not install the hook environment:\n{output[-4000:]}")
    assert result.returncode == 1, output
    assert "train.py:8:5: GD104" in output
    assert "clean.py:" not in output


def test_fix_hook_rewrites(hook_repo, pre_commit_home, tmp_path) -> None:
    repo = project(tmp_path, {"train.py": BAD})
    result = try_repo(hook_repo, pre_commit_home, repo, "gpudoctor-fix")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # pre-commit fails a hook that modified files
    assert (repo / "train.py").read_text() == GOOD
    assert "Fixed 1 finding" in output
    again = try_repo(hook_repo, pre_commit_home, repo, "gpudoctor-fix")
    assert again.returncode == 0, again.stdout + again.stderr


def test_no_relevant_files_pass(hook_repo, pre_commit_home, tmp_path) -> None:
    repo = project(tmp_path, {"util.py": "print('no torch here')\n", "notes.txt": "import torch\n"})
    result = try_repo(hook_repo, pre_commit_home, repo, "gpudoctor-check")
    assert result.returncode == 0, result.stdout + result.stderr
