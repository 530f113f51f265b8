"""``gpudoctor check`` / ``rule`` / ``clean``: options -> engine -> reporters -> exit code."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console

from gpudoctor.check import versions
from gpudoctor.check.config import Config, ConfigError

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


def load_config(args) -> Config:
    config = Config.from_file(Path(args.config)) if args.config else Config.discover()
    if args.select is not None:
        config.select = args.select
    if args.extend_select:
        config.select = list(config.select or ["GD"]) + args.extend_select
    config.ignore = list(config.ignore) + args.ignore
    config.exclude = list(config.exclude) + args.exclude
    config.preview = config.preview or args.preview
    config.force_exclude = config.force_exclude or args.force_exclude
    versions.set_targets(config.target_versions)
    _assume_hardware(config, getattr(args, "gpus", None))
    return config


def _assume_hardware(config: Config, option) -> None:
    """--gpus, else [tool.gpudoctor] gpus, else the local GPUs (NVML), else unknown (None)."""
    from gpudoctor import hardware

    try:
        if option:
            config.gpus = option
            gpus = hardware.parse_gpus(option, f"--gpus {option}")
        elif config.gpus:
            gpus = hardware.parse_gpus(config.gpus, "[tool.gpudoctor] gpus")
        else:
            gpus = hardware.local_gpus()
            config.gpus = gpus.spec if gpus else None  # part of the cache key: another machine, another result
    except hardware.HardwareError as error:
        raise ConfigError(f"--gpus: {error}") from error
    hardware.set_assumed(gpus)


def run_check(args) -> int:
    from gpudoctor.check.engine import check_paths
    from gpudoctor.check.registry import known_codes

    stdout = Console(highlight=False, soft_wrap=True)
    stderr = Console(stderr=True, highlight=False)
    try:
        config = load_config(args)
    except ConfigError as error:
        stderr.print(f"[bold red]error[/]: {error}")
        return EXIT_ERROR
    known = known_codes()
    for code in [*(config.select or []), *config.ignore]:
        if not any(k.startswith(code.upper()) for k in known):
            stderr.print(f"[bold red]error[/]: unknown rule code or prefix {code!r} (see `gpudoctor rule --all`)")
            return EXIT_ERROR

    jobs = args.jobs if args.jobs > 0 else (os.cpu_count() or 1)
    if args.fix or args.diff:
        from gpudoctor.check import fixes

        result = fixes.run_fixes(
            args.paths, config, unsafe=args.unsafe_fixes, diff_only=args.diff, console=stdout, jobs=jobs, use_cache=not args.no_cache
        )
        if args.diff:
            return _report_diff(result, stderr)
    else:
        result = check_paths(args.paths, config, jobs=jobs, use_cache=not args.no_cache)

    findings = result.findings
    errors = result.errors
    checked = sum(1 for r in result.files if not r.error)
    output = _render(args, findings, errors, checked, stdout, files=[r.path for r in result.files if not r.error and not r.skipped])
    if output is not None:
        if args.output_file:
            Path(args.output_file).write_text(output, encoding="utf-8")
        else:
            sys.stdout.write(output if output.endswith("\n") else output + "\n")
    if args.fix and not args.quiet:
        # Machine-readable formats own stdout; the fix summary then goes to stderr.
        summary_console = stdout if args.output_format == "text" and not args.output_file and not args.statistics else stderr
        summary_console.print(_fixed_line(result), highlight=False)
    if errors and not findings:
        return EXIT_ERROR
    if args.exit_zero:
        return EXIT_CLEAN
    return EXIT_FINDINGS if any(f.severity.fails for f in findings) else (EXIT_ERROR if errors else EXIT_CLEAN)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _fixed_line(result) -> str:
    remaining = sum(1 for f in result.findings)
    text = f"Fixed {_plural(result.fixed, 'finding')}"
    if result.changed:
        text += f" in {_plural(len(result.changed), 'file')}"
    return f"[bold]{text}[/] ({remaining} remaining)."


def _report_diff(result, stderr: Console) -> int:
    """``--diff``: the diff went to stdout; say what would be fixed on stderr. Like ruff, exit 1 when
    there is something to fix, 0 when there is nothing, 2 when a file could not be checked or fixed."""
    for error in result.errors:
        stderr.print(f"[bold red]error[/]: {error}", highlight=False)
    if result.fixed:
        stderr.print(f"Would fix {_plural(result.fixed, 'finding')} in {_plural(len(result.changed), 'file')}.", highlight=False)
    else:
        stderr.print("No fixes available.", highlight=False)
    if result.errors:
        return EXIT_ERROR
    return EXIT_FINDINGS if result.fixed else EXIT_CLEAN


def _render(args, findings, errors, checked, console: Console, files=()):
    fmt = args.output_format
    if args.statistics:
        from gpudoctor.report import text

        if fmt == "json":
            from collections import Counter

            counts = Counter((f.code, f.name) for f in findings)
            return json.dumps([{"code": c, "name": n, "count": k} for (c, n), k in sorted(counts.items(), key=lambda i: (-i[1], i[0]))], indent=2)
        text.statistics(findings, console)
        return None
    if fmt == "text":
        from gpudoctor.report import text

        if args.output_file:
            file_console = Console(file=open(args.output_file, "w", encoding="utf-8"), highlight=False, no_color=True, width=120)
            text.render(findings, errors, file_console, checked)
            return None
        if args.quiet:
            for finding in findings:
                text.render_one(finding, console)
            for error in errors:
                console.print(f"[bold red]error[/]: {error}")
        else:
            text.render(findings, errors, console, checked)
        return None
    if fmt == "json":
        from gpudoctor.report import json_report

        return json_report.render(findings, errors)
    if fmt == "junit":
        from gpudoctor.report import junit

        return junit.render(findings, errors, files=files)
    import importlib

    module = importlib.import_module(f"gpudoctor.report.{fmt}")
    return module.render(findings, errors)


def run_rule(args) -> int:
    from gpudoctor.check.docs import read_doc
    from gpudoctor.check.registry import all_rules, rule_by_code

    from rich.markdown import Markdown
    from rich.table import Table

    console = Console(highlight=False)
    if args.all or not args.code:
        rules = all_rules()
        if args.output_format == "json":
            print(json.dumps([_rule_dict(r) for r in rules], indent=2))
            return EXIT_CLEAN
        table = Table(title="gpudoctor rules", show_lines=False)
        table.add_column("Code", style="bold", no_wrap=True)
        table.add_column("Name", no_wrap=True)
        table.add_column("Severity")
        table.add_column("Fix")
        table.add_column("Status")
        table.add_column("Summary")
        for r in rules:
            table.add_row(r.code, r.name, r.severity.value, r.fixable or "", "preview" if r.preview else "stable", r.summary)
        console.print(table)
        return EXIT_CLEAN
    rule = rule_by_code(args.code)
    if rule is None:
        Console(stderr=True).print(f"[bold red]error[/]: unknown rule {args.code!r} (see `gpudoctor rule --all`)")
        return EXIT_ERROR
    if args.output_format == "json":
        data = _rule_dict(rule)
        data["doc"] = read_doc(rule.code, rule.name)
        print(json.dumps(data, indent=2))
        return EXIT_CLEAN
    doc = read_doc(rule.code, rule.name)
    console.print(Markdown(doc) if doc else f"{rule.code} {rule.name}: {rule.summary}")
    return EXIT_CLEAN


def _rule_dict(rule) -> dict:
    return {
        "code": rule.code,
        "name": rule.name,
        "summary": rule.summary,
        "severity": rule.severity.value,
        "fix": rule.fixable,
        "preview": rule.preview,
    }


def run_clean(args) -> int:
    from gpudoctor.check import cache

    removed = cache.clean(Path.cwd())
    Console().print(f"Removed {removed}" if removed else "No cache to remove.")
    return EXIT_CLEAN
