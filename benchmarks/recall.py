"""How much of the field does `gpudoctor check` catch, and what does it say about correct code?

Runs the check engine in-process (no torch import) over ``fixtures/field/``:

* bug scripts (``fixtures/field/*.py`` without ``.fixed``, and ``fixtures/field/seeds_as_posted/*.py``) carry
  ``# defect: GDxxx`` (or ``# defect: none-yet <what>``) on the defect line. A defect counts as

  - **hit**: a finding of the named code starting on that line (the recall figure);
  - **any at line**: a finding of any code starting on that line;
  - **in file**: a finding of the named code anywhere in the file;
  - **via related**: a finding of the named code that lists the defect line among its related locations
    (``Finding.related``, where the engine provides it: the user fixes the defect there); a defect is found
    from any line that takes part, so "at the line or among related" is printed too;

* fixed twins (``*.fixed.py``) and clean look-alikes (``fixtures/field/clean/*.py``) must get no finding;
  any finding there is a false alarm (counted with the default rule set and with preview rules).

A file the CLI's prefilter skips (``engine.is_relevant``: no library import, no snippet use) gets no finding,
as with ``gpudoctor check``. Each file is checked with its header (the module docstring, or a leading block of comments: the citation and
the description of the defect, which a user's script would not contain) blanked out and its ``# defect:``
markers removed, line numbers kept, so
that the rules' text heuristics cannot read the answer. Context a real script carries (a launch command, a
GPU named in a comment) is written as ordinary comments in the code itself.

Prints recall overall, per family (the ``Family:`` line of each file's header) and per code, the misses
with file:line, and the false alarms.

    python benchmarks/recall.py [--preview] [--json] [--only PREFIX]

``--preview`` measures recall with preview rules on too. ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from gpudoctor.check.engine import check_source, is_relevant
from gpudoctor.check.registry import select_rules

ROOT = Path(__file__).resolve().parents[1]
FIELD = ROOT / "fixtures" / "field"

DEFECT = re.compile(r"#\s*defect:\s*(?P<codes>GD\d{3}(?:\s*,\s*GD\d{3})*|none-yet)\b(?P<what>.*)$")
FAMILY = re.compile(r"^\W*Family:\s*(?P<family>[\w-]+)", re.MULTILINE)
NO_RULE = "none-yet"


@dataclass(frozen=True)
class Defect:
    path: Path
    line: int
    code: str  # "GDxxx" or NO_RULE
    what: str
    family: str


@dataclass
class Outcome:
    defect: Defect
    hit: bool
    any_at_line: bool
    in_file: bool
    via_related: bool = False
    found_at_line: list[str] = field(default_factory=list)
    found_in_file: list[str] = field(default_factory=list)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def header_lines(source: str) -> range:
    """Line numbers (1-based, end exclusive) of the file's header: module docstring or leading comments."""
    lines = source.splitlines()
    try:
        body = ast.parse(source).body
    except SyntaxError:
        body = []
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return range(1, first.end_lineno + 1)
    end = 0
    while end < len(lines) and lines[end].lstrip().startswith("#"):
        end += 1
    return range(1, end + 1)


def code_of(source: str) -> str:
    """The source as a user would have it: header blanked and `# defect:` markers removed (same line numbers)."""
    header = header_lines(source)
    lines = ("" if number in header else DEFECT.sub("", line).rstrip() for number, line in enumerate(source.splitlines(), start=1))
    return "\n".join(lines) + "\n"


def family_of(source: str, path: Path) -> str:
    if path.parent.name == "seeds_as_posted":
        return "field-reports-as-posted"
    match = FAMILY.search("\n".join(source.splitlines()[:20]))
    return match.group("family") if match else "unknown"


def defects(path: Path, source: str) -> list[Defect]:
    family = family_of(source, path)
    found = []
    for number, line in enumerate(source.splitlines(), start=1):
        match = DEFECT.search(line)
        if not match:
            continue
        what = match.group("what").strip()
        for code in match.group("codes").split(","):
            found.append(Defect(path, number, code.strip(), what, family))
    return found


ONLY: tuple[str, ...] = ()  # file-name prefixes to measure (--only); empty: the whole corpus


def selected(paths) -> list[Path]:
    return [path for path in paths if not ONLY or path.name.startswith(ONLY)]


def bug_scripts() -> list[Path]:
    top = [p for p in FIELD.glob("*.py") if not p.name.endswith(".fixed.py")]
    return selected(sorted(top) + sorted((FIELD / "seeds_as_posted").glob("*.py")))


def precision_scripts() -> list[Path]:
    return selected(sorted(FIELD.glob("*.fixed.py")) + sorted((FIELD / "clean").glob("*.py")))


def run(path: Path, source: str, preview: bool):
    """Findings of the default (or preview) rule set on the file without its header; a file that does not parse
    is reported as such."""
    code = code_of(source)
    if not is_relevant(code.encode()):
        return [], None  # `gpudoctor check` skips the file (no library import, no snippet use): every defect is a miss
    try:
        return check_source(code, str(path), rules=select_rules(preview=preview)), None
    except Exception as error:  # a parse failure is a miss for every defect in the file, never a crash
        return [], f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def related_lines(finding) -> set[int]:
    """Lines of a finding's related locations, for engines that report them (objects or dicts with a line)."""
    lines = set()
    for location in getattr(finding, "related", None) or ():
        line = location.get("line") if isinstance(location, dict) else getattr(location, "line", None)
        if isinstance(line, int):
            lines.add(line)
    return lines


def measure_recall(preview: bool) -> tuple[list[Outcome], dict[str, str]]:
    outcomes, errors = [], {}
    for path in bug_scripts():
        source = path.read_text(encoding="utf-8")
        findings, error = run(path, source, preview)
        if error:
            errors[rel(path)] = error
        for defect in defects(path, source):
            at_line = sorted({f.code for f in findings if f.line == defect.line})
            named = sorted({f"{f.code}@{f.line}" for f in findings if f.code == defect.code})
            outcomes.append(
                Outcome(
                    defect=defect,
                    hit=defect.code in at_line,
                    any_at_line=bool(at_line),
                    in_file=bool(named),
                    via_related=any(f.code == defect.code and defect.line in related_lines(f) for f in findings),
                    found_at_line=at_line,
                    found_in_file=sorted({f"{f.code}@{f.line}" for f in findings}),
                )
            )
    return outcomes, errors


def measure_false_alarms() -> dict[str, list[dict]]:
    """Per mode ("default", "preview"): every clean file that got a finding, with its findings."""
    alarms: dict[str, list[dict]] = {"default": [], "preview": []}
    for path in precision_scripts():
        source = path.read_text(encoding="utf-8")
        for mode, preview in (("default", False), ("preview", True)):
            findings, error = run(path, source, preview)
            if findings or error:
                alarms[mode].append(
                    {
                        "path": rel(path),
                        "findings": [f"{f.code}@{f.line} ({f.severity.value})" for f in findings],
                        "error": error,
                    }
                )
    return alarms


def ratio(hits: int, total: int) -> str:
    return f"{hits}/{total} ({hits / total:.0%})" if total else "0/0"


def tally(outcomes: list[Outcome], key) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = defaultdict(lambda: {"defects": 0, "hit": 0, "any_at_line": 0, "in_file": 0, "via_related": 0})
    for outcome in outcomes:
        row = table[key(outcome)]
        row["defects"] += 1
        row["hit"] += outcome.hit
        row["any_at_line"] += outcome.any_at_line
        row["in_file"] += outcome.in_file
        row["via_related"] += outcome.via_related
    return dict(sorted(table.items()))


def report(preview: bool) -> dict:
    outcomes, errors = measure_recall(preview)
    ruled = [o for o in outcomes if o.defect.code != NO_RULE]
    unruled = [o for o in outcomes if o.defect.code == NO_RULE]
    alarms = measure_false_alarms()
    return {
        "rules": "default+preview" if preview else "default",
        "bug_scripts": len(bug_scripts()),
        "precision_scripts": len(precision_scripts()),
        "recall": {
            "defects": len(ruled),
            "hit": sum(o.hit for o in ruled),
            "any_at_line": sum(o.any_at_line for o in ruled),
            "in_file": sum(o.in_file for o in ruled),
            "via_related": sum(o.via_related for o in ruled),
            "hit_or_related": sum(o.hit or o.via_related for o in ruled),
        },
        "no_rule_yet": {"defects": len(unruled), "any_at_line": sum(o.any_at_line for o in unruled)},
        "per_family": tally(ruled, lambda o: o.defect.family),
        "per_code": tally(ruled, lambda o: o.defect.code),
        "misses": [
            {
                "where": f"{rel(o.defect.path)}:{o.defect.line}",
                "code": o.defect.code,
                "what": o.defect.what,
                "family": o.defect.family,
                "at_line": o.found_at_line,
                "in_file": o.found_in_file,
                "via_related": o.via_related,
            }
            for o in outcomes
            if not o.hit
        ],
        "parse_errors": errors,
        "false_alarms": alarms,
    }


def print_text(data: dict) -> None:
    r = data["recall"]
    print(f"gpudoctor check on fixtures/field ({data['rules']} rules): {data['bug_scripts']} bug scripts, "
          f"{data['precision_scripts']} fixed twins and clean look-alikes")
    print(f"recall (named code at the defect line): {ratio(r['hit'], r['defects'])}")
    print(f"  any code at the defect line:            {ratio(r['any_at_line'], r['defects'])}")
    print(f"  named code anywhere in the file:        {ratio(r['in_file'], r['defects'])}")
    print(f"  named code, defect line among related:  {ratio(r['via_related'], r['defects'])}")
    print(f"  at the line or among related:           {ratio(r['hit_or_related'], r['defects'])}")
    n = data["no_rule_yet"]
    print(f"defects no rule claims yet: {n['defects']} (any finding at their line: {n['any_at_line']})")
    for title, table in (("family", data["per_family"]), ("code", data["per_code"])):
        print(f"\nper {title}:")
        width = max((len(k) for k in table), default=0)
        for key, row in table.items():
            print(f"  {key:<{width}}  hit {ratio(row['hit'], row['defects']):<12} "
                  f"at line {row['any_at_line']}/{row['defects']}  in file {row['in_file']}/{row['defects']}")
    print(f"\nmisses ({len(data['misses'])}):")
    for miss in data["misses"]:
        seen = ", ".join(miss["at_line"]) or "-"
        elsewhere = ", ".join(miss["in_file"]) or "-"
        label = miss["code"] + (f" {miss['what']}" if miss["code"] == NO_RULE and miss["what"] else "")
        related = "; defect line among its related" if miss["via_related"] else ""
        print(f"  {miss['where']}  {label}  [at line: {seen}; in file: {elsewhere}{related}]")
    for path, error in data["parse_errors"].items():
        print(f"  PARSE ERROR {path}: {error}")
    for mode in ("default", "preview"):
        alarms = data["false_alarms"][mode]
        print(f"\nfalse alarms on clean files ({mode} rules): {len(alarms)}/{data['precision_scripts']}")
        for alarm in alarms:
            detail = ", ".join(alarm["findings"]) or alarm["error"]
            print(f"  {alarm['path']}: {detail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preview", action="store_true", help="measure recall with preview rules on")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--only", action="append", default=[], metavar="PREFIX",
                        help="measure only files whose name starts with PREFIX (repeatable), e.g. a red team's new set")
    args = parser.parse_args(argv)
    global ONLY
    ONLY = tuple(args.only)
    data = report(args.preview)
    assert "torch" not in sys.modules, "check must not import torch"
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print_text(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
