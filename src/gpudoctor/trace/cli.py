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
  --deep        check devices on every aten op (catches meta/CPU mixes CPU kernels accept; slower)
  --quiet       no terminal report (use with --json)
  --no-check    skip the static check (`gpudoctor check`) of the traced script(s) that closes the report
  --simulate SPEC  run on simulated GPUs (2xT4, 6x3070Ti, 1xA100-80GB, 4090, 2x16GB): fake tensors, no data,
                the memory of the named cards (gpudoctor/simulate)
  --steps N     with --simulate: stop cleanly after N optimizer steps (default 2; 0 = run to the end)
  --list-gpus   print the cards --simulate knows
"""


def parse(argv: list[str]) -> tuple[dict, list[str]] | None:
    opts = {"json": None, "deep": False, "quiet": False, "check": True}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            return None
        if arg == "--json":
            if i + 1 >= len(argv):
                raise SystemExit("gpudoctor trace: --json needs a path")
            opts["json"] = argv[i + 1]
            i += 2
            continue
        if arg in ("--simulate", "--steps") or arg.startswith(("--simulate=", "--steps=")):
            key = arg[2:].split("=", 1)[0]
            if "=" not in arg and i + 1 >= len(argv):
                raise SystemExit(f"gpudoctor trace: {arg} needs a value")
            opts[key] = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            i += 1 if "=" in arg else 2
            continue
        if arg.startswith("--json="):
            opts["json"] = arg.split("=", 1)[1]
        elif arg == "--deep":
            opts["deep"] = True
        elif arg in ("--quiet", "-q"):
            opts["quiet"] = True
        elif arg == "--no-check":
            opts["check"] = False
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

    code, reports = run_traced(command, deep=opts["deep"])
    merged = merge(reports, command=command, exit_code=code)
    if opts.get("simulate"):
        from gpudoctor.simulate.cli import finish

        merged = finish(merged)
    try:
        if opts["check"]:
            merged["static"] = static_check(command)
        if opts["json"]:
            write_json(merged, opts["json"])
        if not opts["quiet"]:
            render(merged)
            if opts.get("simulate"):
                from gpudoctor.simulate.cli import render_simulation

                render_simulation(merged)
    except Exception as exc:  # the program's exit code matters more than our rendering
        sys.stderr.write(f"gpudoctor: could not render the report: {type(exc).__name__}: {exc}\n")
    return code


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
