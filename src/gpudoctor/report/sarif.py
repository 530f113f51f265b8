"""``--output-format sarif``: SARIF 2.1.0 for GitHub code scanning and other SARIF viewers.

One run; ``tool.driver.rules`` lists the rules the results reference (id, name, short and full
description from the rule doc, help text and ``helpUri``); each result has ``ruleId``/``ruleIndex``,
``level`` (error / warning / note), the message and a physical location (relative URI + 1-based region,
``endColumn`` exclusive as SARIF wants) and ``relatedLocations`` for the other lines of the evidence
chain (each with ``id``, a message and a region). Notebook findings name their cell in the message and in
``properties.cell``. Files that could not be checked become tool execution notifications.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import quote

from gpudoctor import __version__
from gpudoctor.check.finding import Finding, Severity

SCHEMA_URI = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def repository_url() -> Optional[str]:
    """The project's repository from its package metadata (``[project.urls]``), if it declares one.

    No URL is made up: without one, SARIF carries the rule docs inline (``help``) and no ``helpUri``.
    """
    from importlib import metadata

    try:
        entries = metadata.metadata("gpudoctor").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    for entry in entries:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("repository", "source", "homepage") and url.strip():
            return url.strip().rstrip("/")
    return None


def artifact_uri(path: str) -> str:
    """A relative path stays relative (posix, percent-encoded); an absolute one becomes a file URI.
    Percent-encoding works on the file name's bytes, so a name that is not UTF-8 (its bytes kept as
    surrogates by ``os.fsdecode``) still gets the exact URI."""
    absolute = Path(path).is_absolute()
    try:
        raw = path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no file name decoded to
        raw = path.encode("utf-8", "replace")
    parts = [p for p in raw.replace(os.sep.encode(), b"/").split(b"/") if p not in (b".", b"")]
    quoted = quote(b"/".join(parts), safe="/!$&'()*+,;=:@")
    return f"file:///{quoted}" if absolute else quoted


def _rule_entry(code: str, name: str, summary: str, doc: Optional[str]) -> dict:
    from gpudoctor.check.docs import sections

    entry: dict = {"id": code, "name": name, "shortDescription": {"text": summary or name}}
    if doc:
        parts = sections(doc)
        what = parts.get("What it does", "").strip()
        if what:
            entry["fullDescription"] = {"text": what}
        entry["help"] = {"text": doc, "markdown": doc}
    url = repository_url()
    if url:
        entry["helpUri"] = f"{url}/blob/main/rules/{code}-{name}.md"
    return entry


def _rules(findings: Sequence[Finding]) -> tuple[list[dict], dict[str, int]]:
    from gpudoctor.check.docs import read_doc
    from gpudoctor.check.registry import rule_by_code

    entries: list[dict] = []
    index: dict[str, int] = {}
    for finding in findings:
        if finding.code in index:
            continue
        rule = rule_by_code(finding.code)
        summary = rule.summary if rule is not None else finding.name
        doc = read_doc(finding.code, finding.name)
        entry = _rule_entry(finding.code, finding.name, summary, doc)
        entry["defaultConfiguration"] = {"level": LEVEL[rule.severity if rule is not None else finding.severity]}
        index[finding.code] = len(entries)
        entries.append(entry)
    return entries, index


def _result(finding: Finding, rule_index: int) -> dict:
    text = finding.message
    if finding.cell is not None:
        text = f"[cell {finding.cell}] {text}"
    if finding.fix_hint:
        text = f"{text}\nFix: {finding.fix_hint}"
    result: dict = {
        "ruleId": finding.code,
        "ruleIndex": rule_index,
        "level": LEVEL[finding.severity],
        "message": {"text": text},
        "locations": [{"physicalLocation": _physical(finding.path, finding)}],
    }
    if finding.related:
        result["relatedLocations"] = [_related(finding, index, related) for index, related in enumerate(finding.related, 1)]
    properties = {}
    if finding.cell is not None:
        properties["cell"] = finding.cell
    if finding.fix is not None:
        properties["fix"] = {"description": finding.fix.description, "applicability": finding.fix.applicability.value}
    if properties:
        result["properties"] = properties
    return result


def _physical(path: str, at) -> dict:
    """A physical location for a finding or one of its related locations (same fields)."""
    region = {
        "startLine": max(at.line, 1),
        "startColumn": max(at.column, 1),
        "endLine": max(at.end_line or at.line, 1),
        "endColumn": max(at.end_column or at.column + 1, 1),
    }
    if at.source_line:
        region["snippet"] = {"text": at.source_line}
    return {"artifactLocation": {"uri": artifact_uri(path)}, "region": region}


def _related(finding: Finding, index: int, related) -> dict:
    text = f"[cell {related.cell}] {related.message}" if related.cell is not None else related.message
    return {"id": index, "message": {"text": text}, "physicalLocation": _physical(finding.path, related)}


def render(findings: Sequence[Finding], errors: Sequence[str]) -> str:
    findings = sorted(findings, key=Finding.sort_key)
    rules, index = _rules(findings)
    run = {
        "tool": {
            "driver": {
                "name": "gpudoctor",
                "version": __version__,
                "semanticVersion": __version__,
                "rules": rules,
            }
        },
        "results": [_result(f, index[f.code]) for f in findings],
        "invocations": [
            {
                "executionSuccessful": not errors,
                "toolExecutionNotifications": [{"level": "error", "message": {"text": e}} for e in errors],
            }
        ],
        "columnKind": "unicodeCodePoints",
    }
    text = json.dumps({"$schema": SCHEMA_URI, "version": "2.1.0", "runs": [run]}, indent=2, ensure_ascii=False)
    # Texts that name an undecodable file carry surrogates, which UTF-8 cannot: the URIs keep the bytes.
    return _SURROGATE.sub("\ufffd", text)


_SURROGATE = re.compile("[\ud800-\udfff]")
