"""Python API for notebooks and scripts: ``gpudoctor.watch(model)`` and ``gpudoctor.Probe``.

    with gpudoctor.watch(model) as probe:      # or: probe = gpudoctor.watch(model) ... probe.close()
        train()
    probe.report()   # dict (schema.md); probe.print_report() renders it

When an exception leaves the ``with`` block the report is printed to stderr and the exception
propagates unchanged.
"""

from __future__ import annotations

import sys

import torch.nn as nn

from gpudoctor.trace.frames import strip_probe_frames
from gpudoctor.trace.probe import Probe as _CoreProbe
from gpudoctor.trace.report import build_report, merge, render


class Probe(_CoreProbe):
    def __init__(self, *models: nn.Module, deep: bool = False, print_on_error: bool = True):
        super().__init__(*models, deep=deep)
        self.print_on_error = print_on_error
        self.last_exception: BaseException | None = None
        self._report: dict | None = None

    def __enter__(self) -> "Probe":
        return self.install()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and isinstance(exc, Exception):
            self.last_exception = exc
            try:
                self._report = build_report(self, exc)
            finally:
                self.uninstall()
            if exc.__traceback__ is not None:
                exc.__traceback__ = strip_probe_frames(exc.__traceback__)
            if self.print_on_error:
                self.print_report()
        else:
            self.uninstall()
        return False

    def report(self, exc: BaseException | None = None) -> dict:
        """The report for this probe: a failure section when ``exc`` (or the last error seen) is given."""
        exc = exc if exc is not None else self.last_exception
        if self._report is not None and exc is self.last_exception:
            return self._report
        return build_report(self, exc)

    def print_report(self, console=None, exc: BaseException | None = None) -> dict:
        report = self.report(exc)
        render(merge([report], command=list(sys.argv), exit_code=None), console)
        return report

    def close(self) -> None:
        self.uninstall()


def watch(*models: nn.Module, deep: bool = False, print_on_error: bool = True) -> Probe:
    """Start watching now; returns the installed probe (also a context manager)."""
    return Probe(*models, deep=deep, print_on_error=print_on_error).install()


__all__ = ["Probe", "watch"]
