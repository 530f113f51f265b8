"""Run the user's command with the probe injected into every Python process it starts."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(report_dir: str, deep: bool, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    parts = [BOOT_DIR, PACKAGE_PARENT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["GPUDOCTOR_TRACE_DIR"] = report_dir
    env["GPUDOCTOR_TRACE_DEEP"] = "1" if deep else "0"
    return env


def run_traced(command: list[str], deep: bool = False) -> tuple[int, list[dict]]:
    """Run ``command``; return (exit code as a shell reports it, the reports of its Python processes)."""
    report_dir = tempfile.mkdtemp(prefix="gpudoctor-trace-")
    try:
        proc = subprocess.Popen(command, env=child_env(report_dir, deep))
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # Ctrl-C reaches the child too; wait for its report
                proc.send_signal(signal.SIGINT)
        if code < 0:
            code = 128 - code
        return code, _collect(report_dir)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)


def _collect(report_dir: str) -> list[dict]:
    reports = []
    for path in sorted(glob.glob(os.path.join(report_dir, "report-*.json"))):
        try:
            with open(path, encoding="utf-8") as fh:
                reports.append(json.load(fh))
        except (OSError, ValueError):
            continue
    return relevant(reports)


def relevant(reports: list[dict]) -> list[dict]:
    """Drop launcher processes (torchrun, accelerate launch) that ran no model when workers reported."""
    worked = [r for r in reports if (r.get("stats") or {}).get("module_calls") or (r.get("failure") or {}).get("kind", "other") != "other"]
    return worked or reports[-1:] if len(reports) > 1 else reports
