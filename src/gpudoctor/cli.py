"""The one entry point: ``gpudoctor check | rule | trace | plan | reference-train | demo | clean``.

``check`` and ``rule`` never import torch or a Hugging Face library; ``trace``, ``plan``, ``reference-train``
and ``demo`` import them lazily.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from gpudoctor import __version__

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
OUTPUT_FORMATS = ("text", "json", "sarif", "github", "junit")


def _comma_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpudoctor",
        description="Find the real cause of device-mismatch, offload and out-of-memory failures in PyTorch / "
        "Hugging Face training, and show the fix.",
    )
    parser.add_argument("--version", action="version", version=f"gpudoctor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    check = sub.add_parser("check", help="statically check Python files and notebooks", description="Statically check files and folders.")
    check.add_argument("paths", nargs="*", default=["."], help="files or folders (default: .)")
    check.add_argument("--select", type=_comma_list, help="rule codes or prefixes to enable (e.g. GD1,GD204)")
    check.add_argument("--extend-select", type=_comma_list, default=[], help="add to the selection")
    check.add_argument("--ignore", type=_comma_list, default=[], help="rule codes or prefixes to disable")
    check.add_argument("--exclude", type=_comma_list, default=[], help="extra glob patterns to skip")
    check.add_argument("--preview", action="store_true", help="enable preview (heuristic) rules")
    check.add_argument("--gpus", help="the GPUs the script runs on, e.g. 2xT4, 6x8GB, 24GB (default: [tool.gpudoctor] gpus, else the local GPUs)")
    check.add_argument("--output-format", choices=OUTPUT_FORMATS, default=os.environ.get("GPUDOCTOR_OUTPUT_FORMAT", "text"))
    check.add_argument("-o", "--output-file", help="write the report to this file")
    check.add_argument("--statistics", action="store_true", help="count findings per rule")
    check.add_argument("--exit-zero", action="store_true", help="exit 0 even when findings remain")
    check.add_argument("--config", help="read [tool.gpudoctor] from this pyproject.toml")
    check.add_argument("--fix", action="store_true", help="apply safe fixes")
    check.add_argument("--unsafe-fixes", action="store_true", help="also apply unsafe fixes (with --fix or --diff)")
    check.add_argument("--diff", action="store_true", help="show the fixes as a diff; write nothing")
    check.add_argument("--no-cache", action="store_true", help="do not read or write the cache")
    check.add_argument("-j", "--jobs", type=int, default=0, help="parallel workers (default: number of cores)")
    check.add_argument("-q", "--quiet", action="store_true", help="print findings only, no summary")
    check.add_argument("--force-exclude", action="store_true", help="apply excludes to files named on the command line too")

    rule = sub.add_parser("rule", help="explain a rule, or list them all")
    rule.add_argument("code", nargs="?", help="e.g. GD101")
    rule.add_argument("--all", action="store_true", help="list every rule")
    rule.add_argument("--output-format", choices=("text", "json"), default="text")

    sub.add_parser("clean", help="remove the check cache")

    sub.add_parser("trace", help="run a program under the runtime probe (see `gpudoctor trace --help`)", add_help=False)
    sub.add_parser("reference-train", help="run the reference LoRA trainer (see `gpudoctor reference-train --help`)", add_help=False)
    sub.add_parser("demo", help="show check, trace and the reference trainer on bundled examples", add_help=False)
    sub.add_parser("plan", help="what fits on these GPUs, and the least change that makes it fit (see `gpudoctor plan --help`)",
                   add_help=False)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Verbs that own their argument parsing (they pass arguments through to user programs).
    if argv and argv[0] == "trace":
        from gpudoctor.trace.cli import main as trace_main

        return trace_main(argv[1:])
    if argv and argv[0] == "reference-train":
        from gpudoctor.reference.cli import main as reference_main

        return reference_main(argv[1:])
    if argv and argv[0] == "plan":
        from gpudoctor.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv and argv[0] == "demo":
        from gpudoctor.demo import main as demo_main

        return demo_main(argv[1:])

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check":
        from gpudoctor.check.cli import run_check

        return run_check(args)
    if args.command == "rule":
        from gpudoctor.check.cli import run_rule

        return run_rule(args)
    if args.command == "clean":
        from gpudoctor.check.cli import run_clean

        return run_clean(args)
    parser.print_help()
    return EXIT_ERROR if argv else EXIT_CLEAN


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
