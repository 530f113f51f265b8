"""``gpudoctor demo``: the whole product on bundled inputs, offline, in under a minute.

1. ``check`` on the reconstructed field-report scripts (``fixtures/seeds``) and their fixed twins;
2. ``trace`` of a bundled script that fails with a device mismatch on two virtual GPUs;
3. a short run of the reference LoRA trainer on the tiny built-in model;
4. ``trace --simulate``: field report 003's script, unchanged, on six simulated 8 GB cards.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.rule import Rule

from gpudoctor.check.docs import bundled_dir
from gpudoctor.trace.frames import short_path

TRACE_SCRIPT = "demo_device_mismatch.py"
# What the trace and train parts import (the `runtime` extra of pyproject.toml).
RUNTIME_MODULES = ("torch", "accelerate", "transformers", "peft")


def missing_runtime(modules=RUNTIME_MODULES) -> list[str]:
    """The runtime modules that cannot be imported here (found without importing them)."""
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def runtime_problem(part: str, missing: list[str]) -> str:
    names = ", ".join(missing)
    return f"the {part} needs the runtime extra, missing module{'s' if len(missing) > 1 else ''}: {names} (pip install 'gpudoctor[runtime]')"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpudoctor demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="reference trainer optimizer steps (default 30)")
    parser.add_argument("--skip", choices=("check", "trace", "train", "simulate"), action="append", default=[], help="skip a part")
    args = parser.parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    started = time.perf_counter()
    problems: list[str] = []
    if "check" not in args.skip:
        problems += demo_check(console)
    if "trace" not in args.skip:
        problems += demo_trace(console)
    if "train" not in args.skip:
        problems += demo_train(console, args.steps)
    if "simulate" not in args.skip:
        missing = missing_runtime(("torch", "transformers"))  # the simulator imports both in this process
        if missing:
            problems.append(runtime_problem("simulation demo", missing))
        else:
            from gpudoctor.simulate.demo import demo_simulate

            problems += demo_simulate(console)
    console.print(Rule())
    elapsed = time.perf_counter() - started
    if problems:
        for problem in problems:
            console.print(f"[bold red]demo problem:[/] {escape(problem)}")
        return 1
    console.print(f"[bold green]demo complete[/] in {elapsed:.1f} s")
    return 0


def demo_check(console: Console) -> list[str]:
    from gpudoctor.check.config import Config
    from gpudoctor.check.engine import check_paths
    from gpudoctor.report import text

    seeds = bundled_dir("fixtures") / "seeds"
    console.print(Rule("[bold]1. gpudoctor check[/] — the three field reports, reconstructed"))
    buggy = sorted(short_path(str(p)) for p in seeds.glob("*.py") if not p.name.endswith(".fixed.py"))
    fixed = sorted(short_path(str(p)) for p in seeds.glob("*.fixed.py"))
    config = Config(root=seeds)
    result = check_paths(buggy, config)
    text.render(result.findings, result.errors, console, len(buggy))
    problems = []
    if not result.findings:
        problems.append("check found nothing in the field-report scripts")
    if fixed:
        clean = check_paths(fixed, config)
        if clean.findings or clean.errors:
            text.render(clean.findings, clean.errors, console, len(fixed))
            problems.append("the fixed twins are not clean")
        else:
            names = ", ".join(Path(p).name for p in fixed)
            console.print(f"[green]The fixed twins are clean:[/] {names}")
    return problems


def demo_trace(console: Console) -> list[str]:
    script = bundled_dir("fixtures") / "trace" / TRACE_SCRIPT
    console.print(Rule("[bold]2. gpudoctor trace[/] — a device mismatch on two virtual GPUs"))
    if not script.is_file():
        return [f"missing bundled script {script}"]
    missing = missing_runtime(("torch",))  # the traced script imports torch; trace does not
    if missing:
        return [runtime_problem("trace demo", missing)]
    console.print(f"[dim]$ gpudoctor trace {script.name}[/]")
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "trace.json"
        completed = subprocess.run(
            [sys.executable, "-m", "gpudoctor", "trace", "--json", str(report), short_path(str(script))],
            capture_output=True,
            text=True,
            timeout=300,
        )
        sys.stdout.write(completed.stdout)
        sys.stdout.write(completed.stderr)
        sys.stdout.flush()
        if not report.is_file():
            return ["trace wrote no report"]
        if completed.returncode == 0:
            return ["the traced script was expected to fail with a device mismatch"]
    return []


def demo_train(console: Console, steps: int) -> list[str]:
    console.print(Rule("[bold]3. gpudoctor reference-train[/] — LoRA done right, on a tiny model"))
    missing = missing_runtime()
    if missing:
        return [runtime_problem("reference trainer", missing)]
    from gpudoctor.reference.trainer import TrainConfig, train
    with tempfile.TemporaryDirectory() as folder:
        result = train(TrainConfig(steps=steps, output_dir=folder), console=console)  # prints bar and summary
    first, last = result.losses[: max(len(result.losses) // 5, 1)], result.losses[-max(len(result.losses) // 5, 1) :]
    if sum(last) / len(last) >= sum(first) / len(first):
        return ["the reference trainer's loss did not fall"]
    return []
