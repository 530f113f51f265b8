"""Run the trace quality cases (``[fsc]NN_*.py`` here) under ``gpudoctor trace --json`` and score the reports.

Each case declares what a correct report says in one header line::

    # case: {"kind": "failure"|"silent"|"clean", "exit": 1, "module": "model.embed_tokens", "cause": "batch_not_moved",
    #        "fix": ["batch", ".to("], "fix_not": [...], "rule": "GD413", "oom_first": ["chunk", ...]}

and marks the line the report must point to with a trailing ``# <- line`` comment. ``module: null`` means the report
must not claim a module (the failure happens in the user's own code). Shared by tests/trace/test_cases.py and
benchmarks/trace_quality.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

CASES_DIR = os.path.dirname(os.path.abspath(__file__))
_HEADER = re.compile(r"^# case: (\{.*\})\s*$", re.M)
_MARK = "# <- line"
SCORES = ("module", "line", "cause", "fix")


@dataclass
class Case:
    name: str
    path: str
    expect: dict
    line: int | None

    @property
    def kind(self) -> str:
        return self.expect["kind"]


@dataclass
class Outcome:
    case: Case
    scores: dict = field(default_factory=dict)  # module/line/cause/fix -> True/False (absent: not scored)
    problems: list[str] = field(default_factory=list)
    crashed: bool = False
    kept_program_behaviour: bool = True
    report: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def load_cases(names: list[str] | None = None) -> list[Case]:
    cases = []
    for filename in sorted(os.listdir(CASES_DIR)):
        if not re.match(r"^[fsc]\d\d_\w+\.py$", filename):
            continue
        name = filename[:-3]
        if names and name not in names:
            continue
        path = os.path.join(CASES_DIR, filename)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        match = _HEADER.search(text)
        if match is None:
            raise ValueError(f"{filename}: no '# case: {{...}}' header")
        lines = [i for i, line in enumerate(text.splitlines(), 1) if line.rstrip().endswith(_MARK)]
        cases.append(Case(name, path, json.loads(match.group(1)), lines[0] if lines else None))
    return cases


def run_case(case: Case, timeout: float = 300) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="gd-case-") as tmp:
        out = os.path.join(tmp, "report.json")
        proc = subprocess.run([sys.executable, "-m", "gpudoctor.trace.cli", "--json", out, "--no-check", case.path],
                              capture_output=True, text=True, timeout=timeout, cwd=tmp)
        merged = None
        if os.path.exists(out):
            with open(out, encoding="utf-8") as fh:
                merged = json.load(fh)
    return score(case, proc.returncode, proc.stderr, merged)


def score(case: Case, returncode: int, stderr: str, merged: dict | None) -> Outcome:
    outcome = Outcome(case)
    expect = case.expect
    if returncode != expect.get("exit", 0):
        outcome.kept_program_behaviour = False
        outcome.problems.append(f"exit code {returncode}, expected {expect.get('exit', 0)}")
    if case.kind == "failure" and not _traceback_first(stderr):
        outcome.kept_program_behaviour = False
        outcome.problems.append("the program's traceback is missing or altered")
    ranks = (merged or {}).get("ranks") or []
    if not ranks or "gpudoctor: could not" in stderr:
        outcome.crashed = True
        outcome.problems.append("no report")
        return outcome
    report = ranks[-1]
    outcome.report = report
    if any("building report section" in e for e in report.get("probe_errors") or []):
        outcome.crashed = True
        outcome.problems.append(f"report section failed: {report['probe_errors']}")
    failure = report.get("failure")
    findings = report.get("findings") or []
    if case.kind == "clean":
        loud = [f["id"] for f in findings if f.get("severity") in ("error", "warning")]
        _check(outcome, "cause", failure is None and not loud, f"control not clean: failure={_cause_id(failure)} findings={loud}")
        return outcome
    if case.kind == "silent":
        target = next((f for f in findings if f["id"] == expect["cause"]), None)
        _check(outcome, "cause", failure is None and target is not None and _rule_ok(expect, target),
               f"findings {[(f['id'], f.get('rule')) for f in findings]}, expected {expect['cause']} {expect.get('rule') or ''}")
        if "module" in expect:
            items = (target or {}).get("items") or []
            _check(outcome, "module", any(str(i).startswith(expect["module"]) for i in items), f"items {items}")
        if case.line is not None:
            _check(outcome, "line", _line_ok(case, (target or {}).get("location")), f"location {(target or {}).get('location')}")
        if "fix" in expect:
            _check(outcome, "fix", _fix_ok(expect, (target or {}).get("fix")), f"fix {(target or {}).get('fix')!r}")
        return outcome
    # failure
    if failure is None:
        outcome.problems.append("no failure section")
        for key in SCORES:
            if key == "cause" or key in expect or (key == "line" and case.line is not None):
                outcome.scores[key] = False
        return outcome
    cause = failure.get("cause") or {}
    _check(outcome, "cause", cause.get("id") == expect["cause"] and _rule_ok(expect, cause),
           f"cause {cause.get('id')} ({cause.get('rule')}), expected {expect['cause']}")
    if "module" in expect:
        shown = _module_shown(failure.get("module"))
        _check(outcome, "module", shown == expect["module"], f"module {shown!r}, expected {expect['module']!r}")
    if case.line is not None:
        where = cause.get("location") or failure.get("user_frame")
        _check(outcome, "line", _line_ok(case, where), f"line {where and (os.path.basename(where['file']), where['line'])}, "
                                                       f"expected {case.line}")
    if "fix" in expect:
        ok = _fix_ok(expect, cause.get("fix"))
        if ok and "oom_first" in expect:
            options = (failure.get("oom") or {}).get("options") or []
            ok = bool(options) and any(k in options[0]["id"] for k in expect["oom_first"])
            request = ((failure.get("oom") or {}).get("message_fields") or {}).get("requested") or 0
            small = [o["id"] for o in options if request and o["saving_bytes"] < 0.01 * request]
            if not ok or small:
                outcome.problems.append(f"oom options {[o['id'] for o in options]} (under 1% of the request: {small})")
                ok = False
        _check(outcome, "fix", ok, f"fix {cause.get('fix')!r}")
    return outcome


def _check(outcome: Outcome, key: str, ok: bool, detail: str) -> None:
    outcome.scores[key] = bool(ok)
    if not ok:
        outcome.problems.append(f"{key}: {detail}")


def _cause_id(failure):
    return ((failure or {}).get("cause") or {}).get("id") if failure else None


def _rule_ok(expect: dict, found: dict) -> bool:
    return "rule" not in expect or found.get("rule") == expect["rule"]


def _module_shown(module: dict | None) -> str | None:
    if not module:
        return None
    return module.get("op_module") or module.get("path") or module.get("class")


def _line_ok(case: Case, where: dict | None) -> bool:
    return bool(where) and os.path.basename(where.get("file") or "") == os.path.basename(case.path) and where.get("line") == case.line


def _fix_ok(expect: dict, fix: str | None) -> bool:
    text = (fix or "").lower()
    return bool(text) and all(k.lower() in text for k in expect.get("fix", [])) and not any(
        k.lower() in text for k in expect.get("fix_not", []))


def _traceback_first(stderr: str) -> bool:
    """Python's own traceback, untouched, before gpudoctor's report."""
    start = stderr.find("Traceback (most recent call last):")
    report = stderr.find("gpudoctor trace")
    if start < 0 or (0 <= report < start):
        return False
    return "gpudoctor/trace/" not in stderr[start:report if report > 0 else None]


def run_all(cases: list[Case], workers: int | None = None) -> list[Outcome]:
    """Bounded parallelism: each case is a separate Python process importing torch and transformers."""
    workers = workers or max(1, min(4, (os.cpu_count() or 2) // 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(run_case, cases))


def totals(outcomes: list[Outcome]) -> dict:
    out = {}
    for key in SCORES:
        scored = [o.scores[key] for o in outcomes if key in o.scores]
        out[key] = (sum(scored), len(scored))
    controls = [o for o in outcomes if o.case.kind == "clean"]
    out["controls_clean"] = (sum(o.scores.get("cause", False) for o in controls), len(controls))
    out["crashes"] = sum(o.crashed for o in outcomes)
    out["behaviour_kept"] = (sum(o.kept_program_behaviour for o in outcomes), len(outcomes))
    return out
