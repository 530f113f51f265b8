"""Every ``fixtures/**/*.py`` file is a test: each ``# expect: CODE[, CODE]`` comment must be matched by
a finding starting on that line, and no other finding may appear (preview rules included). Likewise
each ``# related: CODE`` line must be a related location of a CODE finding, and no other line may be."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpudoctor.check.engine import check_source
from gpudoctor.check.registry import all_rules

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
# fixtures/trace holds programs for the runtime probe; they are checked by tests/trace. fixtures/field is the
# recall corpus (`# defect:` markers, measured by benchmarks/recall.py, kept well-formed by test_recall_corpus.py).
SKIPPED = {"trace", "field"}
FILES = sorted(p for p in FIXTURES.rglob("*.py") if p.relative_to(FIXTURES).parts[0] not in SKIPPED)
_EXPECT = re.compile(r"#\s*expect:\s*(?P<codes>GD\d{3}(?:\s*,\s*GD\d{3})*)")
_RELATED = re.compile(r"#\s*related:\s*(?P<codes>GD\d{3}(?:\s*,\s*GD\d{3})*)")


def expectations(source: str, pattern: re.Pattern = _EXPECT) -> set[tuple[int, str]]:
    expected = set()
    for number, line in enumerate(source.splitlines(), start=1):
        match = pattern.search(line)
        if match:
            expected |= {(number, code.strip()) for code in match.group("codes").split(",")}
    return expected


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(FIXTURES)) for p in FILES])
def test_fixture(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    findings = check_source(source, str(path), rules=all_rules())
    found = {(f.line, f.code) for f in findings}
    expected = expectations(source)
    missing = sorted(expected - found)
    unexpected = sorted(found - expected)
    assert not missing and not unexpected, f"missing {missing}, unexpected {unexpected}"
    related = {(r.line, f.code) for f in findings for r in f.related}
    expected_related = expectations(source, _RELATED)
    missing, unexpected = sorted(expected_related - related), sorted(related - expected_related)
    assert not missing and not unexpected, f"related: missing {missing}, unexpected {unexpected}"


def test_fixed_twins_are_clean() -> None:
    for path in FIXTURES.rglob("*.fixed.py"):
        assert not expectations(path.read_text(encoding="utf-8")), f"{path} is a fixed twin: it must expect nothing"


def test_fixtures_exist() -> None:
    assert len(FILES) >= 3
