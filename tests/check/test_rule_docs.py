"""Each rule has its doc in rules/, with the required sections; the doc's Example triggers the rule and
its Use instead does not."""

from __future__ import annotations

import pytest

from gpudoctor.check.docs import code_blocks, doc_path, read_doc, sections
from gpudoctor.check.engine import check_source
from gpudoctor.check.registry import all_rules

RULES = all_rules()
REQUIRED = ("What it does", "Why is this bad", "Versions", "Example", "Use instead", "Fix safety", "References")


@pytest.mark.parametrize("rule", RULES, ids=[r.code for r in RULES])
def test_doc_sections(rule) -> None:
    text = read_doc(rule.code, rule.name)
    assert text is not None, f"missing {doc_path(rule.code, rule.name)}"
    assert text.startswith(f"# {rule.code} {rule.name}\n")
    missing = [s for s in REQUIRED if s not in sections(text)]
    assert not missing, f"{rule.code}: missing sections {missing}"


@pytest.mark.parametrize("rule", RULES, ids=[r.code for r in RULES])
def test_doc_examples(rule) -> None:
    parts = sections(read_doc(rule.code, rule.name) or "")
    bad, good = code_blocks(parts.get("Example", "")), code_blocks(parts.get("Use instead", ""))
    assert bad and good, f"{rule.code}: Example and Use instead need a ```python block each"
    for block in bad:
        codes = {f.code for f in check_source(block, "example.py", rules=[rule])}
        assert rule.code in codes, f"{rule.code}: the Example does not trigger the rule:\n{block}"
    for block in good:
        codes = {f.code for f in check_source(block, "use_instead.py", rules=[rule])}
        assert rule.code not in codes, f"{rule.code}: the Use instead block triggers the rule:\n{block}"


def test_codes_unique_and_grouped() -> None:
    from gpudoctor.check.registry import known_codes

    codes = [r.code for r in RULES]
    # a rule's module is named after its code (gd101_*.py): the CLI validates codes without importing rules
    assert known_codes() == set(codes)
    for rule in RULES:
        assert rule.__module__.rsplit(".", 1)[-1].startswith(rule.code.lower() + "_"), rule.__module__
    assert len(codes) == len(set(codes))
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
