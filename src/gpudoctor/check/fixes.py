"""``gpudoctor check --fix`` / ``--diff`` / ``--unsafe-fixes``: apply the fixes rules attach to findings.

Rules own their fixes (``Fix(edits=(Edit(node, replacement),), imports=...)``, nodes of the module the
engine parsed); this module only applies them:

1. check every file (in parallel, cached) to find the ones with an applicable fix;
2. for each of those: parse, check (suppressed findings are never fixed), pick the applicable fixes
   whose edits do not overlap, replace the nodes by identity with a libcst transformer, add the
   imports the fixes need, re-parse the result (and compile it, when the original compiled); repeat
   until no applicable fix is left (at most ``MAX_PASSES``), so a second ``--fix`` changes nothing;
3. ``--diff``: print a unified diff, write nothing; ``--fix``: write atomically (temp file in the same
   folder + ``os.replace``), keeping the encoding (BOM, PEP 263 cookie) and the line endings;
   notebooks get only the fixed cells' ``source`` rewritten;
4. re-check the written files: the result holds the findings that remain.
"""

from __future__ import annotations

import ast
import difflib
import io
import os
import tempfile
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from gpudoctor.check.config import Config
from gpudoctor.check.engine import CheckResult, FileProblem, FileResult, check_paths, check_source, read_source, safe_check_file, strip_result
from gpudoctor.check.finding import Applicability, Edit, Finding
from gpudoctor.check.rule import Rule

MAX_PASSES = 5
_AST_FLAGS = ast.PyCF_ONLY_AST | getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)


class FixError(Exception):
    pass


@dataclass
class FixedText:
    text: str
    fixed: int = 0
    codes: list[str] = field(default_factory=list)


def applicable(finding: Finding, unsafe: bool) -> bool:
    fix = finding.fix
    return fix is not None and (fix.applicability is Applicability.SAFE or unsafe)


# ------------------------------------------------------------------------------------------------
# applying edits to one module


class _ApplyEdits(cst.CSTTransformer):
    """Replace nodes by identity (``id`` plus an ``is`` check, so a recycled id never matches)."""

    def __init__(self, edits: Iterable[Edit]) -> None:
        super().__init__()
        self._edits = {id(edit.node): edit for edit in edits}
        self.applied: set[int] = set()

    def on_leave(self, original_node, updated_node):
        edit = self._edits.get(id(original_node))
        if edit is None or edit.node is not original_node:
            return updated_node
        self.applied.add(id(original_node))
        return cst.RemoveFromParent() if edit.replacement is None else edit.replacement


def _spans(module: cst.Module, findings: Sequence[Finding]):
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    for finding in findings:
        spans = []
        for edit in finding.fix.edits:
            span = positions.get(edit.node)
            if span is None:
                spans = None  # the edit names a node outside this module: cannot apply
                break
            spans.append(((span.start.line, span.start.column), (span.end.line, span.end.column)))
        yield finding, spans


def _overlaps(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def choose(module: cst.Module, findings: Sequence[Finding]) -> list[Finding]:
    """The fixes to apply in this pass: in source order, skipping any whose edits overlap an already
    chosen edit (the next pass gets it, on the re-parsed result)."""
    chosen: list[Finding] = []
    taken: list[tuple] = []
    for finding, spans in _spans(module, findings):
        if not spans:
            continue
        if any(_overlaps(s, t) for s in spans for t in taken):
            continue
        if any(_overlaps(a, b) for i, a in enumerate(spans) for b in spans[i + 1 :]):
            continue  # a fix whose own edits nest is malformed
        chosen.append(finding)
        taken.extend(spans)
    return chosen


def _is_placeholder(statement: cst.CSTNode) -> bool:
    """A bare ``pass`` line: in a notebook, an IPython line (``%pip install x``) neutralised."""
    return isinstance(statement, cst.SimpleStatementLine) and all(isinstance(s, cst.Pass) for s in statement.body)


def add_imports(module: cst.Module, imports: Iterable[tuple[str, str]]) -> cst.Module:
    """Add ``from module import name`` lines where an import belongs: after the docstring, the
    ``__future__`` imports and the leading placeholders of IPython lines, so a notebook's first
    cell keeps ``%pip install`` above the import it makes possible."""
    imports = list(dict.fromkeys(imports))
    if not imports:
        return module
    from libcst.codemod import CodemodContext
    from libcst.codemod.visitors import AddImportsVisitor

    context = CodemodContext()
    for module_name, name in imports:
        AddImportsVisitor.add_needed_import(context, module_name, name)
    lead = 0
    while lead < len(module.body) and _is_placeholder(module.body[lead]):
        lead += 1
    if not lead:
        return AddImportsVisitor(context).transform_module(module)
    rest = AddImportsVisitor(context).transform_module(module.with_changes(body=module.body[lead:], header=()))
    return rest.with_changes(body=(*module.body[:lead], *rest.body), header=module.header)


def _compiles(text: str, path: str) -> Optional[SyntaxError]:
    try:
        compile(text, path, "exec", _AST_FLAGS, dont_inherit=True)
    except SyntaxError as error:
        return error
    except ValueError as error:  # null bytes
        return SyntaxError(str(error))
    return None


def fix_text(text: str, display: str, rules: Sequence[type[Rule]], unsafe: bool) -> FixedText:
    """Apply fixes to ``text`` until none applies (at most MAX_PASSES). Raises FixError when a fix
    would produce code that does not parse; ``cst.ParserSyntaxError`` when ``text`` itself does not."""
    result = FixedText(text)
    originally_compiles = _compiles(text, display) is None
    # libcst may drop trailing blank lines or a last lone "\r" when a fix touches the last block:
    # the file keeps its own ending, byte for byte.
    ending = text[len(text.rstrip()):]
    for _ in range(MAX_PASSES):
        module = cst.parse_module(result.text)
        findings = [f for f in check_source(result.text, display, rules, module=module) if applicable(f, unsafe)]
        findings = [f for f in findings if f.fix.edits or f.fix.imports]
        if not findings:
            break
        chosen = choose(module, findings)
        if not chosen:
            break
        transformer = _ApplyEdits(edit for f in chosen for edit in f.fix.edits)
        codes = ", ".join(sorted({f.code for f in chosen}))
        try:
            new_module = module.visit(transformer)
            new_module = add_imports(new_module, (imp for f in chosen for imp in f.fix.imports))
            new_text = new_module.code
        except Exception as error:  # noqa: BLE001 - a rule's replacement node may be invalid here
            raise FixError(f"the fix for {codes} could not be applied ({type(error).__name__}: {error})") from error
        if new_text == result.text:
            break
        try:
            cst.parse_module(new_text)
        except cst.ParserSyntaxError as error:
            raise FixError(f"the fix for {codes} produced code that does not parse (line {error.raw_line}); nothing written") from error
        if originally_compiles:
            error = _compiles(new_text, display)
            if error is not None:
                raise FixError(f"the fix for {codes} produced invalid Python ({error.msg}, line {error.lineno}); nothing written")
        result.text = new_text.rstrip() + ending
        result.fixed += len(chosen)
        result.codes.extend(f.code for f in chosen)
    return result


# ------------------------------------------------------------------------------------------------
# files


@dataclass
class FileFix:
    path: Path
    display: str
    fixed: int = 0
    data: Optional[bytes] = None  # the new file content (None: unchanged)
    diff: str = ""
    error: Optional[str] = None
    original: Optional[bytes] = None  # the content the fix was computed from


def _decode(data: bytes) -> tuple[str, str]:
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)  # "utf-8-sig" with a BOM
    text = data.decode(encoding)
    if text.startswith("\ufeff"):  # a BOM together with a cookie
        text = text[1:]
        encoding = "utf-8-sig"
    return text, encoding


def unified_diff(old: str, new: str, name: str) -> str:
    old_lines = old.splitlines(keepends=True)
    new_lines = new.splitlines(keepends=True)
    out = []
    for line in difflib.unified_diff(old_lines, new_lines, f"a/{name}", f"b/{name}"):
        out.append(line if line.endswith("\n") else line.rstrip("\r") + "\n\\ No newline at end of file\n")
    return "".join(line.replace("\r\n", "\n") for line in out)


def fix_python_file(path: Path, display: str, rules: Sequence[type[Rule]], unsafe: bool) -> FileFix:
    outcome = FileFix(path, display)
    try:
        data = outcome.original = read_source(path)
        text, encoding = _decode(data)
    except (FileProblem, UnicodeDecodeError, SyntaxError, LookupError) as error:
        outcome.error = f"{display}: cannot read: {error}"
        return outcome
    try:
        fixed = fix_text(text, display, rules, unsafe)
    except cst.ParserSyntaxError:
        return outcome  # the check reports the syntax error
    except FixError as error:
        outcome.error = f"{display}: {error}"
        return outcome
    if not fixed.fixed or fixed.text == text:
        return outcome
    try:
        outcome.data = fixed.text.encode(encoding)
    except UnicodeEncodeError as error:
        outcome.error = f"{display}: the fixed code cannot be written as {encoding} ({error.reason}); nothing written"
        return outcome
    outcome.fixed = fixed.fixed
    outcome.diff = unified_diff(text, fixed.text, display)
    return outcome


def fix_notebook_file(path: Path, display: str, rules: Sequence[type[Rule]], unsafe: bool) -> FileFix:
    from gpudoctor.check import notebook

    outcome = FileFix(path, display)
    try:
        data = outcome.original = read_source(path)
        source = notebook.build(notebook.load(data))
    except (FileProblem, notebook.NotebookError):
        return outcome  # the check reports it
    if not source.python or not source.text:
        return outcome
    try:
        fixed = fix_text(source.text, display, rules, unsafe)
        if not fixed.fixed or fixed.text == source.text:
            return outcome
        changed = notebook.split_back(source, fixed.text)
    except cst.ParserSyntaxError:
        return outcome
    except (FixError, notebook.NotebookError) as error:
        outcome.error = f"{display}: {error}; nothing written"
        return outcome
    if not changed:
        return outcome
    diffs = []
    for index, text in sorted(changed.items()):
        cell = source.notebook["cells"][index]
        diffs.append(unified_diff(notebook.cell_text(cell), text, f"{display}[cell {index + 1}]"))
        notebook.set_cell_source(cell, text)
    outcome.data = notebook.dumps(source.notebook, data)
    outcome.fixed = fixed.fixed
    outcome.diff = "".join(diffs)
    return outcome


class Unwritable(Exception):
    """The fixed file is not written (the message says why)."""


def write_fixed(path: Path, original: bytes, data: bytes) -> None:
    """Replace ``path``'s content ``original`` by ``data``. Raises Unwritable when the file is
    read-only or changed since it was read (an editor saved meanwhile: its edits win); OSError."""
    info = os.stat(path)
    if not info.st_mode & 0o222 or not os.access(path, os.W_OK):
        raise Unwritable("read-only; not fixed (make it writable to fix it)")
    # Compared at the last moment: the window left is between this read and the replace below.
    try:
        current = read_source(path)
    except FileProblem as problem:
        raise Unwritable(f"{problem}; not fixed") from None
    if current != original:
        raise Unwritable("changed while it was being fixed; not written (run --fix again)")
    if info.st_nlink > 1:
        write_in_place(path, data)  # a replace would break the hard links
    else:
        write_atomic(path, data)


def write_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.write(data)
        handle.truncate()
        handle.flush()
        os.fsync(handle.fileno())


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and ``os.replace`` (keeps the mode)."""
    folder = path.resolve().parent
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".gpudoctor-tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        except OSError:
            pass
        os.replace(tmp, path.resolve())
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ------------------------------------------------------------------------------------------------
# the command


def run_fixes(
    paths: Sequence[str],
    config: Config,
    unsafe: bool,
    diff_only: bool,
    console,
    jobs: int = 1,
    use_cache: bool = False,
) -> CheckResult:
    """Fix (or, with ``diff_only``, show the fixes for) every file under ``paths``.

    Returns the findings that remain (with ``diff_only``: the findings as they are now) and sets
    ``fixed`` (findings fixed, or that would be) and ``changed`` (files written, or that would be).
    """
    first = check_paths(paths, config, jobs=jobs, use_cache=use_cache)
    files: list[FileResult] = []
    fixed = 0
    changed: list[str] = []
    for result in first.files:
        if result.error or result.skipped or not any(applicable(f, unsafe) for f in result.findings):
            files.append(result)
            continue
        path = Path(result.path)
        file_config = config.for_file(path)
        rules = file_config.selected_rules()
        file_rules = file_config.rules_for(path, rules)
        fixer = fix_notebook_file if path.suffix == ".ipynb" else fix_python_file
        outcome = fixer(path, result.path, file_rules, unsafe)
        if outcome.error:
            result.error = outcome.error
            files.append(result)
            continue
        if outcome.data is None:
            files.append(result)
            continue
        fixed += outcome.fixed
        changed.append(result.path)
        if diff_only:
            console.out(outcome.diff, end="", highlight=False)
            files.append(result)
            continue
        try:
            write_fixed(path, outcome.original, outcome.data)
        except (OSError, Unwritable) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            result.error = f"{result.path}: cannot write the fixed file: {reason}"
            fixed -= outcome.fixed
            changed.pop()
            files.append(result)
            continue
        files.append(strip_result(safe_check_file(path, file_config, rules, result.path, data=outcome.data)))
    out = CheckResult(files)
    out.fixed = fixed
    out.changed = changed
    return out
