"""Assemble a rank's report (a JSON-able dict, see schema.md) and render merged reports with rich."""

from __future__ import annotations

import json
import os
import sys
import time

from gpudoctor.trace.frames import short_path

SCHEMA = "gpudoctor.trace/1"


def build_report(probe, exc: BaseException | None = None, *, exit_code: int | None = None, argv: list[str] | None = None) -> dict:
    """Everything the probe knows. Each section is guarded: a probe bug costs a section, never the run."""
    report: dict = {
        "schema": SCHEMA,
        "rank": _env_int("RANK"),
        "local_rank": _env_int("LOCAL_RANK"),
        "world_size": _env_int("WORLD_SIZE"),
        "pid": os.getpid(),
        "argv": list(argv if argv is not None else sys.argv),
        "mode": "deep" if probe.deep else "default",
        "exit_code": exit_code,
        "status": "failed" if exc is not None else "ok",
        "failure": None,
        "findings": [],
        "placement": [],
        "memory": None,
        "stats": {"module_calls": probe.forward_calls, "optimizer_steps": probe.steps, "models": [type(m).__name__ for m in probe.root_models()]},
        "probe_errors": probe.probe_errors,
        "time": time.time(),
    }
    sections = []
    if exc is not None:
        from gpudoctor.trace.diagnose import diagnose_exception

        sections.append(("failure", lambda: diagnose_exception(exc, probe)))
    from gpudoctor.trace.findings import placement, silent_findings
    from gpudoctor.trace.memory import peak_memory

    sections += [("findings", lambda: silent_findings(probe)), ("placement", lambda: placement(probe)), ("memory", peak_memory)]
    simulation = sys.modules.get("gpudoctor.simulate.boot")
    if simulation is not None and simulation.active() is not None:
        sections.append(("simulation", simulation.report_section))
    for key, build in sections:
        try:
            report[key] = build()
        except Exception as probe_exc:  # never let the probe hide the user's error
            probe._record_error(f"building report section {key!r}", probe_exc)
    report["probe_errors"] = list(probe.probe_errors)
    return report


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.lstrip("-").isdigit() else None


def merge(reports: list[dict], *, command: list[str], exit_code: int) -> dict:
    reports = sorted(reports, key=lambda r: (r.get("rank") if r.get("rank") is not None else -1, r.get("pid", 0)))
    return {"schema": SCHEMA, "command": command, "exit_code": exit_code, "ranks": reports}


def write_json(merged: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(merged, fh, indent=2, default=str)


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------

def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _rank_label(report: dict) -> str:
    rank = report.get("rank")
    return f"rank {rank}" if rank is not None else f"pid {report.get('pid')}"


def render(merged: dict, console=None) -> None:
    from rich.console import Console

    console = console or Console(stderr=True)
    ranks = merged.get("ranks", [])
    if not ranks:
        console.print("[yellow]gpudoctor trace: no Python process reported (did the program start?)[/]")
        return
    console.rule("[bold]gpudoctor trace[/]")
    failures = _group([r for r in ranks if r.get("failure")], lambda r: json.dumps(_failure_key(r["failure"]), sort_keys=True, default=str))
    for group in failures:
        _render_failure(console, group[0]["failure"], [_rank_label(r) for r in group] if len(ranks) > 1 else [])
    findings = _group([(r, f) for r in ranks for f in r.get("findings") or []], lambda rf: rf[1]["id"] + rf[1]["title"])
    if findings:
        console.print()
        console.print("[bold]Silent problems[/]")
        for group in findings:
            _render_finding(console, group[0][1], [_rank_label(r) for r, _ in group] if len(ranks) > 1 else [])
    for report in ranks:
        _render_summary(console, report, len(ranks) > 1)
    _render_static(console, merged.get("static"))
    errors = [e for r in ranks for e in r.get("probe_errors") or []]
    if errors:
        console.print(f"[dim]probe notes ({len(errors)}): {errors[0]}[/]")
    verdict = "failed" if any(r.get("failure") for r in ranks) else "finished"
    code = merged.get("exit_code")
    style = "red" if verdict == "failed" or code else "green"
    n_find = sum(len(r.get("findings") or []) for r in ranks)
    console.rule(f"[bold {style}]{verdict}, exit code {code}; {n_find} silent problem(s)[/]")


def _render_static(console, static: dict | None) -> None:
    """One line per finding of ``gpudoctor check`` on the traced script(s)."""
    if not static or not static.get("paths"):
        return
    from rich.markup import escape

    findings = static.get("findings") or []
    names = ", ".join(os.path.basename(p) for p in static["paths"])
    console.print()
    if not findings:
        console.print(f"[bold]Static check[/] of {escape(names)}: [green]nothing found[/]")
        return
    console.print(f"[bold]Static check[/] of {escape(names)} ([dim]gpudoctor check[/]): {len(findings)} finding(s)")
    for f in findings:
        console.print(
            f"  {escape(os.path.basename(f['path']))}:{f['line']}:{f['column']} [bold]{f['code']}[/] {f['severity']} "
            f"[dim]{f['name']}[/] — {escape(_first_clause(f['message']))}",
            highlight=False,
        )
    console.print("  [dim]details and fixes: gpudoctor check " + escape(" ".join(static["paths"])) + "[/]")


def _first_clause(message: str, limit: int = 200) -> str:
    clause = message.split("; ")[0]
    if len(clause) <= limit:
        return clause
    return clause[: limit - 1].rsplit(" ", 1)[0] + " …"


def _group(items, key):
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def _failure_key(failure: dict) -> dict:
    return {"kind": failure.get("kind"), "cause": (failure.get("cause") or {}).get("id"), "module": failure.get("module"),
            "op": failure.get("op"), "message": failure["exception"]["message"][:200]}


def _render_failure(console, failure: dict, ranks: list[str]) -> None:
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    exc = failure["exception"]
    kind = {"device_mismatch": "device mismatch", "meta_tensor": "meta tensor", "dtype_mismatch": "dtype mismatch",
            "dataparallel": "DataParallel placement", "optimizer_state": "optimizer state placement", "oom": "out of memory",
            "other": "error"}.get(failure["kind"], failure["kind"])
    title = f"[bold red]{kind}[/] during [bold]{failure['phase'].replace('_', ' ')}[/]" + (f"  [dim]({', '.join(ranks)})[/]" if ranks else "")
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column()
    facts.add_row("error", f"[red]{escape(exc['type'])}[/]: {escape(_shorten(exc['message'], 300))}")
    module = failure.get("module")
    if module:
        where = module.get("op_module") or module["path"]
        root = module.get("root")
        shown = f"{root} › {where}" if root and where else (where or root or module["class"])
        facts.add_row("module", f"{escape(shown)}  [dim]({escape(module['class'])})[/]")
    op = failure.get("op")
    if op:
        facts.add_row("op", f"{escape(op['name'])}, argument [bold]{escape(op['argument'])}[/] on {escape(op['offending_device'])} "
                      f"(the others on {escape(op['common_device'])})")
    frame = failure.get("user_frame")
    if frame:
        code = f"\n[cyan]{escape(frame['code'])}[/]" if frame.get("code") else ""
        facts.add_row("your code", f"{escape(short_path(frame['file']))}:{frame['line']} in {escape(frame['function'])}{code}")
    parts: list = [facts]
    if failure.get("tensors"):
        table = Table(show_header=True, header_style="bold", box=None, pad_edge=False, title="tensors in the failing op",
                      title_justify="left", title_style="bold")
        for col in ("argument", "device", "dtype", "shape", "origin"):
            table.add_column(col)
        for t in failure["tensors"]:
            dev_style = "red" if op and t["device"] == op["offending_device"] else ""
            table.add_row(escape(t["argument"]), f"[{dev_style}]{escape(t['device'])}[/]" if dev_style else escape(t["device"]),
                          t["dtype"], "×".join(map(str, t["shape"])) or "scalar", escape(t["origin_text"]))
        parts += ["", table]
    cause = failure.get("cause")
    if cause:
        verdict = Table.grid(padding=(0, 2))
        verdict.add_column(style="bold", no_wrap=True)
        verdict.add_column()
        rule = f"  [magenta]{cause['rule']}[/]" if cause.get("rule") else ""
        verdict.add_row("[yellow]cause[/]", f"[bold]{escape(cause['title'])}[/]{rule}\n{escape(cause['explanation'])}")
        for ev in cause.get("evidence", [])[:6]:
            verdict.add_row("", f"[dim]• {escape(ev)}[/]")
        verdict.add_row("[green]fix[/]", escape(cause["fix"]))
        if cause.get("location"):
            verdict.add_row("[green]here[/]", _location_text(cause["location"]))
        parts += ["", verdict]
    elif failure["kind"] not in ("oom", "other"):
        parts += ["", "[yellow]no known root cause matched; the tensors above show what met where[/]"]
    if failure.get("oom"):
        parts += ["", *_oom_lines(failure["oom"])]
    from rich.console import Group

    console.print(Panel(Group(*parts), title=title, title_align="left", border_style="red"))


def _oom_lines(oom: dict) -> list:
    from rich.markup import escape
    from rich.table import Table

    lines: list = [f"[bold]device[/]  {escape(oom['device'])}"]
    for c in oom["classification"]:
        lines.append(f"[bold yellow]why[/]     {escape(c['title'])}: {escape(c['detail'])}")
    table = Table(title="memory by category at the failure", box=None, header_style="bold", title_justify="left")
    categories = ["weights", "buffers", "gradients", "optimizer_state", "activations_and_other"]
    table.add_column("device")
    for c in categories:
        table.add_column(c.replace("_", " "), justify="right")
    for device, row in oom["memory_by_category"].items():
        table.add_row(device, *[_fmt_bytes(row.get(c)) if c in row else "n/a" for c in categories])
    lines += ["", table]
    if oom["options"]:
        opts = Table(title="options (savings estimated from this model)", box=None, header_style="bold", title_justify="left")
        opts.add_column("option")
        opts.add_column("saves", justify="right")
        opts.add_column("how")
        for o in oom["options"]:
            opts.add_row(escape(o["title"]), _fmt_bytes(o["saving_bytes"]), escape(o["detail"]))
        lines += ["", opts]
    return lines


def _render_finding(console, finding: dict, ranks: list[str]) -> None:
    from rich.markup import escape

    color = {"error": "red", "warning": "yellow", "info": "blue"}.get(finding["severity"], "white")
    rule = f" [magenta]{finding['rule']}[/]" if finding.get("rule") else ""
    where = f" [dim]({', '.join(ranks)})[/]" if ranks else ""
    console.print(f" [{color}]●[/]{rule} [bold]{escape(finding['title'])}[/]{where}")
    console.print(f"   {escape(finding['detail'])}")
    if finding.get("items"):
        console.print(f"   [dim]{escape(', '.join(finding['items'][:8]))}{' …' if len(finding['items']) > 8 else ''}[/]")
    console.print(f"   [green]fix:[/] {escape(finding['fix'])}")
    if finding.get("location"):
        console.print(f"   [green]here:[/] {_location_text(finding['location'])}")


def _render_summary(console, report: dict, multi: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    label = f" — {_rank_label(report)}" if multi else ""
    for model in report.get("placement") or []:
        table = Table(title=f"placement: {model['model']}{' (hf_device_map)' if model['hf_device_map'] else ''}{label}",
                      title_justify="left", header_style="bold", box=None)
        for col, justify in (("device", "left"), ("params", "right"), ("weights", "right"), ("trainable", "right"), ("modules", "left")):
            table.add_column(col, justify=justify)
        for row in model["devices"]:
            mods = ", ".join(row["modules"][:6]) + (" …" if len(row["modules"]) > 6 else "")
            table.add_row(escape(row["device"]), f"{row['params']:,}", _fmt_bytes(row["bytes"]), f"{row['trainable']:,}", escape(mods))
        console.print()
        console.print(table)
    memory = report.get("memory")
    if memory:
        table = Table(title=f"peak memory{label}", title_justify="left", header_style="bold", box=None)
        table.add_column("device")
        table.add_column("peak allocated", justify="right")
        table.add_column("peak reserved", justify="right")
        table.add_column("total / rss", justify="right")
        for row in memory["devices"]:
            if "peak_rss" in row:
                table.add_row(row["device"], "", "", f"{_fmt_bytes(row['peak_rss'])} (RSS)")
            else:
                table.add_row(row["device"], _fmt_bytes(row.get("peak_allocated")), _fmt_bytes(row.get("peak_reserved")), _fmt_bytes(row.get("total")))
        console.print()
        console.print(table)
        for note in memory.get("notes", []):
            console.print(f"  [dim]{escape(note)}[/]")


def _location_text(location: dict) -> str:
    from rich.markup import escape

    code = f"  [cyan]{escape(location['code'])}[/]" if location.get("code") else ""
    return f"{escape(short_path(location['file']))}:{location['line']}{code}"


def _shorten(text: str, limit: int) -> str:
    text = text.strip()
    first = text.split("\n\n")[0]
    return first if len(first) <= limit else first[: limit - 1] + "…"
