"""Loaded by every Python child of ``gpudoctor trace`` (its directory is first on PYTHONPATH).

Prepares the probe when GPUDOCTOR_TRACE_DIR is set (it is installed when the program imports torch; nothing
heavy is imported here), then hands over to any sitecustomize the
environment already had.
"""

import os
import sys

if os.environ.get("GPUDOCTOR_TRACE_DIR"):
    try:
        from gpudoctor.trace import child as _gpudoctor_child

        _gpudoctor_child.start()
    except Exception as _exc:  # the user's program runs even if the probe can't start
        sys.stderr.write(f"gpudoctor: probe not started in pid {os.getpid()}: {type(_exc).__name__}: {_exc}\n")


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    saved_path = list(sys.path)
    this_module = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        import importlib

        try:
            importlib.import_module("sitecustomize")
        except ImportError:
            pass
    finally:
        sys.path[:] = saved_path
        if this_module is not None:
            sys.modules["sitecustomize"] = this_module


_chain_next_sitecustomize()
