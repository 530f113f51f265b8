"""The probe inside a traced process: install at startup, write this process's report at the end."""

from __future__ import annotations

import atexit
import json
import os
import sys

_state = {"probe": None, "written": False}


def start() -> None:
    try:
        import torch  # noqa: F401  (a process without torch has nothing to trace)
    except ImportError:
        return
    from gpudoctor.trace.probe import Probe

    probe = Probe(deep=os.environ.get("GPUDOCTOR_TRACE_DEEP") == "1")
    probe.install()
    _state["probe"] = probe
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        from gpudoctor.trace.frames import strip_probe_frames

        try:
            tb = strip_probe_frames(tb)
            exc.__traceback__ = tb
        except Exception:
            pass
        previous_hook(exc_type, exc, tb)  # the user's traceback first, exactly as Python prints it
        _write(exc)

    sys.excepthook = excepthook
    atexit.register(_write, None)
    if os.environ.get("GPUDOCTOR_SIMULATE"):  # `trace --simulate`: the one entry point of gpudoctor.simulate
        from gpudoctor.simulate import boot

        boot.start()


def _write(exc) -> None:
    if _state["written"] or _state["probe"] is None:
        return
    _state["written"] = True
    probe = _state["probe"]
    try:
        from gpudoctor.trace.report import build_report

        report = build_report(probe, exc if isinstance(exc, Exception) else None)
        probe.uninstall()
        path = os.path.join(os.environ["GPUDOCTOR_TRACE_DIR"], f"report-{os.getpid()}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(report, fh, default=str)
        os.replace(path + ".tmp", path)
    except Exception as probe_exc:
        sys.stderr.write(f"gpudoctor: could not write the report of pid {os.getpid()}: {type(probe_exc).__name__}: {probe_exc}\n")
