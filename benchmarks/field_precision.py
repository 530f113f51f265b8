"""Field precision: how many of `gpudoctor check`'s findings on real public training scripts are true.

The scripts are listed in ``benchmarks/field_scripts.json`` (repository, path, commit, why chosen); their text
is third-party code and stays out of this repository, in a cache folder (default ``/work/fieldscripts``, or
``$GPUDOCTOR_FIELD_SCRIPTS``, or ``--cache``), one file per script named ``<owner>__<name>__<path with / as __>``.
``--populate`` fills the cache from local git mirrors (``--mirrors DIR`` holding ``<owner>+<name>/repo``) or,
without ``--mirrors``, from raw.githubusercontent.com at the recorded commit.

Every finding is looked up in ``benchmarks/field_review.json`` (``{"file:line:code": {"verdict": "true"|"false",
"why": ...}}``). Printed: findings per file with their verdicts, precision (findings judged true / all findings) at
default severity and with the preview rules, the findings nobody has judged yet (ready-to-paste entries), and
counts per rule. The engine runs in-process, so ``PYTHONPATH=<worktree>/src`` picks the code under test.

``--library`` instead runs the default rules over the library precision corpus that tests/precision uses (the
installed accelerate, peft, trl, transformers' trainer.py / modeling_utils.py) and compares with that code's own
``tests/precision/review.json``, without writing anything next to the code under test.

    python benchmarks/field_precision.py                 # default + preview rules, verdicts, precision
    python benchmarks/field_precision.py --populate --mirrors /work/.mirror
    python benchmarks/field_precision.py --library
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "field_scripts.json"
REVIEW = HERE / "field_review.json"
DEFAULT_CACHE = "/work/fieldscripts"


def cache_name(repo: str, path: str) -> str:
    return f"{repo.replace('/', '__')}__{path.replace('/', '__')}"


def load_scripts() -> list[dict]:
    return json.loads(SCRIPTS.read_text(encoding="utf-8"))["scripts"]


def cache_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("GPUDOCTOR_FIELD_SCRIPTS") or DEFAULT_CACHE)


# ------------------------------------------------------------------------------------------------ cache


def populate(cache: Path, mirrors: Path | None) -> int:
    cache.mkdir(parents=True, exist_ok=True)
    failed = 0
    for s in load_scripts():
        target = cache / cache_name(s["repo"], s["path"])
        if target.exists():
            continue
        try:
            if mirrors is not None:
                git_dir = mirrors / s["repo"].replace("/", "+") / "repo"
                data = subprocess.run(
                    ["git", "-C", str(git_dir), "show", f"{s['commit']}:{s['path']}"],
                    check=True, capture_output=True,
                ).stdout
            else:
                url = f"https://raw.githubusercontent.com/{s['repo']}/{s['commit']}/{s['path']}"
                with urllib.request.urlopen(url, timeout=30) as response:
                    data = response.read()
        except (OSError, subprocess.CalledProcessError) as exc:
            failed += 1
            print(f"could not fetch {s['repo']}:{s['path']}@{s['commit'][:8]}: {exc}", file=sys.stderr)
            continue
        target.write_bytes(data)
    present = sum((cache / cache_name(s["repo"], s["path"])).exists() for s in load_scripts())
    print(f"{present}/{len(load_scripts())} scripts in {cache}" + (f", {failed} failed" if failed else ""))
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------ field run


def run_field(cache: Path, jobs: int, show_messages: bool) -> int:
    from gpudoctor.check.config import Config
    from gpudoctor.check.engine import check_paths
    from gpudoctor.check.registry import rule_by_code

    if not cache.is_dir():
        print(
            f"field-script cache {cache} does not exist: fill it with\n"
            f"  python benchmarks/{Path(__file__).name} --populate [--mirrors DIR] --cache {cache}\n"
            "or point --cache / $GPUDOCTOR_FIELD_SCRIPTS at an existing one.",
            file=sys.stderr,
        )
        return 2
    scripts = load_scripts()
    files = [cache / cache_name(s["repo"], s["path"]) for s in scripts]
    missing = [f.name for f in files if not f.exists()]
    files = [f for f in files if f.exists()]
    if missing:
        print(f"warning: {len(missing)} listed scripts are not in {cache} (run --populate): {', '.join(missing[:5])}"
              + (" ..." if len(missing) > 5 else ""), file=sys.stderr)
    review = json.loads(REVIEW.read_text(encoding="utf-8")) if REVIEW.exists() else {}
    review = {k: v for k, v in review.items() if not k.startswith("_")}
    malformed = [k for k, v in review.items()
                 if k.count(":") < 2 or v.get("verdict") not in ("true", "false") or not str(v.get("why", "")).strip()]
    if malformed:
        print(f"{REVIEW.name}: entries need a 'file:line:code' key, verdict true|false and a why: {malformed[:5]}",
              file=sys.stderr)
        return 2

    import gpudoctor

    print(f"engine: {Path(gpudoctor.__file__).parent}")
    result = check_paths([str(f) for f in files], Config(root=cache, preview=True), jobs=jobs)
    by_file: dict[str, list] = defaultdict(list)
    rows = []  # (key, finding, preview, verdict)
    for finding in result.findings:
        name = Path(finding.path).name + (f"[cell {finding.cell}]" if finding.cell is not None else "")
        key = f"{name}:{finding.line}:{finding.code}"
        rule = rule_by_code(finding.code)
        preview = bool(getattr(rule, "preview", False))
        verdict = review.get(key, {}).get("verdict")
        rows.append((key, finding, preview, verdict))
        by_file[name].append(rows[-1])

    print(f"\n{len(files)} scripts checked, {len(result.findings)} findings "
          f"({sum(not r[2] for r in rows)} at default severity, {sum(r[2] for r in rows)} from preview rules)")
    for error in result.errors:
        print(f"  not checked: {error}")
    print()
    for name in sorted(by_file):
        print(name)
        for key, f, preview, verdict in by_file[name]:
            tag = {"true": "TRUE ", "false": "FALSE", None: "  ?  "}.get(verdict, verdict)
            print(f"  [{tag}] {f.line}:{f.column} {f.code} {f.severity.value}{' (preview)' if preview else ''} {f.name}")
            if show_messages or verdict is None:
                print(f"          {f.message.splitlines()[0][:200]}")
            if verdict is not None and review[key].get("why"):
                print(f"          why: {review[key]['why'][:200]}")

    def precision(selected) -> str:
        if not selected:
            return "no findings"
        true = sum(r[3] == "true" for r in selected)
        false = sum(r[3] == "false" for r in selected)
        unjudged = sum(r[3] is None for r in selected)
        return (f"{true}/{len(selected)} = {true / len(selected):.3f} true"
                f" ({false} false, {unjudged} not yet judged)")

    print("\nprecision (judged true / all findings)")
    print(f"  default severity : {precision([r for r in rows if not r[2]])}")
    print(f"  with --preview   : {precision(rows)}")

    per_rule: dict[str, Counter] = defaultdict(Counter)
    for key, f, preview, verdict in rows:
        per_rule[f.code + (" (preview)" if preview else "")][verdict or "unjudged"] += 1
    print("\nfindings per rule (true / false / unjudged)")
    for code in sorted(per_rule):
        c = per_rule[code]
        print(f"  {code:18} {c['true']:3} / {c['false']:3} / {c['unjudged']:3}")

    unjudged = [r for r in rows if r[3] is None]
    if unjudged:
        print(f"\n{len(unjudged)} finding(s) without a verdict in {REVIEW.name}; judge them and add:")
        print(json.dumps({key: {"verdict": "?", "why": "?", "message": f.message.splitlines()[0][:300]}
                          for key, f, _, _ in unjudged}, indent=1, ensure_ascii=False))
    stale = sorted(set(review) - {r[0] for r in rows})
    if stale:
        print(f"\n{len(stale)} review entr{'y' if len(stale) == 1 else 'ies'} with no finding in this run "
              f"(fixed, moved, or a different code under test): {', '.join(stale[:8])}" + (" ..." if len(stale) > 8 else ""))
    false_default = [r for r in rows if r[3] == "false" and not r[2]]
    return 1 if (unjudged or false_default) else 0


# ------------------------------------------------------------------------------------------------ library corpus


def run_library(jobs: int) -> int:
    """The corpus of tests/precision/test_precision.py, checked without pytest (which would write caches next
    to the code under test), against that code's own review file."""
    import importlib.util
    import gpudoctor
    from gpudoctor.check.config import Config
    from gpudoctor.check.engine import check_paths

    dirs = {}
    for name in ("accelerate", "peft", "trl", "transformers"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            print(f"{name} is not installed: the library corpus needs it", file=sys.stderr)
            return 2
        dirs[name] = Path(list(spec.submodule_search_locations)[0])
    site = dirs["accelerate"].parent
    paths = [dirs["accelerate"], dirs["peft"], dirs["trl"], dirs["transformers"] / "trainer.py",
             dirs["transformers"] / "modeling_utils.py"]
    review_file = Path(gpudoctor.__file__).resolve().parents[2] / "tests" / "precision" / "review.json"
    review = {}
    if review_file.exists():
        review = {(e["path"], e["line"], e["code"]): e for e in json.loads(review_file.read_text())["findings"]}
    print(f"engine: {Path(gpudoctor.__file__).parent}\nreview: {review_file}")
    result = check_paths([str(p) for p in paths if p.exists()], Config(root=site), jobs=jobs)
    checked = sum(1 for r in result.files if not r.skipped)
    print(f"{len(result.files)} files ({checked} parsed), {len(result.findings)} findings, {len(result.errors)} errors")
    for error in result.errors:
        print(f"  error: {error}")
    bad = 0
    for f in result.findings:
        rel = Path(f.path).resolve().relative_to(site.resolve()).as_posix()
        entry = review.get((rel, f.line, f.code))
        verdict = entry["verdict"] if entry else "UNREVIEWED"
        bad += verdict in ("UNREVIEWED", "false-positive")
        print(f"  [{verdict}] {rel}:{f.line} {f.code} {f.severity.value}: {f.message.splitlines()[0][:160]}")
    return 1 if (bad or result.errors) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", help=f"folder of cached scripts (default $GPUDOCTOR_FIELD_SCRIPTS or {DEFAULT_CACHE})")
    parser.add_argument("--populate", action="store_true", help="fetch the listed scripts into the cache, then stop")
    parser.add_argument("--mirrors", type=Path, help="with --populate: folder of git mirrors <owner>+<name>/repo")
    parser.add_argument("--library", action="store_true", help="check the library precision corpus instead")
    parser.add_argument("--messages", action="store_true", help="print every finding's message")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    if args.populate:
        return populate(cache_dir(args.cache), args.mirrors)
    if args.library:
        return run_library(args.jobs)
    return run_field(cache_dir(args.cache), args.jobs, args.messages)


if __name__ == "__main__":
    sys.exit(main())
