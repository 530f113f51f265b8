"""Issue 11, items 1-7: hostile input never crashes or hangs `check`; each bad file or path is a clear
per-file error (exit 1, or 2 for usage and configuration), and every other file is still checked."""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gpudoctor.check import engine
from gpudoctor.check.config import Config
from gpudoctor.check.engine import MAX_FILE_BYTES, check_paths

from hostile_support import BACKWARD, cli, write

# Each of these crashed (SIGSEGV) or stalled libcst's native parser; CPython refuses or bounds them.
DEEP = {
    "parens.py": "x = " + "(" * 1500 + "1" + ")" * 1500 + "\n",
    "lists.py": "x = " + "[" * 2000 + "]" * 2000 + "\n",
    "calls.py": "x = f" + "()" * 10_000 + "\n",
    "sum.py": "x = " + "+".join(["1"] * 10_000) + "\n",
    "sum100k.py": "x = " + "+".join(["1"] * 100_000) + "\n",
    "bools.py": "x = " + " and ".join(["a"] * 10_000) + "\n",  # flat for CPython, a chain for libcst
    "attrs.py": "x = a" + ".b" * 5_000 + "\n",
}


def deep_project(tmp_path: Path, extra_good: int = 0) -> Path:
    for name, body in DEEP.items():
        write(tmp_path, name, "import torch\n" + body)
    write(tmp_path, "good.py", BACKWARD)
    for i in range(extra_good):
        write(tmp_path, f"other{i}.py", "import torch\nprint(torch.ones(1))\n")
    return tmp_path


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_deep_nesting_is_a_per_file_error_and_the_rest_is_checked(tmp_path, jobs):
    deep_project(tmp_path, extra_good=10)  # enough files for -j2 to use processes
    done = cli(tmp_path, "check", ".", "-j", jobs, "--no-cache", "--output-format", "json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert [(Path(f["path"]).name, f["code"]) for f in report["findings"]] == [("good.py", "GD104")]
    named = sorted(Path(e.split(":")[0]).name for e in report["errors"])
    assert named == sorted(DEEP)
    assert all("nested" in e or "syntax error" in e for e in report["errors"]), report["errors"]


def test_a_file_that_kills_the_parser_is_named_and_the_rest_is_checked(tmp_path):
    """A file CPython cannot parse (newer syntax here) is parsed by libcst only in a process that may
    die. Python 3.12+ parses `type X = int`; then the nesting bound refuses the file instead."""
    write(tmp_path, "killer.py", "import torch\ntype X = int\nx = " + " and ".join(["a"] * 20_000) + "\n")
    write(tmp_path, "good.py", BACKWARD)
    for i in range(10):
        write(tmp_path, f"other{i}.py", "import torch\nprint(torch.ones(1))\n")
    for jobs in ("1", "2"):
        done = cli(tmp_path, "check", ".", "-j", jobs, "--no-cache", "--output-format", "json")
        assert done.returncode == 1, done.stderr
        report = json.loads(done.stdout)
        assert [Path(f["path"]).name for f in report["findings"]] == ["good.py"]
        [error] = report["errors"]
        assert error.startswith("killer.py") or error.startswith(str(tmp_path / "killer.py")) or "killer.py" in error


def test_nesting_bound_is_measured_like_libcst():
    tree = compile("x = a and b and c and d\n", "t", "exec", engine._AST_FLAGS)
    flat = compile("x = [a, b, c, d]\n", "t", "exec", engine._AST_FLAGS)
    assert engine.nesting(tree) == engine.nesting(flat) + 2


def test_code_cpython_rejects_is_parsed_here_only_when_shallow():
    assert engine.shallow("import torch\nprint 'py2'\n")
    assert not engine.shallow("x = (" + "1 +\n" * 3000 + "1)\n")
    assert not engine.shallow("x = " + "[" * 150 + "]" * 150 + "\n")


def test_oversized_file_is_skipped_with_an_error(tmp_path):
    big = write(tmp_path, "big.py", "import torch\n" + "#" * (MAX_FILE_BYTES + 1) + "\n")
    write(tmp_path, "good.py", BACKWARD)
    result = check_paths([str(tmp_path)], Config(root=tmp_path))
    assert [Path(f.path).name for f in result.findings] == ["good.py"]
    assert result.errors == [f"{big}: " + engine.too_big(big.stat().st_size, MAX_FILE_BYTES)]
    assert "MiB limit" in result.errors[0]


# --------------------------------------------------------------------------------------- item 2


def test_unreadable_folder_on_the_command_line_is_an_error(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    write(locked, "t.py", BACKWARD)
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    result = check_paths([str(locked)], Config(root=tmp_path))
    assert result.errors == [f"{locked}: cannot read folder: Permission denied"]


def test_unreadable_subfolder_and_venv_probe(tmp_path, monkeypatch):
    write(tmp_path, "sub/t.py", BACKWARD)
    write(tmp_path, "good.py", BACKWARD)
    real_exists = Path.exists

    def exists(self, *args, **kwargs):
        if self.name == "pyvenv.cfg":
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", exists)
    result = check_paths([str(tmp_path)], Config(root=tmp_path))
    assert sorted(Path(f.path).name for f in result.findings) == ["good.py", "t.py"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any folder")
def test_unreadable_folder_for_real(tmp_path):
    write(tmp_path, "locked/t.py", BACKWARD)
    write(tmp_path, "good.py", BACKWARD)
    (tmp_path / "locked").chmod(0)
    try:
        done = cli(tmp_path, "check", ".", "--no-cache")
        assert done.returncode == 1 and "cannot read folder" in done.stdout
        done = cli(tmp_path, "check", "locked", "--no-cache")
        assert done.returncode == 1 and "All checks passed" not in done.stdout
    finally:
        (tmp_path / "locked").chmod(0o755)


# --------------------------------------------------------------------------------------- item 3

BAD_CONFIGS = {
    'per-file-ignores = ["GD104"]': ("per-file-ignores", "array"),
    'per-file-ignores = "GD104"': ("per-file-ignores", "string"),
    'target-versions = "torch=2.4"': ("target-versions", "string"),
    "extend-select = 5": ("extend-select", "integer"),
    'extend-select = "GD104"': ("extend-select", "string"),
    'preview = "false"': ("preview", "string"),
    'force-exclude = "no"': ("force-exclude", "string"),
    'select = ["GD1", 2]': ("select", "array"),
    'per-file-ignores = {"a.py" = "GD104"}': ("per-file-ignores", "table"),
}


@pytest.mark.parametrize("line", list(BAD_CONFIGS))
def test_config_of_the_wrong_type_is_exit_2_with_key_expected_and_got(tmp_path, monkeypatch, capsys, line):
    from gpudoctor.cli import main

    (tmp_path / "pyproject.toml").write_text(f"[tool.gpudoctor]\n{line}\n")
    write(tmp_path, "t.py", BACKWARD)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "t.py", "--no-cache"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    key, got = BAD_CONFIGS[line]
    assert f"{key} must be" in err and f"got {got}" in err, err


@pytest.mark.parametrize("content", [b"[tool]\ngpudoctor = 1\n", b"[tool.gpudoctor]\nselect = ['GD\xff']\n", b"tool = 3 # gpudoctor\n"])
def test_unreadable_or_misshapen_tool_table_is_exit_2(tmp_path, monkeypatch, capsys, content):
    from gpudoctor.cli import main

    (tmp_path / "pyproject.toml").write_bytes(content)
    write(tmp_path, "t.py", BACKWARD)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "t.py", "--no-cache"]) == 2
    assert "pyproject.toml" in capsys.readouterr().err


def test_a_pyproject_without_our_table_is_not_read(tmp_path, monkeypatch):
    from gpudoctor.cli import main

    (tmp_path / "pyproject.toml").write_bytes(b"[project\nname = \xff")  # broken, but not ours
    write(tmp_path, "t.py", BACKWARD)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "t.py", "--no-cache", "-q"]) == 1


# --------------------------------------------------------------------------------------- item 4

WRONG_SHAPES = ["a string", 5, None, [], {"digest": "D", "findings": "x"}, {"digest": "D", "findings": [5]},
                {"digest": "D", "findings": [{"code": "GD1"}]}, {"digest": "D", "findings": [], "error": 3}]


@pytest.mark.parametrize("entry", WRONG_SHAPES, ids=[repr(e)[:30] for e in WRONG_SHAPES])
def test_cache_entry_of_the_wrong_shape_is_a_miss(tmp_path, entry):
    from gpudoctor.check import cache

    path = write(tmp_path, "t.py", BACKWARD)
    config = Config(root=tmp_path)
    expected = [f.code for f in check_paths([str(path)], config).findings]
    store = cache.Cache.for_run(config)
    if isinstance(entry, dict):
        entry = dict(entry, digest=cache.digest(path.read_bytes()))
    store.file.parent.mkdir(parents=True, exist_ok=True)
    store.file.write_text(json.dumps({"format": cache.FORMAT, "entries": {cache.Cache.key(path): entry}}))
    for _ in range(2):
        assert [f.code for f in check_paths([str(path)], config, use_cache=True).findings] == expected == ["GD104"]


# --------------------------------------------------------------------------------------- item 5


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifos_devices_and_links_to_them_are_never_read(tmp_path):
    os.mkfifo(tmp_path / "pipe.py")
    if Path("/dev/zero").exists():
        (tmp_path / "zero.py").symlink_to("/dev/zero")
    (tmp_path / "dangling.py").symlink_to(tmp_path / "nowhere.py")
    write(tmp_path, "good.py", BACKWARD)
    done = cli(tmp_path, "check", ".", "--no-cache", "-q", timeout=60)
    assert done.returncode == 1 and "good.py" in done.stdout and "Traceback" not in done.stderr
    done = cli(tmp_path, "check", "pipe.py", "--no-cache", timeout=60)
    assert done.returncode == 1 and "pipe.py: not a regular file" in done.stdout
    if (tmp_path / "zero.py").is_symlink():
        done = cli(tmp_path, "check", "zero.py", "--no-cache", timeout=60)
        assert done.returncode == 1 and "zero.py: not a regular file" in done.stdout


def test_a_file_growing_past_the_limit_while_read_is_cut_off(tmp_path):
    path = write(tmp_path, "t.py", "import torch\n" + "#" * 100)
    with pytest.raises(engine.FileProblem, match="limit"):
        engine.read_source(path, limit=50)


# --------------------------------------------------------------------------------------- item 6


def test_output_file_problems_are_found_before_the_run(tmp_path, monkeypatch, capsys):
    from gpudoctor.cli import main

    write(tmp_path, "t.py", BACKWARD)
    monkeypatch.chdir(tmp_path)
    ran = []
    monkeypatch.setattr(engine, "discover", lambda *a: ran.append(a) or ([], []))
    assert main(["check", "t.py", "-o", "missing/out.json", "--output-format", "json"]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    (tmp_path / "folder").mkdir()
    assert main(["check", "t.py", "-o", "folder"]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["check", "t.py", "-j", "-3"]) == 2
    assert not ran


def test_jobs_are_capped_at_files_and_cores(tmp_path, monkeypatch):
    import concurrent.futures

    for i in range(12):
        write(tmp_path, f"t{i}.py", BACKWARD)
    sizes = []
    real = concurrent.futures.ProcessPoolExecutor

    class Recording(real):
        def __init__(self, max_workers=None, *args, **kwargs):
            sizes.append(max_workers)
            super().__init__(max_workers, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Recording)
    result = check_paths([str(tmp_path)], Config(root=tmp_path), jobs=99_999)
    assert len(result.findings) == 12
    assert all(size <= min(12, os.cpu_count() or 1) for size in sizes)


# --------------------------------------------------------------------------------------- item 7


@pytest.mark.skipif(sys.platform in ("win32", "darwin"), reason="needs a file system that stores any bytes")
def test_file_names_that_are_not_utf8(tmp_path):
    name = b"caf\xe9 \x01.py"
    try:
        (tmp_path / os.fsdecode(name)).write_text(BACKWARD)
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system refuses the name")
    done = cli(tmp_path, "check", ".", "--no-cache", "--output-format", "sarif")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    log = json.loads(done.stdout)
    [result] = log["runs"][0]["results"]
    assert result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "caf%E9%20%01.py"
    done = cli(tmp_path, "check", ".", "--no-cache", "--output-format", "junit")
    case = ET.fromstring(done.stdout).find("testsuite/testcase")
    assert case is not None and case.find("failure") is not None
    for fmt in ("text", "json", "github"):
        done = cli(tmp_path, "check", ".", "--no-cache", "--output-format", fmt)
        assert done.returncode == 1 and "Traceback" not in done.stderr, (fmt, done.stderr)


def test_a_notebook_is_held_to_the_limit_by_its_code_not_its_outputs(tmp_path):
    cell = {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": BACKWARD,
            "outputs": [{"output_type": "display_data", "metadata": {}, "data": {"image/png": "A" * (MAX_FILE_BYTES + 10)}}]}
    nb = {"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    write(tmp_path, "plots.ipynb", json.dumps(nb))
    big = dict(cell, source="import torch\n" + "#" * MAX_FILE_BYTES + "\n", outputs=[])
    write(tmp_path, "huge.ipynb", json.dumps(dict(nb, cells=[big])))
    result = check_paths([str(tmp_path)], Config(root=tmp_path))
    assert [(Path(f.path).name, f.code) for f in result.findings] == [("plots.ipynb", "GD104")]
    [error] = result.errors
    assert "huge.ipynb: its code cells: skipped" in error
