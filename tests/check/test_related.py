"""Related locations: every line of a finding's evidence chain, in each output format, in the cache,
in notebooks, and ``noqa`` on them."""

from __future__ import annotations

import json
import textwrap

from gpudoctor.check.engine import check_source
from gpudoctor.check.registry import rule_by_code
from gpudoctor.cli import main

SOURCE = textwrap.dedent(
    """\
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["c_attn"]))
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
    """
)


def _gd413(source: str):
    return check_source(source, "t.py", rules=[rule_by_code("GD413")])


def test_reported_at_the_fix_with_the_change_related():
    (finding,) = _gd413(SOURCE)
    assert finding.line == 6 and "optimizer" in finding.source_line
    (related,) = finding.related
    assert (related.line, related.column) == (7, 9)
    assert related.source_line.startswith("model = get_peft_model")
    assert "adds new adapter weights" in related.message


def test_noqa_on_a_related_line_needs_the_code():
    lines = SOURCE.splitlines()
    bare = "\n".join(lines[:6] + [lines[6] + "  # noqa"] + lines[7:])
    assert len(_gd413(bare)) == 1  # a bare noqa there would silence every chain the line is part of
    coded = "\n".join(lines[:6] + [lines[6] + "  # noqa: GD413"] + lines[7:])
    assert _gd413(coded) == []
    primary = "\n".join(lines[:5] + [lines[5] + "  # noqa"] + lines[6:])
    assert _gd413(primary) == []


def test_formats(tmp_path, capsys):
    path = tmp_path / "train.py"
    path.write_text(SOURCE)
    args = ["check", "--no-cache", "--select", "GD413", str(path)]
    assert main([*args, "--output-format", "json"]) == 1
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert [(r["line"], r["column"]) for r in finding["related"]] == [(7, 9)]
    assert finding["related"][0]["source_line"].startswith("model = get_peft_model")

    assert main([*args, "--output-format", "sarif"]) == 1
    (result,) = json.loads(capsys.readouterr().out)["runs"][0]["results"]
    (related,) = result["relatedLocations"]
    assert related["id"] == 1 and related["physicalLocation"]["region"]["startLine"] == 7
    assert "adapter" in related["message"]["text"]

    assert main(args) == 1
    out = capsys.readouterr().out
    assert f"= note: {path}:7:9: `get_peft_model(" in out

    assert main([*args, "--output-format", "github"]) == 1
    assert f"%0ANote: {path}:7:9:" in capsys.readouterr().out


def test_cache_keeps_related(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.py"
    path.write_text(SOURCE)
    for _ in range(2):  # the second run is served from the cache
        assert main(["check", "--select", "GD413", "--output-format", "json", str(path)]) == 1
        (finding,) = json.loads(capsys.readouterr().out)["findings"]
        assert [r["line"] for r in finding["related"]] == [7]


def test_notebook_cells(tmp_path, capsys):
    cells = [SOURCE.split("model = get_peft_model")[0], "model = get_peft_model" + SOURCE.split("model = get_peft_model")[1]]
    notebook = {
        "cells": [{"cell_type": "code", "source": c, "metadata": {}, "outputs": [], "execution_count": None} for c in cells],
        "metadata": {"language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / "train.ipynb"
    path.write_text(json.dumps(notebook))
    assert main(["check", "--no-cache", "--select", "GD413", "--output-format", "json", str(path)]) == 1
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert (finding["cell"], finding["line"]) == (1, 6)
    assert [(r["cell"], r["line"]) for r in finding["related"]] == [(2, 1)]
