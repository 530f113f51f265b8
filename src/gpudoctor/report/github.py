"""``--output-format github``: GitHub Actions workflow commands, one annotation per finding:

    ::error file=train.py,line=12,col=5,endLine=12,endColumn=20,title=GD101 prepare-dispatched-model::message

Escaping follows the Actions runner: in the message ``%``, CR and LF are percent-encoded; in property
values ``:`` and ``,`` as well. ``error`` / ``warning`` findings become ``::error`` / ``::warning``,
``info`` ``::notice``. A notebook finding is annotated on the file with the cell in the message (a line
number inside a cell means nothing in the JSON file).
"""

from __future__ import annotations

from typing import Sequence

from gpudoctor.check.finding import Finding, Severity

COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(finding: Finding) -> str:
    properties = [("file", finding.path)]
    message = finding.message
    if finding.cell is not None:
        message = f"[cell {finding.cell}]:{finding.line}:{finding.column}: {message}"
    else:
        properties += [("line", str(finding.line)), ("col", str(finding.column))]
        if finding.end_line:
            properties += [("endLine", str(finding.end_line)), ("endColumn", str(finding.end_column))]
    properties.append(("title", f"{finding.code} {finding.name}"))
    for related in finding.related:
        message = f"{message}\nNote: {finding.location(related)}: {related.message}"
    if finding.fix_hint:
        message = f"{message}\nFix: {finding.fix_hint}"
    props = ",".join(f"{key}={escape_property(value)}" for key, value in properties)
    return f"::{COMMAND[finding.severity]} {props}::{escape_data(message)}"


def render(findings: Sequence[Finding], errors: Sequence[str]) -> str:
    lines = [annotation(f) for f in sorted(findings, key=Finding.sort_key)]
    lines += [f"::error title=gpudoctor::{escape_data(error)}" for error in errors]
    return "\n".join(lines) + ("\n" if lines else "")
