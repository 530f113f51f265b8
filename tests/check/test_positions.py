"""Our targeted positions equal libcst's PositionProvider for every node asked about."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from gpudoctor.check.positions import positions

ROOT = Path(__file__).resolve().parents[2]


def test_same_ranges_as_position_provider() -> None:
    files = sorted((ROOT / "fixtures").rglob("*.py")) + sorted((ROOT / "src" / "gpudoctor" / "check").rglob("*.py"))[:15]
    compared = 0
    for path in files:
        module = cst.parse_module(path.read_text(encoding="utf-8"))
        expected = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
        nodes = list(expected)
        for offset in range(4):  # a few different subsets: what is recorded must not depend on the others
            wanted = nodes[offset::4][::3]
            got = positions(module, wanted)
            for node in wanted:
                assert got[node] == expected[node], (path, type(node).__name__)
            compared += len(wanted)
    assert compared > 10_000
