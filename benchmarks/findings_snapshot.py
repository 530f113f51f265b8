"""Dump every finding of `gpudoctor check` (default and preview rules) to JSON, or compare two dumps.

For engine/facts optimizations that must not change any finding:

    python benchmarks/findings_snapshot.py before.json [EXTRA_PATH ...]
    ... change the engine ...
    python benchmarks/findings_snapshot.py after.json [EXTRA_PATH ...] --compare before.json

The corpus is the one benchmarks/check_speed.py times (the installed accelerate, peft and trl), plus
fixtures/ and any extra paths. Every rule (stable and preview) runs once per file; rules are
independent, so the default-rule findings are the subset whose code is a default rule (each entry says
``default``). Errors and skips are recorded too. Exit status 1 when --compare finds a difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_speed import corpus  # noqa: E402

from gpudoctor.check.config import Config  # noqa: E402
from gpudoctor.check.engine import check_file, discover  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def snapshot(extra: list[str]) -> dict:
    files = list(corpus())
    more, _ = discover([str(ROOT / "fixtures"), *extra], Config(root=ROOT))
    files += more
    config = Config(root=ROOT, preview=True)
    rules = config.selected_rules()
    default = {r.code for r in Config(root=ROOT).selected_rules()}
    out = {}
    for path in files:
        result = check_file(path, config, rules)
        out[str(path)] = {
            "error": result.error,
            "skipped": result.skipped,
            "findings": [
                [f.line, f.column, f.end_line, f.end_column, f.code, f.code in default, f.message,
                 [[r.line, r.column, r.message] for r in f.related]]
                for f in result.findings
            ],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("extra", nargs="*", help="more files or folders to check")
    parser.add_argument("--compare", help="an earlier dump: print the differences, exit 1 if any")
    args = parser.parse_args()
    data = snapshot(args.extra)
    Path(args.out).write_text(json.dumps(data, indent=0, sort_keys=True))
    total = sum(len(v["findings"]) for v in data.values())
    print(f"{len(data)} files, {total} findings -> {args.out}")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        diffs = [p for p in sorted(set(before) | set(data)) if before.get(p) != data.get(p)]
        for path in diffs[:20]:
            print(f"DIFF {path}\n  before: {before.get(path)}\n  after : {data.get(path)}")
        print(f"{len(diffs)} file(s) differ" if diffs else "identical")
        sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
