"""Jupyter notebooks: the code cells, in order, are checked as ONE module (a model loaded in cell 2
and prepared in cell 5 is the same model), and findings are mapped back to (cell, line in cell).

IPython syntax is neutralised line for line so the module always parses and line numbers stay put:
line magics (``%pip install x``), shell escapes (``!nvidia-smi``), help (``?obj``, ``obj??``) become
``pass`` at the same indentation (``x = !ls`` becomes ``x = None``); a cell magic that runs Python
(``%%time``, ``%%capture`` ...) has its first line neutralised, any other cell magic (``%%bash``,
``%%writefile`` ...) skips the cell.

Cells are numbered from 1 over *all* cells (markdown included), as they appear in the notebook.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import libcst as cst

if TYPE_CHECKING:
    from gpudoctor.check.config import Config
    from gpudoctor.check.engine import FileResult
    from gpudoctor.check.finding import Finding
    from gpudoctor.check.rule import Rule

# Cell magics whose body is Python run in the kernel: keep the body, neutralise the magic line.
PYTHON_CELL_MAGICS = {"time", "timeit", "capture", "prun", "debug", "memit", "mprun", "tensorboard"}
_CELL_MAGIC = re.compile(r"^\s*%%(?P<name>[A-Za-z_][\w-]*)")
_ASSIGN_MAGIC = re.compile(
    r"^(?P<indent>[ \t]*)(?P<targets>[A-Za-z_][\w.]*(?:[ \t]*,[ \t]*[A-Za-z_][\w.]*)*)[ \t]*=[ \t]*[%!]"
)
_HELP = re.compile(r"^[ \t]*(?:\?{1,2}[\w.*]*|[\w.*]+\?{1,2})[ \t]*$")
_AST_FLAGS = ast.PyCF_ONLY_AST | getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)


class NotebookError(Exception):
    """The notebook cannot be read (message without the path)."""


@dataclass
class CellSpan:
    index: int  # position in notebook["cells"] (0-based); shown as index + 1
    start: int  # first line of the cell in the joined module (1-based)
    lines: list[str]  # the cell's original lines, each ending with a newline
    code: list[str]  # the lines as checked (magics neutralised), same count
    placeholders: set[int] = field(default_factory=set)  # 0-based lines that were neutralised

    @property
    def number(self) -> int:
        return self.index + 1

    @property
    def end(self) -> int:  # last line (inclusive)
        return self.start + len(self.lines) - 1


@dataclass
class NotebookSource:
    notebook: dict
    text: str  # the joined, neutralised module
    cells: list[CellSpan]
    python: bool = True  # False when the kernel is not Python

    def locate(self, line: int) -> Optional[tuple[CellSpan, int]]:
        for cell in self.cells:
            if cell.start <= line <= cell.end:
                return cell, line - cell.start + 1
        return None


# ------------------------------------------------------------------------------------------------
# reading


def load(data: bytes) -> dict:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise NotebookError(f"invalid notebook: not UTF-8 ({error})") from error
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        notebook = json.loads(text)
    except json.JSONDecodeError as error:
        raise NotebookError(f"{error.lineno}:{error.colno}: invalid notebook JSON: {error.msg}") from error
    if not isinstance(notebook, dict):
        raise NotebookError("invalid notebook: the top level is not a JSON object")
    if "worksheets" in notebook or (isinstance(notebook.get("nbformat"), int) and notebook["nbformat"] < 4):
        raise NotebookError(
            f"nbformat {notebook.get('nbformat', '3')} notebooks are not supported; convert with "
            "`jupyter nbconvert --to notebook --nbformat 4`"
        )
    cells = notebook.get("cells")
    if not isinstance(cells, list):
        raise NotebookError('invalid notebook: no "cells" list')
    for number, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict) or not isinstance(cell.get("cell_type"), str):
            raise NotebookError(f"invalid notebook: cell {number} has no cell_type")
        source = cell.get("source", "")
        if not isinstance(source, str) and not (isinstance(source, list) and all(isinstance(s, str) for s in source)):
            raise NotebookError(f"invalid notebook: cell {number} source is neither a string nor a list of strings")
    return notebook


def cell_text(cell: dict) -> str:
    source = cell.get("source", "")
    return source if isinstance(source, str) else "".join(source)


def is_python(notebook: dict) -> bool:
    metadata = notebook.get("metadata") or {}
    if not isinstance(metadata, dict):
        return True
    for key, sub in (("kernelspec", "language"), ("language_info", "name")):
        value = (metadata.get(key) or {}).get(sub) if isinstance(metadata.get(key), dict) else None
        if isinstance(value, str) and value:
            return value.lower() in {"python", "python3", "ipython", "ipython3"}
    return True


def _newline(line: str) -> str:
    if line.endswith("\r\n"):
        return "\r\n"
    return "\n" if line.endswith(("\n", "\r")) else ""


def _parses(text: str) -> bool:
    try:
        compile(text, "<cell>", "exec", _AST_FLAGS, dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


def neutralise(text: str) -> Optional[tuple[list[str], list[str], set[int]]]:
    """(original lines, code lines, neutralised line numbers), or None for a cell to skip."""
    lines = text.splitlines(keepends=True)
    if lines and not _newline(lines[-1]):
        lines[-1] += "\n"
    code = list(lines)
    placeholders: set[int] = set()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is not None:
        match = _CELL_MAGIC.match(lines[first])
        if match:
            if match.group("name") not in PYTHON_CELL_MAGICS:
                return None
            code[first] = "pass" + _newline(lines[first])
            placeholders.add(first)
    if not any(_looks_magic(line) for line in code) or (not placeholders and _parses(text)):
        return lines, code, placeholders
    continuation: Optional[str] = None  # indentation of a magic continued with a backslash
    for i, line in enumerate(code):
        if i in placeholders:
            continue
        stripped = line.lstrip(" \t")
        indent = line[: len(line) - len(stripped)]
        body = stripped.rstrip("\r\n")
        if continuation is not None:
            code[i] = f"{continuation}pass{_newline(line)}"
            placeholders.add(i)
            continuation = continuation if body.endswith("\\") else None
            continue
        assign = _ASSIGN_MAGIC.match(line)
        if assign:
            code[i] = f"{assign.group('indent')}{assign.group('targets')} = None{_newline(line)}"
        elif body.startswith(("%", "!")) or _HELP.match(body):
            code[i] = f"{indent}pass{_newline(line)}"
        else:
            continue
        placeholders.add(i)
        if body.endswith("\\"):
            continuation = indent
    return lines, code, placeholders


def _looks_magic(line: str) -> bool:
    body = line.strip()
    return body.startswith(("%", "!", "?")) or body.endswith("?") or bool(_ASSIGN_MAGIC.match(line))


def build(notebook: dict) -> NotebookSource:
    spans: list[CellSpan] = []
    parts: list[str] = []
    line = 1
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        result = neutralise(cell_text(cell))
        if result is None or not result[0]:
            continue
        lines, code, placeholders = result
        spans.append(CellSpan(index, line, lines, code, placeholders))
        parts.extend(code)
        line += len(lines)
    return NotebookSource(notebook, "".join(parts), spans, is_python(notebook))


# ------------------------------------------------------------------------------------------------
# checking


def map_finding(finding: "Finding", source: NotebookSource) -> "Finding":
    located = source.locate(finding.line)
    if located is None:
        return finding
    cell, line = located
    end_line = min(finding.end_line, cell.end) - cell.start + 1 if finding.end_line else line
    finding.cell = cell.number
    finding.line = line
    finding.end_line = max(end_line, line)
    finding.source_line = cell.lines[line - 1].rstrip("\r\n")
    for related in finding.related:
        where = source.locate(related.line)
        if where is not None:
            related_cell, related_line = where
            related.end_line = max(min(related.end_line, related_cell.end) - related_cell.start + 1, related_line)
            related.cell, related.line = related_cell.number, related_line
            related.source_line = related_cell.lines[related_line - 1].rstrip("\r\n")
    return finding


def error_location(display: str, source: NotebookSource, line: int, column: int) -> str:
    located = source.locate(line)
    if located is None:
        return f"{display}:{line}:{column}"
    cell, cell_line = located
    return f"{display}[cell {cell.number}]:{cell_line}:{column}"


def check_notebook(
    path: Path, config: "Config", rules: Sequence[type["Rule"]], display: str, data: Optional[bytes] = None
) -> "FileResult":
    from gpudoctor.check.engine import (
        MAX_FILE_BYTES, FileProblem, FileResult, UnsafeSource, check_source, is_relevant, problem_result, read_source, too_big,
    )

    if data is None:
        try:
            data = read_source(path)
        except FileProblem as problem:
            return problem_result(display, problem)
    try:
        source = build(load(data))
    except NotebookError as error:
        return FileResult(display, error=f"{display}:{error}" if str(error)[:1].isdigit() else f"{display}: {error}")
    code = source.text.encode("utf-8", "surrogatepass")
    if not source.python or not source.text or not is_relevant(code):
        return FileResult(display, skipped=True)
    if len(code) > MAX_FILE_BYTES:
        return FileResult(display, error=f"{display}: its code cells: " + too_big(len(code), MAX_FILE_BYTES))
    file_rules = config.rules_for(path, rules)
    try:
        findings = check_source(source.text, display, file_rules)
    except FileProblem as problem:
        return problem_result(display, problem)
    except UnsafeSource:
        return FileResult(display, unsafe=True)
    except cst.ParserSyntaxError as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else "invalid syntax"
        line, column = error.raw_line, error.raw_column + 1
        try:  # Python's compiler gives the more precise position and wording
            compile(source.text, display, "exec", _AST_FLAGS, dont_inherit=True)
        except SyntaxError as exact:
            if exact.lineno:
                line, column, message = exact.lineno, exact.offset or 1, exact.msg
        except (ValueError, RecursionError):
            pass
        where = error_location(display, source, line, column)
        return FileResult(display, error=f"{where}: syntax error: {message}")
    except (RecursionError, MemoryError):
        return FileResult(display, error=f"{display}: too deeply nested to analyse")
    return FileResult(display, findings=[map_finding(f, source) for f in findings])


# ------------------------------------------------------------------------------------------------
# writing fixed code back


def split_back(source: NotebookSource, new_text: str) -> dict[int, str]:
    """Distribute the fixed module text back over the cells: {cell index: new source} for the cells
    whose code changed. Raises NotebookError when a change touches a neutralised magic line."""
    old = [line for cell in source.cells for line in cell.code]
    owner = [(k, j) for k, cell in enumerate(source.cells) for j in range(len(cell.lines))]
    new = new_text.splitlines(keepends=True)
    out: list[list[str]] = [[] for _ in source.cells]
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for i in range(i1, i2):
                k, j = owner[i]
                out[k].append(source.cells[k].lines[j])  # the original text (magics restored)
            continue
        for i in range(i1, i2):
            k, j = owner[i]
            if j in source.cells[k].placeholders:
                raise NotebookError(f"a fix would change the IPython line {j + 1} of cell {source.cells[k].number}")
        if i1 < i2:
            targets = [owner[i][0] for i in range(i1, i2)]
        else:  # insertion: belongs to the cell of the line before (or the first cell)
            targets = [owner[i1 - 1][0] if i1 > 0 else 0]
        for offset, j in enumerate(range(j1, j2)):
            out[targets[min(offset, len(targets) - 1)]].append(new[j])
    changed: dict[int, str] = {}
    for k, cell in enumerate(source.cells):
        text = "".join(out[k])
        original = cell_text(source.notebook["cells"][cell.index])
        if not original.endswith(("\n", "\r")) and text.endswith("\n"):
            text = text[:-2] if text.endswith("\r\n") else text[:-1]
        if text != original:
            changed[cell.index] = text
    return changed


def set_cell_source(cell: dict, text: str) -> None:
    if isinstance(cell.get("source"), list):
        cell["source"] = text.splitlines(keepends=True)
    else:
        cell["source"] = text


def dumps(notebook: dict, like: bytes) -> bytes:
    """Serialise like the file we read: nbformat writes indent=1, ensure_ascii=False and a trailing
    newline; the key order is the one read (nbformat's is sorted, so it stays sorted)."""
    indent: Optional[int] = 1
    match = re.match(rb"\{\r?\n( *)\S", like.lstrip(b"\xef\xbb\xbf"))
    if match:
        indent = len(match.group(1))
    elif not like.lstrip(b"\xef\xbb\xbf").startswith(b"{\n"):
        indent = None
    ensure_ascii = all(b < 128 for b in like) and b"\\u" in like
    text = json.dumps(notebook, indent=indent, ensure_ascii=ensure_ascii)
    if b"\r\n" in like:
        text = text.replace("\n", "\r\n")
    if like.endswith(b"\n"):
        text += "\r\n" if like.endswith(b"\r\n") else "\n"
    data = text.encode("utf-8")
    return (b"\xef\xbb\xbf" + data) if like.startswith(b"\xef\xbb\xbf") else data
