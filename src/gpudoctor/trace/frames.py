"""Which frames belong to the user's own code (not Python, site-packages, torch or gpudoctor)."""

from __future__ import annotations

import linecache
import os
import sysconfig
import types

_GPUDOCTOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BUNDLED_FIXTURES = os.sep + os.path.join("_bundled", "fixtures") + os.sep
_LIBRARY_DIRS = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)


def is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return filename.startswith("<ipython-input") or filename.startswith("<cell") or filename == "<stdin>"
    path = os.path.realpath(filename)
    if _BUNDLED_FIXTURES in path:
        return True  # `gpudoctor demo` runs a bundled script: it plays the user's code
    if path.startswith(_GPUDOCTOR_DIR + os.sep):
        return False
    if "site-packages" in path or "dist-packages" in path:
        return False
    return not path.startswith(_LIBRARY_DIRS)


def frame_info(filename: str, lineno: int, function: str) -> dict:
    return {"file": filename, "line": lineno, "function": function, "code": linecache.getline(filename, lineno).strip()}


def first_user_frame_from_stack(frame: types.FrameType | None, limit: int = 200) -> dict | None:
    """Innermost user frame walking outwards from ``frame``."""
    depth = 0
    while frame is not None and depth < limit:
        code = frame.f_code
        if is_user_file(code.co_filename):
            return frame_info(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
        depth += 1
    return None


def traceback_frames(tb: types.TracebackType | None) -> list[tuple[str, int, str]]:
    out = []
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append((code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return out


def first_user_frame_from_traceback(tb: types.TracebackType | None) -> dict | None:
    """Innermost frame of the user's code in a traceback: the line of *their* code that led to the error."""
    for filename, lineno, function in reversed(traceback_frames(tb)):
        if is_user_file(filename):
            return frame_info(filename, lineno, function)
    return None


def strip_probe_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Drop gpudoctor's own wrapper frames so the traceback the user sees is the one Python would print."""
    kept = []
    while tb is not None:
        if not os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(_GPUDOCTOR_DIR + os.sep):
            kept.append(tb)
        tb = tb.tb_next
    for current, following in zip(kept, kept[1:] + [None]):
        current.tb_next = following
    return kept[0] if kept else None


def short_path(filename: str) -> str:
    """Relative to the working directory when the file is under it (what people type), else as is."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


def drop_own_frame(exc: BaseException, frame: types.FrameType) -> None:
    """Called in an ``except`` block of ``frame`` before a bare ``raise`` (which adds no entry): the exception
    leaves without that frame in its traceback, so a wrapper of gpudoctor's stays out of every traceback."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame is frame:
        exc.__traceback__ = tb.tb_next
