"""The probe inside a traced process, started by ``_boot/sitecustomize.py`` before the user's code.

Nothing here imports torch. :func:`start` puts an import watcher first on ``sys.meta_path``: the probe is
installed right after the program's own ``import torch`` finished (so ``OMP_NUM_THREADS`` set before it
still counts, and a process without torch pays nothing). At the end the process writes its report if
it is the program ``gpudoctor trace`` started or has something to say; a child process with nothing to
report (a resource tracker, a DataLoader worker) writes nothing and prints nothing.

The failure comes from ``sys.last_value`` (set by Python before any ``sys.excepthook`` runs, the
program's own included); ``os._exit`` is wrapped so a process ending that way still reports, and says so.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import weakref

# Modules of the `gpudoctor[runtime]` extra: a program stopping on one of them gets a note naming the extra.
RUNTIME_MODULES = ("torch", "accelerate", "transformers", "peft", "pynvml")

_state: dict = {"probe": None, "written": False, "pid": None, "exit": None, "forked": False}
_original_os_exit = os._exit


def start() -> None:
    _state["pid"] = os.getpid()
    if os.environ.get("GPUDOCTOR_SIMULATE"):  # `trace --simulate`: the one entry point of gpudoctor.simulate (imports torch)
        from gpudoctor.simulate import boot

        boot.start()
    if "torch" in sys.modules:  # imported by an earlier sitecustomize or a .pth file
        _torch_imported()
    else:
        sys.meta_path.insert(0, _TorchImportWatcher())
    # atexit runs last-registered first. weakref.finalize registers its exit hook when the first finalizer is made
    # (torch.library's do, at import): registered before ours, it runs after the report is built, so the
    # libraries it tears down (the virtual GPU backend's kernels) are still there for the diagnostic re-runs.
    weakref.finalize(start, lambda: None)
    atexit.register(_write)
    os._exit = _os_exit
    if hasattr(os, "register_at_fork"):  # POSIX
        os.register_at_fork(after_in_child=_after_fork)


class _TorchImportWatcher:
    """Meta-path finder that finds nothing itself: it wraps the loader of ``torch`` to learn when its import is done."""

    def __init__(self) -> None:
        self.busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or self.busy:
            return None
        self.busy = True
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch") if "torch" not in sys.modules else None
        except Exception:  # let Python's own machinery report whatever is wrong
            return None
        finally:
            self.busy = False
        _remove_watcher()
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _LoaderThenProbe(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        return None


class _LoaderThenProbe:
    """Runs torch's real loader, restores it on the module, then installs the probe."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        try:
            self.loader.exec_module(module)
        except BaseException as exc:
            from gpudoctor.trace.frames import drop_own_frame

            drop_own_frame(exc, sys._getframe())
            raise  # bare: torch's own import error, with Python's own traceback
        _torch_imported()


def _remove_watcher() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchImportWatcher)]


def _torch_imported() -> None:
    try:
        from gpudoctor.trace.probe import Probe

        probe = Probe(deep=os.environ.get("GPUDOCTOR_TRACE_DEEP") == "1")
        probe.install()
        _state["probe"] = probe
    except Exception as exc:  # the user's program runs even if the probe can't start
        sys.stderr.write(f"gpudoctor: probe not started in pid {os.getpid()}: {type(exc).__name__}: {exc}\n")


def _after_fork() -> None:
    """A forked child (DataLoader worker, multiprocessing fork) starts with nothing to report of its own."""
    _state.update(pid=os.getpid(), written=False, exit=None, forked=True)
    probe = _state["probe"]
    if probe is not None:
        probe.forward_calls = probe.steps = 0
        probe.probe_errors = []


def _os_exit(code=0):
    """``os._exit`` skips atexit: report first (the exit code stays the program's), then exit."""
    try:
        _state["exit"] = {"how": "os._exit", "code": code}
        _write()
    finally:
        _original_os_exit(code)


def _uncaught() -> BaseException | None:
    """The exception that ended the program: Python sets ``sys.last_value`` before calling any excepthook."""
    exc = getattr(sys, "last_value", None)
    return exc if isinstance(exc, BaseException) else None


def _write() -> None:
    if _state["written"] or _state["pid"] != os.getpid():
        return
    _state["written"] = True
    try:
        record = _record()
        if record is None:
            return
        kind = "report" if "schema" in record else "note"
        path = os.path.join(os.environ["GPUDOCTOR_TRACE_DIR"], f"{kind}-{os.getpid()}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(record, fh, default=str)
        os.replace(path + ".tmp", path)
    except Exception as probe_exc:
        sys.stderr.write(f"gpudoctor: could not write the report of pid {os.getpid()}: {type(probe_exc).__name__}: {probe_exc}\n")
    finally:
        if isinstance(_uncaught(), KeyboardInterrupt):
            _keep_sigint_exit()


def _keep_sigint_exit() -> None:
    """An uncaught KeyboardInterrupt makes Python die by SIGINT after finalization (a shell sees 130), but CPython
    forgets that whenever a string is exec'd (namedtuple and dataclass definitions do, and building the report
    defines some). Ending the same way again sets it back: ``exec`` of a string that raises KeyboardInterrupt."""
    try:
        exec("raise KeyboardInterrupt", {})
    except KeyboardInterrupt:
        pass


def _record() -> dict | None:
    """This process's report; a note when it has no probe but ended in a way worth saying; None otherwise."""
    exc = _uncaught()
    probe = _state["probe"]
    exit_info = _state["exit"]
    # the program gpudoctor started always reports; its children only when they have something to say
    # (multiprocessing's fork children always leave by os._exit, a resource tracker never runs a model)
    launched = not _state["forked"] and _is_launched_program()
    notable_exit = exit_info is not None and launched
    if probe is None:
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing and missing.split(".")[0] in RUNTIME_MODULES:
            return {"pid": os.getpid(), "argv": sys.argv, "missing_module": missing}
        if notable_exit:
            return {"pid": os.getpid(), "argv": sys.argv, "exit": exit_info}
        return None
    if exc is None and not launched and not probe.has_something_to_report():
        return None
    from gpudoctor.trace.report import build_report

    report = build_report(probe, exc if isinstance(exc, Exception) else None)
    probe.uninstall()
    if exit_info is not None:
        report["exit"] = exit_info
    elif isinstance(exc, KeyboardInterrupt):
        report["exit"] = {"how": "KeyboardInterrupt"}
    return report


def _is_launched_program() -> bool:
    """The process ``gpudoctor trace`` started itself (not one of its children)."""
    return os.environ.get("GPUDOCTOR_TRACE_LAUNCHER") == str(os.getppid())
