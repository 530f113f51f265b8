"""The one entry point of a simulated run inside the traced process.

``gpudoctor trace --simulate SPEC`` sets ``GPUDOCTOR_SIMULATE=SPEC`` (and ``GPUDOCTOR_SIMULATE_STEPS``);
the child's boot calls :func:`start` once torch can be imported. It enters a :class:`Simulation` for the
rest of the process, makes ``from_pretrained`` build fake weights without downloads
(:mod:`gpudoctor.simulate.hub`), translates ``gpu`` back to ``cuda`` in the error the user sees, and turns a
value the simulation cannot provide into a clear explanation instead of a gpudoctor traceback.
"""

from __future__ import annotations

import os
import sys

ENV_SPEC = "GPUDOCTOR_SIMULATE"
ENV_STEPS = "GPUDOCTOR_SIMULATE_STEPS"
DEFAULT_STEPS = 2

_state: dict = {"sim": None}


def requested() -> bool:
    return bool(os.environ.get(ENV_SPEC))


def start() -> None:
    if _state["sim"] is not None or not requested():
        return
    from gpudoctor.simulate import hub
    from gpudoctor.simulate.session import Simulation

    # offline by design: no download, and no minute of retries against an unreachable Hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    steps = int(os.environ.get(ENV_STEPS) or DEFAULT_STEPS)
    sim = Simulation(os.environ[ENV_SPEC], max_steps=steps if steps > 0 else None)
    sim.__enter__()
    hub.install(sim)
    _state["sim"] = sim
    from gpudoctor.simulate.devices import UserStream

    # the script's prints show cuda:N (the virtual devices are PrivateUse1 "gpu" inside)
    sys.stdout, sys.stderr = UserStream(sys.stdout), UserStream(sys.stderr)
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        from gpudoctor.simulate.devices import to_user
        from gpudoctor.simulate.hub import NotSimulable
        from gpudoctor.simulate.tracker import DataDependent

        if isinstance(exc, DataDependent):
            _explain_data_dependent(exc, tb)
        if isinstance(exc, (DataDependent, NotSimulable)):
            # what stopped the simulation, said once, at the user's line: no gpudoctor frames
            tb = _user_frames_only(tb)
            exc.__traceback__ = tb
            exc.__cause__, exc.__suppress_context__ = None, True
        else:
            tb = without_simulator_frames(exc, tb)
        try:
            exc.args = tuple(to_user(a) if isinstance(a, str) else a for a in exc.args)
        except Exception:
            pass
        previous_hook(exc_type, exc, tb)

    sys.excepthook = excepthook


def _explain_data_dependent(exc, tb) -> None:
    from gpudoctor.trace.frames import first_user_frame_from_traceback

    frame = first_user_frame_from_traceback(tb)
    where = f"{frame['file']}:{frame['line']} ({frame['code']})" if frame else "the script"
    exc.args = (f"gpudoctor --simulate stopped at {where}: {exc.args[0] if exc.args else exc}. Simulated tensors have "
                "shapes, dtypes and devices but no values, and this line needs values to go on (the memory figures up "
                "to here are still valid). Bound the run with --steps so it stops before, or run it on a real GPU.",)


def without_simulator_frames(exc: BaseException, tb=None):
    """The traceback as a real run would print it: the simulator's frames taken out of ``exc`` (and the exceptions
    chained to it); returns ``tb`` (default ``exc.__traceback__``) so filtered.

    Dropped: every frame of gpudoctor.simulate / gpudoctor.virtual, and the torch plumbing that leads into them or
    runs under them (torch function / dispatch mode entry, fake tensors, Python meta kernels), plus a library frame
    that only detoured into a torch function mode (``return handle_torch_function(...)``: without a mode that line
    does not run). What stays is the user's frames and the library frames a real run has: for an OOM, the line of
    torch or transformers whose op could not allocate; for an error in a hook, ``backward()`` then the hook."""
    seen = set()
    current, filtered = exc, None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        kept = _filter_traceback(current.__traceback__ if current is not exc or tb is None else tb)
        current.__traceback__ = kept
        if current is exc:
            filtered = kept
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return filtered


def _filter_traceback(tb):
    import linecache

    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    kinds = [_frame_kind(entry.tb_frame.f_code.co_filename) for entry in entries]
    drop = [False] * len(entries)
    start = 0
    while start < len(entries):
        if kinds[start] is None:
            start += 1
            continue
        end = start
        while end < len(entries) and kinds[end] is not None:
            end += 1
        if "simulator" in kinds[start:end]:
            drop[start:end] = [True] * (end - start)
            if start > 0 and "handle_torch_function" in linecache.getline(entries[start - 1].tb_frame.f_code.co_filename,
                                                                          entries[start - 1].tb_lineno):
                drop[start - 1] = True
        start = end
    kept = [entry for entry, dropped in zip(entries, drop) if not dropped]
    for entry, following in zip(kept, kept[1:] + [None]):
        entry.tb_next = following
    return kept[0] if kept else None


_SIMULATOR_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name) + os.sep
                        for name in ("simulate", "virtual"))
# torch files a real CUDA run does not pass through on its way to an op: mode entry, fake tensors, meta kernels
_TORCH_PLUMBING = ("overrides.py", "_compile.py", "_dynamo" + os.sep, os.path.join("utils", "_python_dispatch.py"),
                   "_subclasses" + os.sep, "_decomp" + os.sep, "_refs" + os.sep, "_prims" + os.sep,
                   "_prims_common" + os.sep, "_meta_registrations.py")


def _frame_kind(filename: str) -> str | None:
    path = os.path.abspath(filename)
    if path.startswith(_SIMULATOR_DIRS):
        return "simulator"
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep if torch is not None else None
    if torch_dir and path.startswith(torch_dir) and path[len(torch_dir):].startswith(_TORCH_PLUMBING):
        return "plumbing"
    return None


def _user_frames_only(tb):
    from gpudoctor.trace.frames import is_user_file

    frames = []
    while tb is not None:
        if is_user_file(tb.tb_frame.f_code.co_filename):
            frames.append(tb)
        tb = tb.tb_next
    if not frames:
        return None
    for earlier, later in zip(frames, frames[1:]):
        earlier.tb_next = later
    frames[-1].tb_next = None
    return frames[0]


def active():
    return _state["sim"]


def report_section() -> dict | None:
    """The simulation's summary for this process's report (``simulation`` key)."""
    sim = _state["sim"]
    return sim.summary() if sim is not None else None
