"""Does each field defect survive the ways people rewrite the same program?

Applies the metamorphic transformations of ``tests/check/metamorph.py`` (inside ``main()``, built in a helper,
passed to a function, aliased or stripped imports, renamed variables, temporaries, ``enumerate``/``tqdm``/``zip``/
generator/``iter()``+``next()`` loops) to the recall corpus of ``benchmarks/recall.py`` instead of the rule
fixtures: each bug script (header blanked, its ``# defect: GDxxx`` marker read as an expectation) must keep its
finding at the line the defect moved to, and each fixed twin / clean look-alike must stay clean. Outsider-written
scripts reach idioms the rule fixtures do not, so a lost variant here is an evidence chain to extend.

Prints, per transformation, the defects kept; then every lost variant and every clean variant with a finding.

    python benchmarks/field_metamorphic.py [PREFIX ...]   # only files whose name starts with a PREFIX
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "check"), str(ROOT / "benchmarks")]

import metamorph  # noqa: E402  (tests/check/metamorph.py: the transformations and the variant runner)
import recall  # noqa: E402  (the corpus, its header rules)

_DEFECT = re.compile(r"#\s*defect:\s*(?P<codes>GD\d{3}(?:\s*,\s*GD\d{3})*)[^\n]*")
_UNRULED = re.compile(r"#\s*defect:.*$")


def as_fixture(source: str) -> str:
    """The script as metamorph expects a fixture: header blanked, `# defect: GDxxx` turned into `# expect: GDxxx`
    (a `none-yet` marker dropped), line numbers kept."""
    header = recall.header_lines(source)
    lines = []
    for number, line in enumerate(source.splitlines(), start=1):
        if number in header:
            line = ""
        elif match := _DEFECT.search(line):
            line = f"{line[:match.start()]}# expect: {match.group('codes')}"
        else:
            line = _UNRULED.sub("", line)
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    prefixes = tuple(argv)
    keep = (lambda path: path.name.startswith(prefixes)) if prefixes else (lambda path: True)
    kept, total = defaultdict(int), defaultdict(int)
    lost, noisy, errors = defaultdict(list), [], []
    for path in [p for p in recall.bug_scripts() + recall.precision_scripts() if keep(p)]:
        source = as_fixture(path.read_text(encoding="utf-8"))
        for transform in metamorph.TRANSFORMS:
            try:
                outcome = metamorph.run_variant(path, transform, source)
            except Exception as error:  # a transformation or the engine failing on one variant: say so, go on
                errors.append(f"{path.name} [{transform.name}]: {type(error).__name__}: {str(error)[:100]}")
                continue
            if outcome is None:
                continue
            if outcome.clean:
                if outcome.extra:
                    noisy.append(f"{path.name} [{transform.name}]: {'; '.join(outcome.extra[:2])}")
                continue
            kept[transform.name] += sum(outcome.kept.values())
            total[transform.name] += sum(outcome.kept.values()) + len(outcome.lost_lines)
            lost[path.name] += [f"{transform.name}: {line}" for line in outcome.lost_lines]
    for name in sorted(total):
        print(f"  {name:14s} {recall.ratio(kept[name], total[name])}")
    print(f"defects kept in variants: {recall.ratio(sum(kept.values()), sum(total.values()))}")
    print(f"\nlost ({sum(map(len, lost.values()))}):")
    for name, lines in sorted(lost.items()):
        if lines:
            print(f"  {name}: {'; '.join(lines)}")
    print(f"\nclean variants with findings ({len(noisy)}):")
    for line in noisy:
        print(f"  {line}")
    for line in errors:
        print(f"error: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
