"""Fuzzing ``gpudoctor check`` (issue 11's bar): generated projects of deep nesting, huge expressions,
random bytes, random notebooks and random configurations, checked by the CLI in a child process.

Each run must: print no traceback; exit 0/1 (findings or files that could not be checked) or 2 (only
for a configuration it rejects, saying which file); write nothing outside its cache; and still check
the one ordinary file that has a known finding. A few examples by default; the slow test runs more."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent / "hostile"))
from hostile_support import BACKWARD, cli  # noqa: E402

LIBS = ["import torch\n", "from accelerate import Accelerator\n", "import os, transformers\n", ""]


@st.composite
def deep_code(draw) -> str:
    depth = draw(st.integers(min_value=1, max_value=6000))
    shape = draw(st.sampled_from(["(", "[", "{", "f()", "+", "and", ".a", "-", "not", "if", "lambda", "[0]"]))
    if shape in "([{":
        close = {"(": ")", "[": "]", "{": "}"}[shape]
        body = shape * depth + close * depth
    elif shape == "f()":
        body = "f" + "()" * depth
    elif shape in ("+", "and"):
        body = f" {shape} ".join(["x"] * depth)
    elif shape == ".a":
        body = "x" + ".a" * depth
    elif shape == "[0]":
        body = "x" + "[0]" * depth
    elif shape == "if":
        body = "1 if x else " * depth + "1"
    elif shape == "lambda":
        body = "lambda: " * depth + "1"
    else:
        body = f"{shape} " * depth + "1"
    return f"y = {body}\n"


@st.composite
def python_file(draw) -> bytes:
    head = draw(st.sampled_from(LIBS))
    kind = draw(st.sampled_from(["deep", "bytes", "text", "newlines", "blocks"]))
    if kind == "deep":
        body = draw(deep_code()).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=400))
    elif kind == "text":
        body = draw(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300)).encode("utf-8")
    elif kind == "newlines":
        body = draw(st.sampled_from([b"x = 1\r", b"\r\r\n", b"# noqa\rloss.backward()\r", b"\x00", b"\xef\xbb\xbf"])) * draw(st.integers(1, 50))
    else:
        depth = draw(st.integers(1, 150))
        body = "".join(" " * i + "if x:\n" for i in range(depth)).encode() + b" " * depth + b"pass\n"
    return head.encode() + body


@st.composite
def notebook_file(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    cells = []
    for _ in range(draw(st.integers(0, 4))):
        source = draw(st.one_of(
            st.text(max_size=120),
            st.lists(st.sampled_from(["%pip install torch\n", "!ls\n", "import torch\n", "%%bash\n", "x = !ls\n",
                                      "loss.backward()\n", "obj?\n", "(((\n", "\n"]), max_size=6),
            st.integers(), st.none(),
        ))
        cell_type = draw(st.sampled_from(["code", "markdown", "raw", 3]))
        cells.append({"cell_type": cell_type, "metadata": {}, "source": source, "outputs": []})
    notebook = draw(st.sampled_from([
        {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5},
        {"cells": cells}, {"worksheets": []}, [cells], {"cells": "x"},
    ]))
    return json.dumps(notebook).encode()


@st.composite
def pyproject(draw) -> bytes | None:
    if draw(st.booleans()):
        return None
    key = draw(st.sampled_from(["select", "ignore", "extend-select", "per-file-ignores", "exclude", "preview",
                                "target-versions", "force-exclude", "unknown-key"]))
    value = draw(st.sampled_from(['"GD104"', "5", "true", '"false"', '["GD2"]', "[1, 2]", '{"a.py" = ["GD2"]}',
                                  '{torch = "2.4"}', '{torch = 2}', "[]"]))
    table = draw(st.sampled_from([f"[tool.gpudoctor]\n{key} = {value}\n", f"[tool]\ngpudoctor = {value}\n",
                                  "[tool.gpudoctor\n", "[tool.gpudoctor]\nselect = ['GD\xff']\n"]))
    return table.encode("utf-8", "surrogateescape")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and ".gpudoctor_cache" not in p.relative_to(folder).parts
    }


def check_project(files: list[bytes], notebooks: list[bytes], config: bytes | None, jobs: str) -> None:
    with tempfile.TemporaryDirectory() as name:
        root = Path(name)
        (root / "witness.py").write_text(BACKWARD)
        for i, data in enumerate(files):
            (root / f"gen{i}.py").write_bytes(data)
        for i, data in enumerate(notebooks):
            (root / f"nb{i}.ipynb").write_bytes(data)
        if config is not None:
            (root / "pyproject.toml").write_bytes(config)
        before = snapshot(root)
        done = cli(root, "check", ".", "-j", jobs, "--output-format", "json", "--select", "GD104", timeout=600)
        assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr
        assert snapshot(root) == before  # nothing written but the cache
        assert done.returncode in (0, 1, 2), (done.returncode, done.stderr)
        if done.returncode == 2:
            assert config is not None and "pyproject.toml" in done.stderr, done.stderr
            return
        report = json.loads(done.stdout)
        assert ("witness.py", "GD104") in {(f["path"], f["code"]) for f in report["findings"]}, report
        assert all("internal error" not in e for e in report["errors"]), report["errors"]
        assert done.returncode == 1


PROJECTS = dict(
    files=st.lists(python_file(), min_size=1, max_size=5),
    notebooks=st.lists(notebook_file(), max_size=2),
    config=pyproject(),
    jobs=st.sampled_from(["1", "2"]),
)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=4, **SETTINGS)
@given(**PROJECTS)
def test_fuzz_check_cli(files, notebooks, config, jobs):
    check_project(files, notebooks, config, jobs)


@pytest.mark.slow
@settings(max_examples=40, **SETTINGS)
@given(**PROJECTS)
def test_fuzz_check_cli_longer(files, notebooks, config, jobs):
    check_project(files, notebooks, config, jobs)
