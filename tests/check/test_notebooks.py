"""Notebooks: code cells checked as one module, findings mapped to (cell, line), IPython syntax
neutralised, cell magics skipped, precise errors, and ``--fix`` touching only the fixed cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpudoctor.check import notebook
from gpudoctor.check.config import Config
from gpudoctor.check.engine import check_file, check_paths
from gpudoctor.cli import main



def code(source: str, **extra) -> dict:
    cell = {"cell_type": "code", "execution_count": None, "id": extra.pop("id", "c"), "metadata": {}, "outputs": [],
            "source": source.splitlines(keepends=True)}
    cell.update(extra)
    return cell


def markdown(source: str) -> dict:
    return {"cell_type": "markdown", "id": "m", "metadata": {}, "source": source.splitlines(keepends=True)}


def write(path: Path, cells: list[dict], language: str = "python") -> bytes:
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": language, "name": "python3"},
                     "language_info": {"name": language}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    data = (json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()
    path.write_bytes(data)
    return data


SETUP = "%pip install accelerate\nimport torch\nfrom accelerate import Accelerator\naccelerator = Accelerator()"
PREPARE = "model, optimizer, loader = accelerator.prepare(model, optimizer, loader)\n!nvidia-smi\nfiles = !ls\nmodel?"
LOOP = "%%time\nfor batch in loader:\n    loss = model(**batch).loss\n    %time print(loss)\n    loss.backward()\n    optimizer.step()\n    optimizer.zero_grad()"


def cells() -> list[dict]:
    return [
        markdown("# Fine-tune \u00fcber alles\n"),
        code(SETUP, id="setup", execution_count=1, outputs=[{"name": "stdout", "output_type": "stream", "text": ["ok\n"]}]),
        code("%%bash\nnvidia-smi\nloss.backward()", id="bash"),
        code(PREPARE, id="prepare"),
        code(LOOP, id="loop", metadata={"tags": ["train"]}),
    ]


def check(path: Path, select=("GD104",)):
    config = Config(select=list(select), root=path.parent)
    return check_file(path, config, config.selected_rules())


def test_data_flows_across_cells_and_maps_back(tmp_path) -> None:
    path = tmp_path / "nb.ipynb"
    write(path, cells())
    result = check(path)
    assert result.error is None
    assert [(f.code, f.cell, f.line, f.column) for f in result.findings] == [("GD104", 5, 5, 5)]
    assert result.findings[0].source_line == "    loss.backward()"


def test_text_report_names_the_cell(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "nb.ipynb", cells())
    main(["check", "nb.ipynb", "--select", "GD104", "--no-cache"])
    assert "nb.ipynb[cell 5]:5:5: GD104" in capsys.readouterr().out


@pytest.mark.parametrize(
    "line, expected",
    [
        ("%pip install -q peft", "pass"),
        ("!nvidia-smi", "pass"),
        ("    !ls -la", "    pass"),
        ("files = !ls", "files = None"),
        ("a, b = %sx echo 1", "a, b = None"),
        ("model?", "pass"),
        ("??model.forward", "pass"),
        ("%time x = 1", "pass"),
        ("x = 1 % 2", "x = 1 % 2"),
        ("print('%d' % 3)", "print('%d' % 3)"),
    ],
)
def test_magics_are_neutralised_line_for_line(line: str, expected: str) -> None:
    lines, code_lines, _ = notebook.neutralise(f"import torch\n{line}\n" + ("if True:\n" if line.startswith(" ") else ""))
    assert len(lines) == len(code_lines)
    assert code_lines[1].rstrip("\n") == expected


def test_backslash_continued_magic() -> None:
    _, code_lines, placeholders = notebook.neutralise("%pip install \\\n    accelerate \\\n    peft\nimport torch\n")
    assert code_lines == ["pass\n", "pass\n", "pass\n", "import torch\n"]
    assert placeholders == {0, 1, 2}


def test_python_cell_magic_keeps_body_other_cell_magics_skip() -> None:
    assert notebook.neutralise("%%time\nx = 1\n")[1] == ["pass\n", "x = 1\n"]
    assert notebook.neutralise("%%bash\necho hi\n") is None
    assert notebook.neutralise("\n%%writefile x.py\nimport torch\n") is None


def test_magic_neutralised_code_always_parses(tmp_path) -> None:
    path = tmp_path / "nb.ipynb"
    write(path, [code("import torch\nfor i in range(3):\n    %time f(i)\n    !echo {i}\nx = !ls\nawait asyncio.sleep(0)\nobj??")])
    assert check(path).error is None


def test_invalid_json_is_a_precise_error(tmp_path) -> None:
    path = tmp_path / "broken.ipynb"
    path.write_text('{\n "cells": [\n  {"cell_type": "code",}\n ]\n}\n')
    result = check(path)
    assert result.error is not None and result.error.startswith(f"{path}:3:")
    assert "invalid notebook JSON" in result.error


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"worksheets": [], "nbformat": 3}', "nbformat 3 notebooks are not supported"),
        ("[1, 2]", "top level is not a JSON object"),
        ('{"metadata": {}}', 'no "cells" list'),
        ('{"cells": [{"source": "x"}]}', "cell 1 has no cell_type"),
    ],
)
def test_not_a_notebook(tmp_path, content, message) -> None:
    path = tmp_path / "x.ipynb"
    path.write_text(content)
    assert message in (check(path).error or "")


def test_syntax_error_points_to_the_cell(tmp_path) -> None:
    path = tmp_path / "nb.ipynb"
    write(path, [code("import torch"), markdown("text"), code("x = 1\ny = (\n")])
    error = check(path).error
    assert error is not None and error.startswith(f"{path}[cell 3]:"), error


def test_other_kernels_and_irrelevant_notebooks_are_skipped(tmp_path) -> None:
    r_nb = tmp_path / "r.ipynb"
    write(r_nb, [code("library(torch)\nimport torch")], language="R")
    assert check(r_nb).skipped
    plain = tmp_path / "plain.ipynb"
    write(plain, [code("print(1)")])
    assert check(plain).skipped


def test_suppression_in_a_cell(tmp_path) -> None:
    path = tmp_path / "nb.ipynb"
    nb_cells = cells()
    nb_cells[4] = code(LOOP.replace("loss.backward()", "loss.backward()  # noqa: GD104"), id="loop")
    write(path, nb_cells)
    assert check(path).findings == []


def test_check_paths_finds_notebooks(tmp_path) -> None:
    write(tmp_path / "nb.ipynb", cells())
    result = check_paths([str(tmp_path)], Config(select=["GD104"], root=tmp_path))
    assert [(f.cell, f.line) for f in result.findings] == [(5, 5)]


# ------------------------------------------------------------------------------------------------
# --fix


def test_fix_rewrites_only_the_fixed_cell(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "nb.ipynb"
    before = write(path, cells())
    assert main(["check", "nb.ipynb", "--fix", "--select", "GD104", "--no-cache"]) == 0
    assert "Fixed 1 finding in 1 file" in capsys.readouterr().out
    expected = json.loads(before)
    expected["cells"][4]["source"][4] = "    accelerator.backward(loss)\n"
    assert path.read_bytes() == (json.dumps(expected, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()
    # magics, outputs, ids, metadata and the other cells are untouched; a second run changes nothing
    after = path.read_bytes()
    assert main(["check", "nb.ipynb", "--fix", "--select", "GD104", "--no-cache"]) == 0
    assert path.read_bytes() == after


def test_fix_keeps_string_sources_and_key_order(tmp_path) -> None:
    from gpudoctor.check.fixes import run_fixes
    from rich.console import Console

    nb = {"nbformat": 4, "nbformat_minor": 2, "metadata": {}, "cells": [
        {"cell_type": "code", "source": SETUP, "outputs": [], "metadata": {}, "execution_count": None},
        {"cell_type": "code", "source": PREPARE + "\n" + LOOP.replace("%%time\n", ""), "outputs": [], "metadata": {}, "execution_count": None},
    ]}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb, indent=2))  # not nbformat's style: kept as it is
    result = run_fixes([str(path)], Config(select=["GD104"], root=tmp_path), unsafe=False, diff_only=False, console=Console(file=None))
    assert result.fixed == 1
    nb["cells"][1]["source"] = nb["cells"][1]["source"].replace("    loss.backward()", "    accelerator.backward(loss)")
    assert path.read_text() == json.dumps(nb, indent=2)


def test_diff_on_notebook_names_the_cell(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    before = write(tmp_path / "nb.ipynb", cells())
    assert main(["check", "nb.ipynb", "--diff", "--select", "GD104", "--no-cache"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("--- a/nb.ipynb[cell 5]\n+++ b/nb.ipynb[cell 5]\n")
    assert (tmp_path / "nb.ipynb").read_bytes() == before


def test_split_back_restores_magics_and_assigns_inserted_lines() -> None:
    nb = {"cells": [{"cell_type": "code", "source": "%pip install x\nimport torch"}, {"cell_type": "markdown", "source": "m"},
                    {"cell_type": "code", "source": ["!ls\n", "x = 1\n"]}]}
    source = notebook.build(nb)
    assert source.text == "pass\nimport torch\npass\nx = 1\n"
    new_text = "pass\nimport torch\nfrom transformers import BitsAndBytesConfig\npass\nx = 2\n"
    assert notebook.split_back(source, new_text) == {
        0: "%pip install x\nimport torch\nfrom transformers import BitsAndBytesConfig",
        2: "!ls\nx = 2\n",
    }
    with pytest.raises(notebook.NotebookError, match="IPython line 1 of cell 3"):
        notebook.split_back(source, "pass\nimport torch\nprint()\nx = 1\n")
