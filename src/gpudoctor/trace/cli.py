"""``gpudoctor trace`` command line."""

from __future__ import annotations

import os
import sys

USAGE = """\
usage: gpudoctor trace [--json PATH] [--deep] [--quiet] script.py [args ...]
       gpudoctor trace [options] -m package.module [args ...]
       gpudoctor trace [options] -- LAUNCHER [args ...]     (e.g. -- accelerate launch train.py, -- torchrun --nproc_per_node 2 train.py)

Runs the program unchanged (same exit code, output and traceback) and adds a report:
where a device mismatch / OOM happened, which tensors were involved and where they came from,
the root cause and the fix; silent problems (offloaded weights that never train, ...); placement
and peak memory. Every Python process the command starts reports (one per rank).

options:
  --json PATH   also write the merged report as JSON (schema: gpudoctor/trace/schema.md)
  --deep        check devices on every aten op (also reports meta/CPU mixes CPU kernels accept; slower)
  --quiet       no terminal report (use with --json)
  --no-check    skip the static check (`gpudoctor check`) of the traced script(s) that closes the report
  --simulate SPEC  run on simulated GPUs (2xT4, 6x3070Ti, 1xA100-80GB, 4090, 2x16GB): fake tensors, no data,
                the memory of the named cards (gpudoctor/simulate)
  --steps N     with --simulate: stop cleanly after N optimizer steps (default 2; 0 = run to the end)
  --list-gpus   print the cards --simulate knows
"""


# flag -> (option key, value); options that take a value: flag -> option key. Add new options here.
FLAGS = {"--deep": ("deep", True), "--quiet": ("quiet", True), "-q": ("quiet", True), "--no-check": ("check", False)}
VALUED = {"--json": "json", "--simulate": "simulate", "--steps": "steps"}
DEFAULTS = {"json": None, "deep": False, "quiet": False, "check": True}


def parse(argv: list[str]) -> tuple[dict, list[str]] | None:
    """(options, command to run), or None for help / nothing to run."""
    opts = dict(DEFAULTS)
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, has_value, value = arg.partition("=")
        if arg in ("-h", "--help"):
            return None
        if name in VALUED:
            if not has_value:
                if i + 1 >= len(argv):
                    raise SystemExit(f"gpudoctor trace: {name} needs a value")
                value = argv[i + 1]
                i += 1
            opts[VALUED[name]] = value
        elif arg in FLAGS:
            key, flag_value = FLAGS[arg]
            opts[key] = flag_value
        elif arg == "--":
            return opts, argv[i + 1:]
        elif arg == "-m":
            if i + 1 >= len(argv):
                raise SystemExit("gpudoctor trace: -m needs a module name")
            return opts, [sys.executable, "-m", *argv[i + 1:]]
        elif arg.startswith("-"):
            raise SystemExit(f"gpudoctor trace: unknown option {arg}\n\n{USAGE}")
        else:
            return opts, [sys.executable, *argv[i:]]
        i += 1
    return None


def main(argv: list[str]) -> int:
    if "--list-gpus" in argv:
        from gpudoctor.simulate.cards import format_table

        sys.stdout.write(format_table() + "\n")
        return 0
    parsed = parse(list(argv))
    if parsed is None or not parsed[1]:
        sys.stdout.write(USAGE)
        return 0 if parsed is None and any(a in ("-h", "--help") for a in argv) else 2
    opts, command = parsed
    if command[0] == sys.executable and len(command) > 1 and command[1] != "-m" and not os.path.exists(command[1]):
        sys.stderr.write(f"gpudoctor trace: no such script: {command[1]}\n")
        return 2
    if opts.get("simulate"):
        from gpudoctor.simulate.cli import prepare

        error = prepare(opts["simulate"], opts.get("steps"))
        if error:
            sys.stderr.write(error + "\n")
            return 2
    from gpudoctor.trace.launch import run_traced
    from gpudoctor.trace.report import merge, render, write_json

    run = run_traced(command, deep=opts["deep"])
    merged = merge(run.reports, command=command, exit_code=run.exit_code)
    if opts.get("simulate"):
        from gpudoctor.simulate.cli import finish

        merged = finish(merged, run.signal)
    merged["notes"] = ending_notes(run)
    try:
        if opts["check"]:
            merged["static"] = static_check(command)
        if opts["json"]:
            write_json(merged, opts["json"])
        if not opts["quiet"]:
            if run.reports:
                render(merged)
            if opts.get("simulate"):
                from gpudoctor.simulate.cli import render_simulation

                render_simulation(merged)
            print_notes(merged["notes"])
    except Exception as exc:  # the program's exit code matters more than our rendering
        sys.stderr.write(f"gpudoctor: could not render the report: {type(exc).__name__}: {exc}\n")
    if run.signal is not None:
        end_by_signal(run.signal)
    return run.exit_code


def ending_notes(run) -> list[str]:
    """How the program ended when that is not plain (os._exit, a signal, a missing runtime module, no torch)."""
    notes = []
    for note in run.notes:
        if note.get("missing_module"):
            name = note["missing_module"]
            notes.append(f"the program stopped at `import {name}`: No module named {name!r}. The runtime side of gpudoctor "
                         f"needs the runtime extra: pip install 'gpudoctor[runtime]'")
    for record in [*run.reports, *run.notes]:
        exit_info = record.get("exit") or {}
        if exit_info.get("how") == "os._exit":
            what = "what was collected is reported above" if record in run.reports else "torch was never imported"
            notes.append(f"pid {record.get('pid')} exited via os._exit({exit_info.get('code')}): Python's exit handlers did not "
                         f"run; {what}")
    if run.signal is not None:
        from gpudoctor.trace.launch import signal_name

        notes.append(f"the program was ended by {signal_name(run.signal)} (exit status {run.exit_code})")
    if not run.reports and not notes:
        notes.append("no Python process of the program imported torch, so there was nothing to trace")
    return notes


def print_notes(notes: list[str]) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    for note in notes:
        console.print(f"[yellow]gpudoctor trace:[/] {escape(note)}")


def end_by_signal(signum: int) -> None:
    """End as the program ended: a shell (and a Ctrl-C'd loop around us) sees the same signal."""
    import signal

    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def traced_scripts(command: list[str]) -> list[str]:
    """The user's own ``.py`` files in the command (the script, or what a launcher is given to run)."""
    return [arg for arg in command[1:] if arg.endswith(".py") and os.path.isfile(arg)]


def static_check(command: list[str]) -> dict:
    """``gpudoctor check`` on the traced scripts: the runtime report ends with what the code shows."""
    from pathlib import Path

    from gpudoctor.check.config import Config
    from gpudoctor.check.engine import check_paths

    paths = traced_scripts(command)
    if not paths:
        return {"paths": [], "findings": [], "errors": []}
    result = check_paths(paths, Config.discover(Path(paths[0]).resolve().parent))
    return {"paths": paths, "findings": [f.to_dict() for f in result.findings], "errors": result.errors}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
