"""The README's promises stay true: its rule index matches the registry, and CI runs its test command."""

from __future__ import annotations

from pathlib import Path

from gpudoctor.check.docs import README_BEGIN, README_END, rules_table

ROOT = Path(__file__).resolve().parents[1]


def test_rule_index_is_in_sync():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = readme.index(README_BEGIN) + len(README_BEGIN), readme.index(README_END)
    assert readme[start:end].strip() == rules_table().strip(), "regenerate with gpudoctor.check.docs.rules_table()"


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
    assert "gpudoctor demo" in readme and "gpudoctor demo" in ci
