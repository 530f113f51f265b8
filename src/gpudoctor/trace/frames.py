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


# ---------------------------------------------------------------------------------------------
# the user's source: which line built a value (for "fix it here" locations)
# ---------------------------------------------------------------------------------------------

def user_tracebacks(tb: types.TracebackType | None) -> list[types.TracebackType]:
    """Traceback entries of the user's own code, innermost first."""
    out = []
    while tb is not None:
        if is_user_file(tb.tb_frame.f_code.co_filename):
            out.append(tb)
        tb = tb.tb_next
    return out[::-1]


def _parse(filename: str):
    import ast

    try:
        with open(filename, encoding="utf-8") as fh:
            return ast.parse(fh.read(), filename)
    except (OSError, SyntaxError, ValueError):
        return None


def _enclosing_function(tree, line: int):
    import ast

    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno > best.lineno:
                best = node
    return best


def _assigned_names(node) -> set[str]:
    import ast

    names: set[str] = set()
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
    return names


def assignment_line(filename: str, name: str, before: int) -> dict | None:
    """The last ``name = ...`` before line ``before`` in the function around it (else at module level)."""
    import ast

    tree = _parse(filename)
    if tree is None:
        return None
    scope = _enclosing_function(tree, before) or tree
    best = None
    for node in ast.walk(scope):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.lineno < before and name in _assigned_names(node):
            if best is None or node.lineno > best:
                best = node.lineno
    return frame_info(filename, best, getattr(scope, "name", "<module>")) if best else None


def _class_source(klass: type) -> tuple[str | None, int]:
    """(file, first line) of a class. inspect finds the file through ``sys.modules[klass.__module__].__file__``,
    which Python deletes from ``__main__`` once the script returns (reports are built at exit): then the file
    of a function defined in the class body says it."""
    import inspect

    try:
        return inspect.getsourcefile(klass), inspect.getsourcelines(klass)[1]
    except (OSError, TypeError):
        pass
    for value in vars(klass).values():
        code = getattr(inspect.unwrap(value) if callable(value) else None, "__code__", None)
        if code is not None and getattr(value, "__qualname__", "").startswith(klass.__qualname__ + "."):
            return code.co_filename, 0
    return None, 0


def attribute_assignment_line(cls: type, attr: str) -> dict | None:
    """Where ``self.<attr> = ...`` is first assigned in ``cls`` (or a base class defined in user code)."""
    import ast

    for klass in cls.__mro__:
        filename, start = _class_source(klass)
        if not filename or not is_user_file(filename):
            continue
        tree = _parse(filename)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__ and node.lineno >= start - 1:
                hits = [sub.lineno for sub in ast.walk(node) if isinstance(sub, (ast.Assign, ast.AnnAssign))
                        and any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) and t.value.id == "self"
                                for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]))]
                if hits:
                    return frame_info(filename, min(hits), klass.__name__)
    return None


def names_in_line(filename: str, line: int) -> list[str]:
    """Dotted names read by the statement at ``line`` (``logits``, ``outputs.logits``), in source order."""
    import ast

    tree = _parse(filename)
    if tree is None:
        return []
    statement = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With, ast.For, ast.While, ast.If, ast.Try)):
                if statement is None or node.lineno >= statement.lineno:
                    statement = node
    if statement is None:
        return []
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(statement):
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(getattr(node, "ctx", None), ast.Load):
            parts = []
            current = node
            while isinstance(current, ast.Attribute):
                parts.append(current.attr)
                current = current.value
            if isinstance(current, ast.Name):
                parts.append(current.id)
                found.append((node.lineno, node.col_offset, ".".join(reversed(parts))))
    return list(dict.fromkeys(name for _, _, name in sorted(found)))


def resolve_local(frame: types.FrameType, dotted: str):
    """Value of ``a.b.c`` in ``frame`` from stored attributes only (no property or __getattr__ of user classes runs);
    None if absent."""
    head, *rest = dotted.split(".")
    if head in frame.f_locals:
        value = frame.f_locals[head]
    elif head in frame.f_globals:
        value = frame.f_globals[head]
    else:
        return None
    for attr in rest:
        value = _stored_attribute(value, attr)
        if value is None:
            return None
    return value


def _stored_attribute(value, attr: str):
    if isinstance(value, dict):  # HF ModelOutput is a dict: outputs.logits
        return value.get(attr)
    stored = getattr(value, "__dict__", None)
    if isinstance(stored, dict):
        if attr in stored:
            return stored[attr]
        for registry in ("_parameters", "_buffers", "_modules"):  # nn.Module
            table = stored.get(registry)
            if isinstance(table, dict) and attr in table:
                return table[attr]
    return None


def local_names_of(frame: types.FrameType, obj) -> list[str]:
    return [name for name, value in frame.f_locals.items() if value is obj]


def _call_name(node) -> str | None:
    import ast

    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def construction_line(filename: str, class_names: set[str], name: str | None, before: int) -> dict | None:
    """Where ``... = ClassName(...)`` builds an object of one of ``class_names``: in the function around line ``before``
    the last one before it (preferring an assignment to ``name``); else, anywhere in the file, the assignment to ``name``
    or the only construction there is (a ``build()`` helper that returns it)."""
    import ast

    tree = _parse(filename)
    if tree is None:
        return None

    def hits(scope):
        return [(node.lineno, name is not None and name in _assigned_names(node)) for node in ast.walk(scope)
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call)
                and _call_name(node.value) in class_names]

    function = _enclosing_function(tree, before)
    if function is not None:
        local = [(line, named) for line, named in hits(function) if line < before]
        if local:
            named = [line for line, is_named in local if is_named]
            return frame_info(filename, max(named or [line for line, _ in local]), function.name)
    every = hits(tree)
    named = [line for line, is_named in every if is_named]
    if len(named) == 1 or (not named and len(every) == 1):
        return frame_info(filename, (named or [every[0][0]])[0], "")
    return None


def freeze_line(filename: str, before: int) -> dict | None:
    """The last ``x.requires_grad_(False)`` / ``p.requires_grad = False`` before line ``before`` in its function, else the last in the file."""
    import ast

    tree = _parse(filename)
    if tree is None:
        return None

    def freezes(node) -> bool:
        if isinstance(node, ast.Call) and _call_name(node) == "requires_grad_":
            return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value is False
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is False:
            return any(isinstance(t, ast.Attribute) and t.attr == "requires_grad" for t in node.targets)
        return False

    function = _enclosing_function(tree, before)
    if function is not None:
        lines = [n.lineno for n in ast.walk(function) if freezes(n) and n.lineno < before]
        if lines:
            return frame_info(filename, max(lines), function.name)
    lines = [n.lineno for n in ast.walk(tree) if freezes(n)]
    return frame_info(filename, max(lines), "") if lines else None
