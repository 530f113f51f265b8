"""Run the user's command with the probe injected into every Python process it starts.

The program runs in its own process group. When ``gpudoctor trace`` owns the terminal, that group gets
the terminal (as a shell does for a job), so Ctrl-C reaches the program once, from the terminal, and
never a second time from us. Signals sent to ``gpudoctor trace`` itself (``kill``, a scheduler's
SIGTERM) are forwarded once to the program's group; the temp folder goes when the program has ended.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
                          if hasattr(signal, name))


@dataclass
class TracedRun:
    exit_code: int  # as a shell reports it: 128 + N for death by signal N
    signal: int | None  # the signal that ended the program, if one did
    reports: list[dict] = field(default_factory=list)
    notes: list[dict] = field(default_factory=list)  # processes without a probe that ended in a way worth saying


def signal_name(signum: int) -> str:
    """``SIGABRT`` for 6; ``signal N`` for a number the platform does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def child_env(report_dir: str, deep: bool, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    parts = [BOOT_DIR, PACKAGE_PARENT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["GPUDOCTOR_TRACE_DIR"] = report_dir
    env["GPUDOCTOR_TRACE_DEEP"] = "1" if deep else "0"
    env["GPUDOCTOR_TRACE_LAUNCHER"] = str(os.getpid())
    return env


def run_traced(command: list[str], deep: bool = False) -> TracedRun:
    """Run ``command`` to its end; return how it ended and what its Python processes reported."""
    report_dir = tempfile.mkdtemp(prefix="gpudoctor-trace-")
    try:
        status = _run_in_own_group(command, child_env(report_dir, deep))
        reports, notes = _collect(report_dir)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return TracedRun(128 + sig, sig, reports, notes)
    return TracedRun(os.WEXITSTATUS(status), None, reports, notes)


def _terminal_fd() -> int | None:
    """stdin's terminal when our process group is in its foreground (so we may hand it over), else None."""
    try:
        fd = sys.stdin.fileno()
        if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    except (AttributeError, OSError, ValueError):
        pass
    return None


def _set_foreground(fd: int, pgid: int) -> None:
    # a process outside the foreground group gets SIGTTOU for tcsetpgrp unless it ignores it
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgid)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)


def _run_in_own_group(command: list[str], env: dict) -> int:
    """Start ``command`` as the leader of a new process group; forward signals; return its wait status."""
    tty = _terminal_fd()
    state: dict = {"pgid": None, "pending": []}

    def forward(signum, _frame):
        if state["pgid"] is None:
            state["pending"].append(signum)  # arrived while starting: sent once the group exists
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(state["pgid"], signum)

    def in_child() -> None:  # after fork, before exec (as shells do it: no race with the parent)
        _terminate_with_parent()
        os.setpgid(0, 0)
        if tty is not None:
            _set_foreground(tty, os.getpgrp())
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        proc = subprocess.Popen(command, env=env, preexec_fn=in_child)
        state["pgid"] = proc.pid
        with contextlib.suppress(OSError):
            os.setpgid(proc.pid, proc.pid)  # already done by the child, or it has exec'd: both fine
        for signum in state["pending"]:
            forward(signum, None)
        try:
            return _wait(proc, tty)
        finally:
            if tty is not None:
                _set_foreground(tty, os.getpgrp())
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _terminate_with_parent() -> None:
    """Linux: SIGTERM to the program if gpudoctor trace dies without forwarding (SIGKILL): never an orphan."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _wait(proc: subprocess.Popen, tty: int | None) -> int:
    """Wait for the program; on a terminal, when it is stopped (Ctrl-Z), stop too and resume it with us, like a shell job."""
    while True:
        _, status = os.waitpid(proc.pid, os.WUNTRACED if tty is not None else 0)
        if not os.WIFSTOPPED(status):
            proc.returncode = os.waitstatus_to_exitcode(status)
            return status
        _set_foreground(tty, os.getpgrp())
        os.kill(os.getpid(), signal.SIGSTOP)  # the shell sees its job stopped; `fg` continues us here
        _set_foreground(tty, proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)


def _collect(report_dir: str) -> tuple[list[dict], list[dict]]:
    loaded: dict[str, list[dict]] = {"report": [], "note": []}
    for kind in loaded:
        for path in sorted(glob.glob(os.path.join(report_dir, f"{kind}-*.json"))):
            try:
                with open(path, encoding="utf-8") as fh:
                    loaded[kind].append(json.load(fh))
            except (OSError, ValueError):
                continue
    return relevant(loaded["report"]), loaded["note"]


def relevant(reports: list[dict]) -> list[dict]:
    """Drop launcher processes (torchrun, accelerate launch) that ran no model when workers reported."""
    worked = [r for r in reports if (r.get("stats") or {}).get("module_calls") or (r.get("failure") or {}).get("kind", "other") != "other"]
    return worked or reports[-1:] if len(reports) > 1 else reports
