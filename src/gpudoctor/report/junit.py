"""``--output-format junit``: JUnit XML for CI test dashboards.

One ``<testsuite name="gpudoctor">``; one ``<testcase>`` per file (``name`` and ``file`` = the path,
``classname`` = the path as a dotted name); each failing finding (error / warning) is a ``<failure>``
of that test case (``type`` = the rule code), an ``info`` finding goes to the case's ``<system-out>``;
a file that could not be checked has an ``<error>``. Passing files appear as passing test cases when the
caller passes ``files``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Iterable, Sequence

from gpudoctor.check.finding import Finding

# Characters XML 1.0 cannot carry (surrogates: a file name that is not UTF-8, as os.fsdecode keeps it).
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _clean(text: str) -> str:
    return _INVALID_XML.sub("\ufffd", text)


def _classname(path: str) -> str:
    name = path.replace("\\", "/")
    for suffix in (".ipynb", ".pyi", ".py"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return ".".join(p for p in name.split("/") if p not in ("", ".")) or path


def _error_path(error: str) -> str:
    match = re.match(r"^(.*?)(?:\[cell \d+\])?:(?:\d+:\d+:|\s)", error)
    return match.group(1) if match else error.split(":", 1)[0]


def render(findings: Sequence[Finding], errors: Sequence[str], files: Iterable[str] = ()) -> str:
    by_file: dict[str, list[Finding]] = {}
    for path in files:
        by_file.setdefault(path, [])
    for finding in sorted(findings, key=Finding.sort_key):
        by_file.setdefault(finding.path, []).append(finding)
    file_errors: dict[str, list[str]] = {}
    for error in errors:
        file_errors.setdefault(_error_path(error), []).append(error)
        by_file.setdefault(_error_path(error), [])

    suite = ET.Element("testsuite", name="gpudoctor")
    tests = failures = error_count = 0
    for path in sorted(by_file):
        tests += 1
        case = ET.SubElement(suite, "testcase", name=_clean(path), classname=_clean(_classname(path)), file=_clean(path), time="0")
        notes = []
        for finding in by_file[path]:
            summary = f"{finding.location()}: {finding.code} {finding.name}: {finding.message}"
            if not finding.severity.fails:
                notes.append(summary)
                continue
            failures += 1
            failure = ET.SubElement(
                case, "failure", message=_clean(f"{finding.code} {finding.name}: {finding.message}"), type=_clean(finding.code)
            )
            body = [summary]
            if finding.source_line:
                body.append(f"    {finding.source_line}")
            body += [f"note: {finding.location(related)}: {related.message}" for related in finding.related]
            if finding.fix_hint:
                body.append(f"fix: {finding.fix_hint}")
            failure.text = _clean("\n".join(body))
        for error in file_errors.get(path, ()):
            error_count += 1
            element = ET.SubElement(case, "error", message=_clean(error), type="gpudoctor.error")
            element.text = _clean(error)
        if notes:
            ET.SubElement(case, "system-out").text = _clean("\n".join(notes))
    for key, value in (("tests", tests), ("failures", failures), ("errors", error_count), ("skipped", 0), ("time", "0")):
        suite.set(key, str(value))
    root = ET.Element("testsuites", name="gpudoctor", tests=str(tests), failures=str(failures), errors=str(error_count), time="0")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
