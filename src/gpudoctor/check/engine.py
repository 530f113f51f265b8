"""paths -> discover -> prefilter -> parse once -> facts -> every rule -> positioned findings."""

from __future__ import annotations

import ast
import gc
import io
import os
import re
import stat
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from gpudoctor import hardware
from gpudoctor.check.config import Config
from gpudoctor.check.finding import Finding, Fix, Related
from gpudoctor.check.registry import select_rules
from gpudoctor.check.rule import Rule

if TYPE_CHECKING:
    import libcst as cst

# Folders never worth descending into.
SKIP_DIRS = {
    ".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox", ".nox",
    ".venv", "venv", "env", ".env", "site-packages", "node_modules", "build", "dist", ".eggs",
    ".ipynb_checkpoints", ".gpudoctor_cache",
}
PYTHON_SUFFIXES = (".py", ".pyi", ".ipynb")

# A file is only parsed when it imports one of these (or, for notebooks, mentions them): at the start of
# a line (\n, \r\n or a lone \r) or after `;`, also further down an `import a, b as c, torch` list.
_RELEVANT = re.compile(
    rb"(?:^|[\r\n;])[ \t]*(?:from|import(?:[ \t]+[\w.]+(?:[ \t]+as[ \t]+\w+)?[ \t]*,)*)[ \t]*"
    rb"(?:torch|accelerate|transformers|peft|trl|bitsandbytes|deepspeed)\b",
)

# Bounds on one file (issue 11): time and memory grow with size (a 1 MiB file of short statements
# takes ~15 s and 1.5 GB; real training scripts are under 100 KB), and libcst's native parser recurses
# once per nesting level (it crashes beyond a few thousand levels, and slows quadratically long before).
MAX_FILE_BYTES = 1024 * 1024
# A notebook's JSON carries its outputs (images, logs): only its code is held to MAX_FILE_BYTES.
MAX_NOTEBOOK_BYTES = 64 * 1024 * 1024
MAX_NESTING = 1000

sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))


class FileProblem(Exception):
    """This file cannot be checked (the message, without the path)."""


@dataclass
class FileResult:
    path: str
    findings: list[Finding] = field(default_factory=list)
    error: Optional[str] = None  # "path:line:col: message" for files we could not read or parse
    skipped: bool = False  # prefiltered: mentions none of the relevant libraries
    # What an error means for the exit status: "file" (unreadable, unparsable, too big: fails the run
    # like a finding, exit 1), "path" (a named path does not exist) or "internal" (our bug): exit 2.
    error_kind: str = "file"
    unsafe: bool = False  # not checked here: its parse may crash this process (see guard_source)


@dataclass
class CheckResult:
    files: list[FileResult]
    fixed: int = 0  # --fix: findings fixed (--diff: that would be)
    changed: list[str] = field(default_factory=list)  # --fix: files written (--diff: that would be)

    @property
    def findings(self) -> list[Finding]:
        out = [f for r in self.files for f in r.findings]
        out.sort(key=Finding.sort_key)
        return out

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.files if r.error]

    @property
    def hard_errors(self) -> list[str]:
        """Errors that mean the run itself went wrong (exit 2), not a file that could not be checked."""
        return [r.error for r in self.files if r.error and r.error_kind != "file"]


# --------------------------------------------------------------------------------------------
# discovery


def discover(paths: Sequence[str], config: Config) -> tuple[list[Path], list[FileResult]]:
    """Expand files and folders into regular files, each once (by identity, however it is spelled);
    return (files, errors for paths that do not exist or cannot be listed)."""
    files: list[Path] = []
    errors: list[FileResult] = []
    seen: set = set()

    def add(candidate: Path, info: os.stat_result) -> None:
        key = (info.st_dev, info.st_ino)
        if key not in seen:
            seen.add(key)
            files.append(candidate)

    for raw in paths:
        path = Path(raw)
        try:
            info = path.stat()
        except FileNotFoundError:
            errors.append(FileResult(raw, error=f"{raw}: no such file or directory", error_kind="path"))
            continue
        except OSError as error:
            errors.append(FileResult(raw, error=f"{raw}: cannot read: {error.strerror or error}"))
            continue
        if not stat.S_ISDIR(info.st_mode):
            if not stat.S_ISREG(info.st_mode):
                errors.append(FileResult(raw, error=f"{raw}: not a regular file (a pipe, device or socket); not read"))
                continue
            # Explicitly named files are checked even when they match an exclude, like ruff's
            # --force-exclude default off; pre-commit passes files one by one.
            file_config = config.for_file(path)
            if not (file_config.force_exclude and file_config.is_excluded(path)):
                add(path, info)
            continue

        def unreadable(error: OSError) -> None:
            where = error.filename or raw
            errors.append(FileResult(str(where), error=f"{where}: cannot read folder: {error.strerror or error}"))

        for root, dirs, names in os.walk(path, onerror=unreadable):
            root_path = Path(root)
            dirs[:] = sorted(d for d in dirs if _descend(root_path / d, config))
            for name in sorted(names):
                if not name.endswith(PYTHON_SUFFIXES):
                    continue
                candidate = root_path / name
                if config.for_file(candidate).is_excluded(candidate):
                    continue
                try:
                    info = candidate.stat()
                except OSError:
                    continue  # a dangling link
                if stat.S_ISREG(info.st_mode):  # never a FIFO, device or a link to one
                    add(candidate, info)
    return files, errors


def _descend(folder: Path, config: Config) -> bool:
    name = folder.name
    if name in SKIP_DIRS or name.endswith(".egg-info") or config.for_file(folder / "x").is_excluded(folder):
        return False
    try:
        return not (folder / "pyvenv.cfg").exists()  # a virtual environment
    except OSError:
        return True  # unreadable: os.walk reports it


# --------------------------------------------------------------------------------------------
# reading


def read_source(path: Path, limit: Optional[int] = None) -> bytes:
    """A regular file's bytes, at most ``limit`` of them (default: by kind of file). Raises
    FileProblem. Opened without blocking and checked after opening, so a FIFO or device (or a link
    to one) is never read."""
    if limit is None:
        limit = MAX_NOTEBOOK_BYTES if path.suffix == ".ipynb" else MAX_FILE_BYTES
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as error:
        raise FileProblem(f"cannot read: {error.strerror or error}") from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileProblem("not a regular file (a pipe, device or socket); not read")
        if info.st_size > limit:
            raise FileProblem(too_big(info.st_size, limit))
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise FileProblem(too_big(size, limit))
        return b"".join(chunks)
    except OSError as error:
        raise FileProblem(f"cannot read: {error.strerror or error}") from error
    finally:
        os.close(fd)


def too_big(size: int, limit: int) -> str:
    return f"skipped: {size / 2**20:.1f} MiB is over the {limit / 2**20:g} MiB limit for one file (exclude it to silence this)"


def guard_source(source: str, path: str) -> None:
    """Refuse, cleanly, what would crash or stall libcst's native parser (issue 11).

    Most files are shallow (see :func:`shallow`, ~1 % of a parse): libcst cannot get deep on them.
    The others are parsed by CPython first (its parser caps brackets at 200 levels and raises
    RecursionError on deeper trees), then the nesting depth of its tree is measured without
    recursion. Raises FileProblem; raises UnsafeSource when CPython rejects the code for another
    reason (newer syntax, or a syntax error): libcst may still parse it, but only in a process that is
    allowed to die (see ``_run``)."""
    if shallow(source):
        return
    try:
        tree = compile(source, path, "exec", _AST_FLAGS, dont_inherit=True)
    except SyntaxError as error:
        if any(words in str(error.msg) for words in _NESTING_ERRORS):
            raise FileProblem(f"{error.lineno or 1}:{error.offset or 1}: syntax error: {error.msg}") from None
        if not _ISOLATED:
            raise UnsafeSource() from None
        return
    except (RecursionError, MemoryError):
        raise FileProblem(f"too deeply nested to analyse (over {MAX_NESTING} levels)") from None
    except ValueError:  # null bytes
        if not _ISOLATED:
            raise UnsafeSource() from None
        return
    if nesting(tree) > MAX_NESTING:
        raise FileProblem(f"too deeply nested to analyse (over {MAX_NESTING} levels)")


class UnsafeSource(Exception):
    pass


_AST_FLAGS = ast.PyCF_ONLY_AST | getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
_NESTING_ERRORS = ("too many nested", "too many levels of indentation", "too complex", "too many statically nested")
# True in a worker process, whose death the parent survives: parse anything there.
_ISOLATED = False


# Strings and comments, as the tokenizer sees them (leftmost first, so a `#` in a string is not a
# comment and a quote in a comment is not a string); blanked before brackets are counted.
_STRINGS_AND_COMMENTS = re.compile(
    r"[rRbBuUfF]{0,2}(?:"
    r"'''.*?'''"
    r'|""".*?"""'
    r"|'(?:[^'\\\r\n]|\\.)*'"
    r'|"(?:[^"\\\r\n]|\\.)*"'
    r")|#[^\r\n]*",
    re.DOTALL,
)


def _blank(match: re.Match) -> str:
    text = match.group()
    if "\r" not in text:
        return "s" + "\n" * text.count("\n") if "\n" in text else "s"
    return "s" + "".join(c for c in text if c in "\r\n")  # keep the line count


def shallow(source: str, longest: int = 2 * MAX_NESTING) -> bool:
    """True when no logical line (physical lines joined while a bracket is open or a backslash
    continues them; strings and comments blanked) is longer than ``longest`` characters, brackets
    nest under 100 levels and indentation stays under 200 characters: libcst's tree cannot then get
    deep enough to crash or stall (its depth is bounded by a logical line's tokens plus the blocks)."""
    depth = length = 0
    for line in _STRINGS_AND_COMMENTS.sub(_blank, source).splitlines():
        opened = line.count("(") + line.count("[") + line.count("{")
        closed = line.count(")") + line.count("]") + line.count("}")
        depth = max(depth + opened - closed, 0)
        length += len(line)
        if length > longest or opened > 100 or depth > 100 or len(line) - len(line.lstrip()) > 200:
            return False
        if depth == 0 and not line.endswith("\\"):
            length = 0
    return True


def nesting(tree: ast.AST) -> int:
    """The depth of libcst's tree for this code, measured on CPython's: ``a and b and c`` is one
    node there but a chain in libcst, so a boolean operation counts once per operand."""
    deepest = 0
    stack = [(tree, 1)]
    pop, push, children, bool_op = stack.pop, stack.append, ast.iter_child_nodes, ast.BoolOp
    while stack:
        node, depth = pop()
        if type(node) is bool_op:
            depth += len(node.values) - 2  # n operands: a chain of n - 1 nodes instead of one
        if depth > deepest:
            deepest = depth
        for child in children(node):
            push((child, depth + 1))
    return deepest


def decode_source(data: bytes) -> str:
    """Decode like Python does: BOM, PEP 263 coding cookie, else UTF-8."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    text = data.decode(encoding)
    return text[1:] if text.startswith("\ufeff") else text


def is_relevant(data: bytes) -> bool:
    from gpudoctor.check.apis import SNIPPET_USE  # snippets use the libraries without importing them

    return _RELEVANT.search(data) is not None or SNIPPET_USE.search(data) is not None


# --------------------------------------------------------------------------------------------
# checking one source


_NOQA = re.compile(r"#\s*noqa(?P<colon>\s*:\s*(?P<codes>[^#]*))?", re.IGNORECASE)
_IGNORE = re.compile(r"#\s*gpudoctor:\s*ignore(?:\[(?P<codes>[^\]]*)\])?", re.IGNORECASE)
_CODE = re.compile(r"[A-Za-z]+[0-9]+")


def _listed_codes(text: str) -> set[str]:
    """Codes at the start of ``text`` (``GD104, GD105 reason`` -> both); a word that is not exactly a
    code (``gd104x``) ends the list, so it never matches a code it merely starts with."""
    codes = set()
    for word in re.split(r"[\s,]+", text.strip()):
        if not _CODE.fullmatch(word):
            break
        codes.add(word.upper())
    return codes


def suppressed_codes(comment: str) -> Optional[set[str]]:
    """Codes a comment suppresses; an empty set means all; None means nothing is suppressed."""
    if "#" not in comment:
        return None
    codes: Optional[set[str]] = None
    noqa = _NOQA.search(comment)
    if noqa:
        if noqa.group("colon") is None:
            return set()
        codes = _listed_codes(noqa.group("codes")) or None  # `# noqa: junk` suppresses nothing
    ignore = _IGNORE.search(comment)
    if ignore:
        if ignore.group("codes") is None:
            return set()
        codes = (codes or set()) | _listed_codes(ignore.group("codes").replace(",", " ")) or codes
    return codes


def comments_by_line(source: str) -> dict[int, str]:
    """Line -> the comments on it, from the tokenizer: a ``# noqa`` inside a
    string is not a comment. Falls back to the raw lines when this Python cannot tokenize the source."""
    out: dict[int, str] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source, newline="").readline):
            if token.type == tokenize.COMMENT:
                out[token.start[0]] = out.get(token.start[0], "") + token.string
    except (tokenize.TokenError, SyntaxError, ValueError):
        return {n: line for n, line in enumerate(source.splitlines(), start=1) if "#" in line}
    return out


def is_suppressed(finding: Finding, comments: dict[int, str]) -> bool:
    """A ``noqa`` on the finding's first or last line; on a related line only when it names the code
    (``# noqa: GD413``): a bare ``# noqa`` there would silence every chain that line takes part in."""
    for number in {finding.line, finding.end_line}:
        codes = suppressed_codes(comments.get(number, ""))
        if codes is not None and (not codes or finding.code in codes):
            return True
    for related in finding.related:
        codes = suppressed_codes(comments.get(related.line, ""))
        if codes and finding.code in codes:
            return True
    return False


def check_source(
    source: str,
    path: str = "<string>",
    rules: Optional[Iterable[type[Rule]]] = None,
    module: Optional[cst.Module] = None,
    with_suppressed: bool = False,
) -> list[Finding]:
    """Run ``rules`` (default: every stable rule) over one source text. Raises cst.ParserSyntaxError."""
    # The cyclic garbage collector is paused while one file is checked: libcst allocates millions of
    # objects, and the facts (scopes <-> bindings) keep the whole tree in reference cycles, so automatic
    # collections kept re-traversing a tree that is still in use; the file's garbage is collected once,
    # by the first collection after this returns (the engine's CPU time was ~15 % garbage collection).
    if not gc.isenabled():
        return _check_source(source, path, rules, module, with_suppressed)
    gc.disable()
    try:
        return _check_source(source, path, rules, module, with_suppressed)
    finally:
        gc.enable()


def _check_source(
    source: str,
    path: str,
    rules: Optional[Iterable[type[Rule]]],
    module: Optional[cst.Module],
    with_suppressed: bool,
) -> list[Finding]:
    import libcst as cst  # imported here: a run served from the cache never needs it

    from gpudoctor.check.facts import collect

    rule_classes = list(rules) if rules is not None else select_rules()
    present: dict[str, bool] = {}  # rules share triggers: look each one up once

    def triggered(rule_class) -> bool:
        for trigger in rule_class.triggers:
            found = present.get(trigger)
            if found is None:
                found = present[trigger] = trigger in source
            if found:
                return True
        return False

    active = [r for r in rule_classes if not r.triggers or triggered(r)]
    if module is None:
        guard_source(source, path)
        module = cst.parse_module(source)  # even with no active rule: a syntax error is worth reporting
    if not active:
        return []
    facts = collect(module, source, path)
    try:
        return _findings(facts, active, module, source, path, with_suppressed)
    finally:
        facts.release()


def _findings(
    facts, active: list[type[Rule]], module: cst.Module, source: str, path: str, with_suppressed: bool
) -> list[Finding]:
    from gpudoctor.check.positions import positions as node_positions

    reports = []
    for rule_class in active:
        rule = rule_class()
        for report in rule.check(facts):
            reports.append((rule_class, report))
    if not reports:
        return []
    # Positions only for files that have something to say, and only of the reported nodes: rendering
    # the module to count lines is the expensive part of libcst (see check/positions.py).
    positions = node_positions(
        module, [node for _, report in reports for node in (report.node, *(n for n, _ in report.related))]
    )
    lines = source.splitlines()
    comments = comments_by_line(source) if "#" in source and not with_suppressed else {}
    findings: list[Finding] = []
    seen = set()
    for rule_class, report in reports:
        span = positions.get(report.node)
        if span is None:
            continue
        key = (rule_class.code, span.start.line, span.start.column)
        if key in seen:
            continue
        seen.add(key)
        finding = Finding(
            code=rule_class.code,
            name=rule_class.name,
            severity=report.severity or rule_class.severity,
            message=report.message + facts.assumption_note,
            path=path,
            line=span.start.line,
            column=span.start.column + 1,
            end_line=span.end.line,
            end_column=span.end.column + 1,
            fix_hint=report.fix_hint,
            fix=report.fix,
            source_line=lines[span.start.line - 1] if span.start.line <= len(lines) else "",
            related=_related(report.related, positions, lines, span.start.line),
            node=report.node,
        )
        if not with_suppressed and is_suppressed(finding, comments):
            continue
        findings.append(finding)
    findings.sort(key=Finding.sort_key)
    return findings


def _related(chain, positions, lines: Sequence[str], own_line: int) -> list[Related]:
    """Positioned related locations, one per line, without the finding's own line."""
    out: list[Related] = []
    seen = {own_line}
    for node, message in chain:
        span = positions.get(node)
        if span is None or span.start.line in seen:
            continue
        seen.add(span.start.line)
        out.append(
            Related(
                message,
                span.start.line,
                span.start.column + 1,
                span.end.line,
                span.end.column + 1,
                source_line=lines[span.start.line - 1] if span.start.line <= len(lines) else "",
            )
        )
    return out


def syntax_error_message(path: str, error: cst.ParserSyntaxError, source: str = "") -> str:
    """Python's own compiler gives the more precise position and wording; libcst's is the fallback."""
    try:
        compile(source, path, "exec", flags=0x400, dont_inherit=True)  # ast.PyCF_ONLY_AST
    except SyntaxError as exact:
        if exact.lineno:
            return f"{path}:{exact.lineno}:{exact.offset or 1}: syntax error: {exact.msg}"
    except (ValueError, RecursionError):
        pass
    message = str(error).strip().splitlines()[0] if str(error).strip() else "invalid syntax"
    return f"{path}:{error.raw_line}:{error.raw_column + 1}: syntax error: {message}"


def check_file(
    path: Path, config: Config, rules: Sequence[type[Rule]], display: Optional[str] = None, data: Optional[bytes] = None
) -> FileResult:
    shown = display or str(path)
    use_targets(config)
    if path.suffix == ".ipynb":
        from gpudoctor.check.notebook import check_notebook

        return check_notebook(path, config, rules, shown, data=data)
    if data is None:
        try:
            data = read_source(path)
        except FileProblem as problem:
            return problem_result(shown, problem)
    if not is_relevant(data):
        return FileResult(shown, skipped=True)
    try:
        source = decode_source(data)
    except (UnicodeDecodeError, SyntaxError, LookupError) as error:
        return FileResult(shown, error=f"{shown}: cannot decode: {error}")
    file_rules = config.rules_for(path, rules)
    import libcst as cst

    try:
        findings = check_source(source, shown, file_rules)
    except FileProblem as problem:
        return problem_result(shown, problem)
    except UnsafeSource:
        return FileResult(shown, unsafe=True)
    except cst.ParserSyntaxError as error:
        return FileResult(shown, error=syntax_error_message(shown, error, source))
    except (RecursionError, MemoryError):
        return FileResult(shown, error=f"{shown}: too deeply nested to analyse")
    return FileResult(shown, findings=findings)


def problem_result(shown: str, problem: FileProblem) -> FileResult:
    message = str(problem)
    return FileResult(shown, error=f"{shown}:{message}" if message[:1].isdigit() else f"{shown}: {message}")


_targets: Optional[dict] = None


def use_targets(config: Config) -> None:
    """Each file's own configuration says which library versions its diagnosis assumes."""
    global _targets
    if config.target_versions != _targets:
        from gpudoctor.check import versions

        versions.set_targets(config.target_versions)
        _targets = dict(config.target_versions)


def safe_check_file(path: Path, config: Config, rules: Sequence[type[Rule]], display: Optional[str] = None, data: Optional[bytes] = None) -> FileResult:
    """``check_file`` that turns a crash inside a rule into an error for that file, not a dead run."""
    try:
        return check_file(path, config, rules, display, data)
    except Exception as error:  # noqa: BLE001 - one broken file must not stop the others
        shown = display or str(path)
        message = f"{shown}: internal error while checking ({type(error).__name__}: {error}); please report it"
        return FileResult(shown, error=message, error_kind="internal")


def strip_result(result: FileResult) -> FileResult:
    """Plain data only: no libcst nodes (they do not cross processes or go to the cache); a fix keeps
    its description and applicability (reports show it) but not its edits (only ``--fix`` needs them,
    and it re-derives them from a fresh parse)."""
    for finding in result.findings:
        finding.node = None
        if finding.fix is not None and finding.fix.edits:
            finding.fix = Fix(finding.fix.description, finding.fix.applicability, (), finding.fix.imports)
    return result


# Below this many files to (re)check, a process pool costs more than it saves.
PARALLEL_THRESHOLD = 8
# Above this many files to (re)check, show a progress bar on a terminal.
PROGRESS_THRESHOLD = 50


def check_paths(
    paths: Sequence[str],
    config: Optional[Config] = None,
    jobs: int = 1,
    use_cache: bool = False,
    progress: Optional[bool] = None,
) -> CheckResult:
    """Check files and folders: cached results for unchanged files, the rest in parallel over ``jobs``
    processes. Findings come back as plain data (see :func:`strip_result`), in discovery order. Each
    file is checked with ``config.for_file(path)`` (the nearest [tool.gpudoctor] when hierarchical).

    ``progress``: None shows a transient bar on stderr when it is a terminal and many files need work.
    """
    config = config or Config()
    files, errors = discover(paths, config)
    results: list[Optional[FileResult]] = list(errors)
    stores: dict[int, object] = {}  # one cache per configuration (its root and settings)
    todo: list[tuple[int, Path, Config]] = []
    store_of: dict[int, object] = {}
    for path in files:
        index = len(results)
        results.append(None)
        file_config = config.for_file(path)
        if not use_cache:
            todo.append((index, path, file_config))
            continue
        from gpudoctor.check.cache import Cache, digest

        store = stores.get(id(file_config))
        if store is None:
            store = stores[id(file_config)] = Cache.for_run(file_config)
        store_of[index] = store
        try:
            data = read_source(path)
        except FileProblem:
            todo.append((index, path, file_config))  # check_file reports it
            continue
        if path.suffix != ".ipynb" and not is_relevant(data):
            results[index] = FileResult(str(path), skipped=True)
            continue
        cached = store.get(path, digest(data), str(path))
        if cached is not None:
            results[index] = cached
        else:
            todo.append((index, path, file_config))

    paths_by_index = {index: path for index, path, _ in todo}
    for index, (result, file_digest) in _run(todo, jobs, progress):
        results[index] = result
        store = store_of.get(index)
        if store is not None and file_digest is not None and not result.skipped and result.error_kind == "file":
            store.put(paths_by_index[index], file_digest, result)
    for store in stores.values():
        store.save()
    return CheckResult([r for r in results if r is not None])


Todo = list[tuple[int, Path, Config]]


def _run(todo: Todo, jobs: int, progress: Optional[bool]):
    """Yield (index, (FileResult, digest)) for every file in ``todo``, in any order. A file whose parse
    could crash this process is checked in a child process (see ``_run_isolated``)."""
    if not todo:
        return
    show = progress if progress is not None else (len(todo) > PROGRESS_THRESHOLD and sys.stderr.isatty())
    bar = _Progress(len(todo)) if show else None
    unsafe: Todo = []
    try:
        jobs = min(jobs, len(todo), os.cpu_count() or 1)
        outcomes = _run_parallel(todo, jobs, bar) if jobs > 1 and len(todo) > PARALLEL_THRESHOLD else _run_here(todo, bar)
        for index, path, config, outcome in outcomes:
            if outcome[0].unsafe:
                unsafe.append((index, path, config))
            else:
                yield index, outcome
        for index, _path, _config, outcome in _run_isolated(unsafe, bar):
            yield index, outcome
    finally:
        if bar:
            bar.stop()


def _run_here(todo: Todo, bar):
    for index, path, config in todo:
        yield index, path, config, _check_one(path, config)
        if bar:
            bar.advance(1)


def _run_parallel(todo: Todo, jobs: int, bar):
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    # Small chunks keep the workers evenly loaded (file sizes vary a lot); large enough to amortise IPC.
    size = max(1, min(16, len(todo) // (jobs * 4)))
    chunks = [todo[i : i + size] for i in range(0, len(todo), size)]
    done: set[int] = set()
    try:
        with ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker, initargs=(hardware.assumed(),)) as pool:
            # Submit everything before the progress bar's thread starts: the workers are forked then.
            futures = {pool.submit(_check_chunk, [(p, c) for _, p, c in chunk]): chunk for chunk in chunks}
            if bar:
                bar.start()
            for future in as_completed(futures):
                chunk = futures[future]
                for (index, path, config), outcome in zip(chunk, future.result()):
                    done.add(index)
                    yield index, path, config, outcome
                if bar:
                    bar.advance(len(chunk))
    except BrokenProcessPool:
        # A worker died (a crash in a C extension, out of memory): never retry its files in this
        # process; each file left is checked alone in a child, so the one that kills it is named.
        yield from _run_isolated([item for item in todo if item[0] not in done], bar)
    except (OSError, RuntimeError):
        # Processes are unavailable here: check in this process (files that could crash it are
        # still sent to _run_isolated, which reports them if it cannot start a process either).
        yield from _run_here([item for item in todo if item[0] not in done], bar)


def _run_isolated(todo: Todo, bar):
    """Check each file alone in a one-worker pool; a file that kills the worker is an error."""
    if not todo:
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    pool = None
    try:
        for index, path, config in todo:
            try:
                if pool is None:
                    # spawn: a clean process, whatever threads this one runs (the progress bar)
                    pool = ProcessPoolExecutor(
                        1, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(hardware.assumed(),)
                    )
                outcome = pool.submit(_check_one, path, config).result()
            except BrokenProcessPool:
                pool.shutdown(wait=False, cancel_futures=True)
                pool = None
                message = f"{path}: the parser crashed on this file (checked alone in a child process); not checked"
                outcome = (FileResult(str(path), error=message), None)
            except (OSError, RuntimeError) as error:
                message = f"{path}: not checked: it needs a child process to parse safely, and none could start ({error})"
                outcome = (FileResult(str(path), error=message, error_kind="internal"), None)
            yield index, path, config, outcome
            if bar:
                bar.advance(1)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _init_worker(gpus) -> None:
    global _ISOLATED
    _ISOLATED = True  # this process may die: the parent survives it and names the file
    hardware.set_assumed(gpus)  # spawned workers do not inherit the run's hardware


def _check_chunk(items: list[tuple[Path, Config]]) -> list[tuple[FileResult, Optional[str]]]:
    return [_check_one(path, config) for path, config in items]


def _check_one(path: Path, config: Config) -> tuple[FileResult, Optional[str]]:
    """Check one file; return the plain-data result and the content digest it was computed for."""
    from gpudoctor.check.cache import digest

    try:
        data = read_source(path)
    except FileProblem as problem:
        return problem_result(str(path), problem), None
    result = safe_check_file(path, config, config.selected_rules(), data=data)
    return strip_result(result), digest(data)


class _Progress:
    """A transient rich progress bar on stderr."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]checking"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            console=Console(stderr=True), transient=True,
        )
        self._task = self._progress.add_task("check", total=total)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._progress.start()

    def advance(self, n: int) -> None:
        self.start()
        self._progress.advance(self._task, n)

    def stop(self) -> None:
        if self._started:
            self._progress.stop()
