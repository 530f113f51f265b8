"""--output-format sarif / github / junit / json: valid, escaped, sorted; JSON documented."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gpudoctor.check.finding import Applicability, Finding, Fix, Severity
from gpudoctor.cli import main
from gpudoctor.report import github, json_report, junit, sarif

ROOT = Path(__file__).resolve().parents[2]
# The official schema, vendored unmodified (provenance and OASIS notice: data/sarif-schema-2.1.0.NOTICE.txt).
SARIF_SCHEMA = Path(__file__).resolve().parent / "data" / "sarif-schema-2.1.0.json"


def findings() -> list[Finding]:
    return [
        Finding("GD104", "loss-backward-with-accelerator", Severity.ERROR, "bypasses `accelerator`: 50% of\nit", "src/b, c.py",
                9, 5, 9, 20, fix_hint="Use `accelerator.backward(loss)`.", fix=Fix("Replace", Applicability.SAFE, ()),
                source_line="    loss.backward()"),
        Finding("GD101", "prepare-dispatched-model", Severity.WARNING, "dispatched model", "src/a.py", 3, 1, 4, 2),
        Finding("GD104", "loss-backward-with-accelerator", Severity.INFO, "in a notebook", "nb.ipynb", 2, 5, 2, 20, cell=4),
        Finding("GD101", "prepare-dispatched-model", Severity.ERROR, "first", "src/a.py", 1, 1, 1, 10),
    ]


ERRORS = ["broken.py:3:9: syntax error: invalid syntax"]


def test_sarif_is_valid_against_the_official_schema() -> None:
    import jsonschema  # a dev dependency: the test must run, not skip
    schema = json.loads(SARIF_SCHEMA.read_text(encoding="utf-8"))
    log = json.loads(sarif.render(findings(), ERRORS))
    jsonschema.validators.validator_for(schema)(schema).validate(log)


def test_sarif_content() -> None:
    log = json.loads(sarif.render(findings(), ERRORS))
    assert log["version"] == "2.1.0"
    run = log["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == ["GD104", "GD101"]  # in order of first use
    gd101 = rules[1]
    assert gd101["name"] == "prepare-dispatched-model"
    assert gd101["shortDescription"]["text"]
    assert "distributed mode" in gd101["help"]["markdown"]  # the whole rule doc travels with the log
    # no invented URL: helpUri only when the package metadata declares a repository
    assert ("helpUri" in gd101) == (sarif.repository_url() is not None)
    assert "accelerate dispatched" in gd101["fullDescription"]["text"]  # "What it does" of the doc
    results = run["results"]
    assert [(r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"], r["locations"][0]["physicalLocation"]["region"]["startLine"]) for r in results] == [
        ("nb.ipynb", 2), ("src/a.py", 1), ("src/a.py", 3), ("src/b,%20c.py", 9)
    ]
    assert [r["level"] for r in results] == ["note", "error", "warning", "error"]
    assert results[0]["properties"]["cell"] == 4 and results[0]["message"]["text"].startswith("[cell 4] ")
    region = results[2]["locations"][0]["physicalLocation"]["region"]
    assert region == {"startLine": 3, "startColumn": 1, "endLine": 4, "endColumn": 2}
    assert all(rules[r["ruleIndex"]]["id"] == r["ruleId"] for r in results)
    assert run["invocations"][0]["toolExecutionNotifications"][0]["message"]["text"] == ERRORS[0]
    assert run["invocations"][0]["executionSuccessful"] is False


def test_github_annotations_escape() -> None:
    lines = github.render(findings(), ERRORS).splitlines()
    assert lines[0] == "::notice file=nb.ipynb,title=GD104 loss-backward-with-accelerator::[cell 4]:2:5: in a notebook"
    assert lines[1] == "::error file=src/a.py,line=1,col=1,endLine=1,endColumn=10,title=GD101 prepare-dispatched-model::first"
    assert lines[2].startswith("::warning file=src/a.py,line=3,")
    assert lines[3] == (
        "::error file=src/b%2C c.py,line=9,col=5,endLine=9,endColumn=20,title=GD104 loss-backward-with-accelerator::"
        "bypasses `accelerator`: 50%25 of%0Ait%0AFix: Use `accelerator.backward(loss)`."
    )
    assert lines[4] == "::error title=gpudoctor::broken.py:3:9: syntax error: invalid syntax"
    assert github.escape_property("a:b,c%d\r\n") == "a%3Ab%2Cc%25d%0D%0A"


def test_junit_one_case_per_file_failures_per_finding() -> None:
    xml = junit.render(findings(), ERRORS, files=["src/a.py", "src/b, c.py", "nb.ipynb", "clean.py"])
    root = ET.fromstring(xml.encode())
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert sorted(cases) == ["broken.py", "clean.py", "nb.ipynb", "src/a.py", "src/b, c.py"]
    assert [f.get("type") for f in cases["src/a.py"].findall("failure")] == ["GD101", "GD101"]
    assert cases["clean.py"].find("failure") is None
    assert cases["nb.ipynb"].find("failure") is None and "[cell 4]" in cases["nb.ipynb"].find("system-out").text
    assert cases["broken.py"].find("error") is not None
    assert suite.get("tests") == "5" and suite.get("failures") == "3" and suite.get("errors") == "1"
    assert cases["src/a.py"].get("classname") == "src.a"


def test_json_fields_are_documented() -> None:
    doc = (ROOT / "docs" / "json-schema.md").read_text(encoding="utf-8")
    finding_table = doc.split("## A finding", 1)[1].split("##", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)`", finding_table, re.MULTILINE))
    data = json.loads(json_report.render(findings(), ERRORS))
    assert data["version"] == 1
    assert documented == set(data["findings"][0])
    top_table = doc.split("## Top level", 1)[1].split("##", 1)[0]
    assert set(re.findall(r"^\| `(\w+)`", top_table, re.MULTILINE)) == set(data)


SOURCE = """\
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


@pytest.mark.parametrize("fmt", ["sarif", "github", "junit", "json"])
def test_cli_formats_are_sorted_and_parse(tmp_path, monkeypatch, capsys, fmt) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "b.py").write_text(SOURCE)
    (tmp_path / "a.py").write_text(SOURCE + "\nfor batch in loader:\n    loss.backward()\n")
    code = main(["check", ".", "--select", "GD104", "--no-cache", "--output-format", fmt])
    out = capsys.readouterr().out
    assert code == 1
    if fmt == "sarif":
        results = json.loads(out)["runs"][0]["results"]
        locations = [(r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"], r["locations"][0]["physicalLocation"]["region"]["startLine"]) for r in results]
    elif fmt == "json":
        locations = [(Path(f["path"]).name, f["line"]) for f in json.loads(out)["findings"]]
    elif fmt == "github":
        locations = [(Path(m.group(1)).name, int(m.group(2))) for m in re.finditer(r"file=([^,]+),line=(\d+)", out)]
    else:
        root = ET.fromstring(out.encode())
        locations = [(Path(c.get("name")).name, len(c.findall("failure"))) for c in root.iter("testcase")]
        assert locations == [("a.py", 2), ("b.py", 1)]
        return
    assert [(Path(p).name, line) for p, line in locations] == [("a.py", 8), ("a.py", 13), ("b.py", 8)]


def test_output_file(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text(SOURCE)
    main(["check", "a.py", "--select", "GD104", "--no-cache", "--output-format", "sarif", "-o", "out.sarif"])
    assert json.loads((tmp_path / "out.sarif").read_text())["runs"][0]["results"][0]["ruleId"] == "GD104"
