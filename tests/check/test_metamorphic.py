"""Metamorphic tests: semantics-preserving variants of every fixture (see ``metamorph.py``) keep each
expected finding, and variants of clean fixtures stay clean. The per-rule share of kept findings is printed
(``pytest -s``) and must reach the floor below."""

from __future__ import annotations

import pytest

import metamorph

# Every rule must keep at least this share of its findings across the variants.
FLOOR = 0.90
# Rules still below the floor, with the share they reach now: a drop below it fails the test, and the
# entry is removed once the rule reaches FLOOR.
KNOWN_BELOW: dict[str, float] = {}


@pytest.fixture(scope="module")
def outcomes() -> list[metamorph.Outcome]:
    return metamorph.run_all()  # the variants are cached: the tests below share them


@pytest.mark.slow
def test_transformations_produce_valid_variants(outcomes) -> None:
    """Each transformation applies to some fixture and keeps the numbered expectations."""
    applied = {t.name: 0 for t in metamorph.TRANSFORMS}
    for path in metamorph.fixture_files():
        source = path.read_text(encoding="utf-8")
        expected = len(metamorph.numbered_expectations(metamorph.number_expectations(source)))
        for transform in metamorph.TRANSFORMS:
            code = metamorph.variant(source, transform)  # compiles, or raises
            if code is None:
                continue
            applied[transform.name] += 1
            assert len(metamorph.numbered_expectations(code)) == expected, (path.name, transform.name)
    assert all(applied.values()), applied


@pytest.mark.slow
def test_rules_keep_their_findings_across_variants(outcomes) -> None:
    print("\n" + metamorph.summary(outcomes))
    shares = {code: kept / total for code, (kept, total) in metamorph.per_rule(outcomes).items()}
    below = {code: round(share, 2) for code, share in shares.items() if share < KNOWN_BELOW.get(code, FLOOR) - 1e-9}
    assert not below, f"rules below their floor: {below}"


@pytest.mark.slow
def test_variants_of_clean_fixtures_stay_clean(outcomes) -> None:
    noisy = {f"{o.fixture} [{o.transform}]": o.extra for o in outcomes if o.clean and o.extra}
    assert not noisy, noisy
