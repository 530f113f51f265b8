"""``gpudoctor check`` / ``rule`` / ``clean``: options -> engine -> reporters -> exit code."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console

from gpudoctor.check import versions
from gpudoctor.check.config import Config, ConfigError, Overrides

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


def load_config(args) -> Config:
    """``--config FILE`` serves every file; without it each file gets the nearest [tool.gpudoctor] above
    it (like ruff), the working folder's serving files that have none. Options apply on top of both."""
    if args.config:
        config = Config.from_file(Path(args.config))
    else:
        config = Config.discover()
        config.hierarchical = True
    overrides = Overrides(
        select=args.select, extend_select=args.extend_select, ignore=args.ignore, exclude=args.exclude,
        preview=args.preview, force_exclude=args.force_exclude,
    )
    overrides.apply(config)
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

    _keep_undecodable_names()
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

    problem = _usage_problem(args)
    if problem:
        stderr.print(f"[bold red]error[/]: {problem}", highlight=False)
        return EXIT_ERROR
    # Capped again at the number of files to check (engine._run): never more processes than work.
    jobs = min(args.jobs, os.cpu_count() or 1) if args.jobs > 0 else (os.cpu_count() or 1)
    try:
        if args.fix or args.diff:
            from gpudoctor.check import fixes

            result = fixes.run_fixes(
                args.paths, config, unsafe=args.unsafe_fixes, diff_only=args.diff, console=stdout, jobs=jobs, use_cache=not args.no_cache
            )
            if args.diff:
                return _report_diff(result, stderr)
        else:
            result = check_paths(args.paths, config, jobs=jobs, use_cache=not args.no_cache)
    except ConfigError as error:  # a checked file's own pyproject.toml
        stderr.print(f"[bold red]error[/]: {error}", highlight=False)
        return EXIT_ERROR

    findings = result.findings
    errors = result.errors
    checked = sum(1 for r in result.files if not r.error)
    try:
        output = _render(args, findings, errors, checked, stdout, files=[r.path for r in result.files if not r.error and not r.skipped])
        if output is not None:
            if args.output_file:
                Path(args.output_file).write_text(output, encoding="utf-8", errors="surrogateescape")
            else:
                sys.stdout.write(output if output.endswith("\n") else output + "\n")
    except OSError as error:
        stderr.print(f"[bold red]error[/]: cannot write {args.output_file}: {error.strerror or error}", highlight=False)
        return EXIT_ERROR
    if args.fix and not args.quiet:
        # Machine-readable formats own stdout; the fix summary then goes to stderr.
        summary_console = stdout if args.output_format == "text" and not args.output_file and not args.statistics else stderr
        summary_console.print(_fixed_line(result), highlight=False)
    if result.hard_errors:
        return EXIT_ERROR
    if args.exit_zero:
        return EXIT_CLEAN
    # A file that could not be read or parsed fails the run like a finding (ruff reports it as one).
    return EXIT_FINDINGS if errors or any(f.severity.fails for f in findings) else EXIT_CLEAN


def _keep_undecodable_names() -> None:
    """A file name that is not UTF-8 reaches us with its bytes as surrogates (os.fsdecode): print those
    bytes back, as ``ls`` does, instead of dying on them."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="surrogateescape")
        except (AttributeError, ValueError, OSError):
            pass  # not a text file stream (captured by a test harness)


def _usage_problem(args) -> str:
    """What is wrong with the options, found before anything is checked."""
    if args.jobs < 0:
        return f"-j/--jobs must be 0 (one per core) or more, got {args.jobs}"
    if args.statistics and args.output_format not in ("text", "json"):
        return f"--statistics prints text or json, not {args.output_format}"
    if args.output_file:
        target = Path(args.output_file)
        if target.is_dir():
            return f"-o {args.output_file}: is a folder; name a file"
        folder = target.parent
        if not folder.is_dir():
            return f"-o {args.output_file}: the folder {folder} does not exist"
        if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
            return f"-o {args.output_file}: not writable"
    return ""


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
        if args.output_file:
            return _capture(lambda c: text.statistics(findings, c))
        text.statistics(findings, console)
        return None
    if fmt == "text":
        from gpudoctor.report import text

        if args.output_file:
            return _capture(lambda c: text.render(findings, errors, c, checked))
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


def _capture(render) -> str:
    """What ``render(console)`` prints, as plain text (for -o)."""
    import io

    buffer = io.StringIO()
    render(Console(file=buffer, highlight=False, no_color=True, width=120, force_terminal=False))
    return buffer.getvalue()


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

    folder, outcome = cache.clean(Path.cwd())
    if folder is None:
        Console(highlight=False).print("No cache to remove.")
        return EXIT_CLEAN
    if outcome == "removed":
        Console(highlight=False).print(f"Removed {folder}")
        return EXIT_CLEAN
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"{folder}: {outcome}")
    return EXIT_CLEAN if outcome.startswith("removed") else EXIT_ERROR
