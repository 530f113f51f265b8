"""The field recall corpus (``fixtures/field``) stays well-formed, and its correct scripts stay clean.

Recall itself is measured, not asserted: ``python benchmarks/recall.py``. What is asserted is the part we
promise: every bug script has a fixed twin, cites the public report it was rebuilt from, marks its defect
line(s) with ``# defect:``, and compiles; every fixed twin and clean look-alike gets no finding from the
default rule set (a finding there is a false alarm on code that works). Like the benchmark, the check sees
each file without its header (citation and explanation), line numbers kept."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from gpudoctor.check.engine import check_source

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("recall_benchmark", ROOT / "benchmarks" / "recall.py")
recall = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = recall  # dataclasses look their module up while the benchmark is executed
_spec.loader.exec_module(recall)

BUGS = recall.bug_scripts()
CLEAN = recall.precision_scripts()
SOURCE_LINK = re.compile(r"Source:\s*https://\S+")
# The field reports as posted cite the report they reproduce (not all of them were posted with a link).
SOURCE_ANY = re.compile(r"Source:\s*\S+")
# Known false alarms on correct code, reported to the rule owners: {relative path: reason naming the rule}.
KNOWN_FALSE_ALARMS: dict[str, str] = {
}


def ids(paths):
    return [str(p.relative_to(recall.FIELD)) for p in paths]


def header(source: str) -> str:
    return "\n".join(source.splitlines()[:15])


def test_corpus_size() -> None:
    twins = [p for p in BUGS if p.parent == recall.FIELD]
    assert len(twins) >= 60, f"{len(twins)} bug scripts with twins; the corpus promises at least 60"
    assert len(list((recall.FIELD / "clean").glob("*.py"))) >= 20
    assert len(list((recall.FIELD / "seeds_as_posted").glob("*.py"))) >= 3


@pytest.mark.parametrize("path", BUGS, ids=ids(BUGS))
def test_bug_script_is_well_formed(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    compile(source, str(path), "exec")
    cited = SOURCE_LINK if path.parent == recall.FIELD else SOURCE_ANY
    assert cited.search(header(source)), "cite the public report: `Source: https://...` in the header"
    assert recall.defects(path, source), "mark the defect line with `# defect: GDxxx` or `# defect: none-yet <what>`"
    assert "# expect:" not in source, "field scripts use `# defect:`; `# expect:` belongs to fixtures/ tests"
    if path.parent == recall.FIELD:
        twin = path.with_name(path.stem + ".fixed.py")
        assert twin.exists(), f"missing fixed twin {twin.name}"
        assert recall.family_of(source, path) != "unknown", "name the family: `Family: <name>` in the header"


@pytest.mark.parametrize("path", CLEAN, ids=ids(CLEAN))
def test_correct_script_gets_no_finding(path: Path) -> None:
    key = str(path.relative_to(ROOT))
    if key in KNOWN_FALSE_ALARMS:
        pytest.xfail(KNOWN_FALSE_ALARMS[key])
    source = path.read_text(encoding="utf-8")
    assert SOURCE_LINK.search(header(source)), "cite the report the look-alike answers: `Source: https://...`"
    assert not recall.defects(path, source), "a correct script carries no `# defect:` marker"
    findings = check_source(recall.code_of(source), str(path))
    assert not findings, "false alarm: " + "; ".join(f"{f.code}@{f.line}: {f.message}" for f in findings)
