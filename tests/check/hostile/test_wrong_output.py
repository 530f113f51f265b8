"""Issue 11, items 11-15 (and issue 9's exit status, issue 11 item 24's demo half): the right
configuration, the prefilter, suppressions, duplicates, --statistics, imports in notebooks, exit codes."""

from __future__ import annotations

import json
import sys

import libcst as cst
import pytest

from gpudoctor.check import fixes, notebook
from gpudoctor.check.config import Config
from gpudoctor.check.engine import check_paths, check_source, is_relevant
from gpudoctor.cli import main

from hostile_support import BACKWARD, write


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------- item 11


def test_config_comes_from_the_checked_files_project(tmp_path, monkeypatch, capsys):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    write(here, "pyproject.toml", "[tool.gpudoctor]\nselect = ['GD104', 'GD105']\n")
    write(elsewhere, "pyproject.toml", "[tool.gpudoctor]\nignore = ['GD104']\n")
    target = write(elsewhere, "sub/t.py", BACKWARD)
    own = write(here, "t.py", BACKWARD)
    loose = write(tmp_path / "loose", "t.py", BACKWARD)  # no project: the working folder's settings
    monkeypatch.chdir(here)
    assert run(capsys, str(target), "--no-cache")[0] == 0  # elsewhere ignores GD104
    code, out, _ = run(capsys, str(own), str(loose), "--no-cache", "--output-format", "json")
    assert code == 1 and sorted(f["code"] for f in json.loads(out)["findings"]) == ["GD104", "GD104"]
    # The command line still applies on top of every project's file; --config serves every file.
    assert run(capsys, str(own), "--no-cache", "--ignore", "GD104")[0] == 0
    assert run(capsys, str(target), "--no-cache", "--config", str(here / "pyproject.toml"))[0] == 1


def test_per_project_excludes_and_cache(tmp_path, monkeypatch, capsys):
    write(tmp_path, "a/pyproject.toml", "[tool.gpudoctor]\nexclude = ['gen']\n")
    write(tmp_path, "a/gen/t.py", BACKWARD)
    write(tmp_path, "a/t.py", BACKWARD)
    write(tmp_path, "b/gen/t.py", BACKWARD)
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, ".", "--output-format", "json")
    assert [f["path"] for f in json.loads(out)["findings"]] == ["a/t.py", "b/gen/t.py"]
    assert (tmp_path / "a" / ".gpudoctor_cache").is_dir()  # each project keeps its own cache


# --------------------------------------------------------------------------------------- item 12


@pytest.mark.parametrize(
    "head",
    ["import os, torch\n", "import sys, accelerate as acc\n", "import os.path as p, json, transformers\n",
     "import os; import torch\n"],
)
def test_prefilter_sees_imports_in_lists(head):
    assert is_relevant(head.encode())


def test_prefilter_sees_cr_only_files(tmp_path):
    path = write(tmp_path, "t.py", "")
    path.write_bytes(("# a comment first\n" + BACKWARD).replace("\n", "\r").encode())
    assert [f.code for f in check_paths([str(path)], Config(root=tmp_path)).findings] == ["GD104"]


def test_prefilter_still_skips_what_does_not_import_the_libraries():
    assert not is_relevant(b"import os, json\nx = 'import torch'\n")
    assert not is_relevant(b"import torchvision_like_name_only\n" + b"from torchx import y\n")


# --------------------------------------------------------------------------------------- item 13

SUPPRESSION_CASES = {
    "loss.backward()  # noqa": False,
    "loss.backward()  # noqa: GD104": False,
    "loss.backward()  # noqa:GD105,GD104 reason": False,
    "loss.backward()  # gpudoctor: ignore[GD104]": False,
    "loss.backward()  # type: ignore  # noqa: GD104": False,
    "loss.backward(); s = '# noqa'": True,
    'loss.backward(); s = "# gpudoctor: ignore"': True,
    "loss.backward()  # noqa: gd104x": True,
    "loss.backward()  # noqa: GD10": True,
    "loss.backward()  # noqa: GD105": True,
    "loss.backward()  # noqa: not-a-code": True,
}


def test_a_notebook_whose_first_cell_is_only_magics():
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": "%pip install peft\n"},
             {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": "x = 1\n"}]
    source = notebook.build({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
    module = fixes.add_imports(cst.parse_module(source.text), [("transformers", "BitsAndBytesConfig")])
    changed = notebook.split_back(source, module.code)
    assert changed[0].startswith("%pip install peft\nfrom transformers import BitsAndBytesConfig\n")


@pytest.mark.parametrize("line", list(SUPPRESSION_CASES))
def test_noqa_is_read_from_comments_and_codes_match_exactly(line):
    source = BACKWARD.replace("loss.backward()", line)
    reported = [f.code for f in check_source(source)] == ["GD104"]
    assert reported is SUPPRESSION_CASES[line]


# --------------------------------------------------------------------------------------- item 14


def test_a_file_named_twice_is_checked_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "sub/train.py", BACKWARD)
    code, out, _ = run(capsys, "sub/train.py", "./sub/train.py", str(tmp_path / "sub" / "train.py"), "sub", "--no-cache",
                       "--output-format", "json")
    assert len(json.loads(out)["findings"]) == 1
    code, out, _ = run(capsys, "sub/train.py", "./sub//train.py", "--fix", "--no-cache", "--select", "GD104")
    assert "Fixed 1 finding in 1 file" in out and "(0 remaining)" in out and code == 0


def test_statistics_honour_output_file_and_formats(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "train.py", BACKWARD)
    code, out, _ = run(capsys, "train.py", "--statistics", "-o", "stats.txt", "--no-cache")
    assert code == 1 and out == "" and "GD104" in (tmp_path / "stats.txt").read_text()
    code, out, _ = run(capsys, "train.py", "--statistics", "--output-format", "json", "-o", "stats.json", "--no-cache")
    assert json.loads((tmp_path / "stats.json").read_text())[0]["code"] == "GD104"
    for fmt in ("sarif", "junit", "github"):
        code, _, err = run(capsys, "train.py", "--statistics", "--output-format", fmt, "--no-cache")
        assert code == 2 and "--statistics prints text or json" in err


def test_imports_added_by_a_fix_go_below_a_notebooks_pip_magics():
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["# Fine-tune\n"]},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": ["%pip install -q bitsandbytes\n", "!nvidia-smi\n", "import torch\n", "model = load()"]},
    ]
    source = notebook.build({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
    module = fixes.add_imports(cst.parse_module(source.text), [("transformers", "BitsAndBytesConfig")])
    changed = notebook.split_back(source, module.code)
    lines = changed[1].splitlines()
    assert lines[:2] == ["%pip install -q bitsandbytes", "!nvidia-smi"]
    assert "from transformers import BitsAndBytesConfig" in lines[2:]


def test_imports_in_a_plain_file_still_go_after_the_docstring():
    module = fixes.add_imports(cst.parse_module('"""Doc."""\nimport torch\nx = 1\n'), [("transformers", "BitsAndBytesConfig")])
    assert module.code.startswith('"""Doc."""\nimport torch\nfrom transformers import BitsAndBytesConfig\n')


# --------------------------------------------------------------------------------------- item 15


def test_an_unparsable_file_fails_the_run_and_is_counted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "broken.py", "import torch\ndef f(:\n")
    write(tmp_path, "info.py", (
        "from accelerate import Accelerator\nfrom transformers import AutoModelForCausalLM\n\n"
        "model = AutoModelForCausalLM.from_pretrained('m', device_map={'a': 0, 'b': 1})\n"
        "model = Accelerator().prepare(model)\n"
    ))
    code, out, _ = run(capsys, "info.py", "--no-cache")
    assert code == 0  # an info finding alone does not fail
    code, out, _ = run(capsys, ".", "--no-cache")
    assert code == 1 and "1 file could not be checked" in out
    code, out, _ = run(capsys, "broken.py", "--no-cache", "--output-format", "json")
    assert code == 1 and json.loads(out)["errors"]
    assert run(capsys, "broken.py", "--no-cache", "--exit-zero")[0] == 0
    assert run(capsys, "missing.py", "--no-cache")[0] == 2  # a path that does not exist is a usage error


# --------------------------------------------------------------------------------------- item 24 (demo)


def test_demo_without_the_runtime_extra_names_it_and_the_missing_module(monkeypatch, capsys):
    from gpudoctor import demo

    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    assert demo.main(["--skip", "check"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "pip install 'gpudoctor[runtime]'" in out
    assert "the trace demo needs the runtime extra, missing module: torch" in out
    assert "the reference trainer needs the runtime extra, missing module: torch" in out
    assert "the simulation demo needs the runtime extra, missing module" in out
