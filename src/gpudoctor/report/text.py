"""Findings for people: ``path:line:col: CODE [severity] name``, the message, the source line with a
caret underline, a ``= note: path:line:col: ...`` line per related location, and the fix — then a
summary line. Rendered with rich (colour only on a terminal)."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from gpudoctor.check.finding import Finding, Severity

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "bold yellow", Severity.INFO: "bold cyan"}


def render(findings: Sequence[Finding], errors: Sequence[str], console: Console, files_checked: int) -> None:
    for finding in findings:
        render_one(finding, console)
    for error in errors:
        console.print(f"[bold red]error[/]: {escape(error)}", highlight=False)
    summary(findings, errors, console, files_checked)


def render_one(finding: Finding, console: Console) -> None:
    style = _STYLE[finding.severity]
    fixable = " [dim]\\[*][/]" if finding.fix is not None else ""
    console.print(
        f"[bold]{escape(finding.location())}[/]: [{style}]{finding.code}[/] "
        f"[{style}]{finding.severity.value}[/] [dim]{finding.name}[/]{fixable}",
        highlight=False,
    )
    # Plain indented lines: a terminal wraps them, a pipe or file keeps them whole (grep-able).
    console.print("  " + finding.message, highlight=False, markup=False)
    if finding.source_line:
        gutter = str(finding.line)
        pad = " " * len(gutter)
        line = finding.source_line.rstrip("\n")
        start = max(finding.column - 1, 0)
        end = finding.end_column - 1 if finding.end_line == finding.line else len(line)
        width = max(end - start, 1)
        console.print(f"  [blue]{pad} |[/]", highlight=False)
        console.print(f"  [blue]{gutter} |[/] {escape(line)}", highlight=False)
        console.print(f"  [blue]{pad} |[/] {' ' * start}[{style}]{'^' * width}[/]", highlight=False)
    for related in finding.related:
        # The same path:line:col form as the header, so an editor or grep finds the chain from any line.
        console.print(
            Text.assemble("  ", ("= note: ", "blue"), f"{finding.location(related)}: {related.message}"), highlight=False
        )
    if finding.fix_hint:
        console.print(Text.assemble("  ", ("= fix: ", "green"), finding.fix_hint), highlight=False)
    console.print()


def summary(findings: Sequence[Finding], errors: Sequence[str], console: Console, files_checked: int) -> None:
    if not findings and not errors:
        console.print(f"[bold green]All checks passed![/] [dim]({files_checked} file{'s' if files_checked != 1 else ''} checked)[/]")
        return
    counts = Counter(f.severity for f in findings)
    parts = [f"{counts[s]} {s.value}{'s' if counts[s] != 1 and s is not Severity.INFO else ''}" for s in Severity if counts[s]]
    files = len({f.path for f in findings})
    text = f"Found {len(findings)} finding{'s' if len(findings) != 1 else ''}"
    if parts:
        text += " (" + ", ".join(parts) + ")"
    text += f" in {files} file{'s' if files != 1 else ''} ({files_checked} checked)."
    fixable = sum(1 for f in findings if f.fix is not None)
    if fixable:
        text += f" [dim]{fixable} fixable with --fix (or --unsafe-fixes).[/]"
    console.print(f"[bold]{text}[/]", highlight=False)
    if errors:
        console.print(f"[bold red]{len(errors)} file{'s' if len(errors) != 1 else ''} could not be checked.[/]")


def statistics(findings: Sequence[Finding], console: Console) -> None:
    counts = Counter((f.code, f.name) for f in findings)
    fixable = Counter(f.code for f in findings if f.fix is not None)
    for (code, name), count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        mark = "[*]" if fixable[code] else "   "
        console.print(f"{count:>6}  {code}  {mark} {name}", highlight=False, markup=False)
