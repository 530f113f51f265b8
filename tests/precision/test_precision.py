"""Precision on real code: every default-rule finding over the installed sources of accelerate, peft, trl
and transformers' trainer.py/modeling_utils.py must have a verdict in ``review.json``, and none may be a
false positive. A new finding without a verdict fails the test with a ready-to-paste entry."""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from pathlib import Path

import pytest

from gpudoctor.check.config import Config
from gpudoctor.check.engine import check_paths
from gpudoctor.check.finding import Severity

HERE = Path(__file__).resolve().parent
REVIEW = HERE / "review.json"
VERDICTS = {"true-positive", "false-positive", "acceptable"}
PACKAGES = ("accelerate", "peft", "trl", "transformers")
SITE = Path(sysconfig.get_paths()["purelib"])


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # top-level: finds without importing
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def corpus() -> tuple[Path, list[Path]]:
    dirs = {name: _package_dir(name) for name in PACKAGES}
    missing = [name for name, path in dirs.items() if path is None]
    if missing:
        pytest.skip(f"precision corpus needs {', '.join(missing)} installed (not found: nothing to check)")
    site = dirs["accelerate"].parent
    paths = [dirs["accelerate"], dirs["peft"], dirs["trl"], dirs["transformers"] / "trainer.py", dirs["transformers"] / "modeling_utils.py"]
    return site, [p for p in paths if p.exists()]


def load_review() -> list[dict]:
    data = json.loads(REVIEW.read_text(encoding="utf-8"))
    return data["findings"]


def test_review_file_is_well_formed() -> None:
    seen = set()
    for entry in load_review():
        assert {"path", "line", "code", "verdict", "reason"} <= set(entry), entry
        assert entry["verdict"] in VERDICTS, entry
        assert entry["reason"].strip(), entry
        key = (entry["path"], entry["line"], entry["code"])
        assert key not in seen, f"duplicate review entry {key}"
        seen.add(key)


def test_every_finding_has_a_verdict_and_none_is_a_false_positive() -> None:
    site, paths = corpus()
    # Config() selects every default (non-preview) rule; no pyproject is read.
    result = check_paths([str(p) for p in paths], Config(root=site), jobs=2)
    assert not result.errors, result.errors
    review = {(e["path"], e["line"], e["code"]): e for e in load_review()}
    unreviewed, false_positives = [], []
    for finding in result.findings:
        rel = Path(finding.path).resolve().relative_to(site.resolve()).as_posix()
        entry = review.get((rel, finding.line, finding.code))
        if entry is None:
            unreviewed.append(
                {"path": rel, "line": finding.line, "code": finding.code, "severity": finding.severity.name.lower(),
                 "verdict": "?", "reason": "?", "message": finding.message}
            )
        elif entry["verdict"] == "false-positive" and finding.severity is not Severity.INFO:
            false_positives.append(f"{rel}:{finding.line} {finding.code}: {entry['reason']}")
    assert not unreviewed, (
        f"{len(unreviewed)} finding(s) without a verdict in {REVIEW.name}; review them and add entries:\n"
        + json.dumps(unreviewed, indent=1)
    )
    assert not false_positives, "false positives at default severity (fix the rule):\n" + "\n".join(false_positives)
