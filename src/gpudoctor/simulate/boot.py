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
