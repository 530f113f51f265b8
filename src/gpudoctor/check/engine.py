"""paths -> discover -> prefilter -> parse once -> facts -> every rule -> positioned findings."""

from __future__ import annotations

import io
import os
import re
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

# A file is only parsed when it imports one of these (or, for notebooks, mentions them).
_RELEVANT = re.compile(
    rb"^[ \t]*(?:from|import)[ \t]+(?:torch|accelerate|transformers|peft|trl|bitsandbytes|deepspeed)\b",
    re.MULTILINE,
)

sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))


@dataclass
class FileResult:
    path: str
    findings: list[Finding] = field(default_factory=list)
    error: Optional[str] = None  # "path:line:col: message" for files we could not read or parse
    skipped: bool = False  # prefiltered: mentions none of the relevant libraries


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


# --------------------------------------------------------------------------------------------
# discovery


def discover(paths: Sequence[str], config: Config) -> tuple[list[Path], list[str]]:
    """Expand files and folders; return (files, errors for paths that do not exist)."""
    files: list[Path] = []
    errors: list[str] = []
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            errors.append(f"{raw}: no such file or directory")
            continue
        if path.is_file():
            # Explicitly named files are checked even when they match an exclude, like ruff's
            # --force-exclude default off; pre-commit passes files one by one.
            if config.is_excluded(path) and config.force_exclude:
                continue
            if path not in seen:
                seen.add(path)
                files.append(path)
            continue
        for root, dirs, names in os.walk(path):
            root_path = Path(root)
            dirs[:] = sorted(
                d for d in dirs
                if d not in SKIP_DIRS and not d.endswith(".egg-info") and not config.is_excluded(root_path / d)
                and not (root_path / d / "pyvenv.cfg").exists()
            )
            for name in sorted(names):
                if not name.endswith(PYTHON_SUFFIXES):
                    continue
                candidate = root_path / name
                if config.is_excluded(candidate) or candidate in seen:
                    continue
                seen.add(candidate)
                files.append(candidate)
    return files, errors


# --------------------------------------------------------------------------------------------
# reading


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


_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.IGNORECASE)
_IGNORE = re.compile(r"#\s*gpudoctor:\s*ignore(?:\[(?P<codes>[^\]]*)\])?", re.IGNORECASE)


def suppressed_codes(line: str) -> Optional[set[str]]:
    """Codes suppressed on ``line``; an empty set means all; None means nothing is suppressed."""
    if "#" not in line:
        return None
    codes: Optional[set[str]] = None
    for pattern in (_NOQA, _IGNORE):
        match = pattern.search(line)
        if match:
            listed = match.group("codes")
            if not listed:
                return set()
            codes = (codes or set()) | {c.upper() for c in re.split(r"[\s,]+", listed.strip()) if c}
    return codes


def is_suppressed(finding: Finding, lines: Sequence[str]) -> bool:
    """A ``noqa`` on the finding's first or last line; on a related line only when it names the code
    (``# noqa: GD413``): a bare ``# noqa`` there would silence every chain that line takes part in."""
    for number in {finding.line, finding.end_line}:
        if 1 <= number <= len(lines):
            codes = suppressed_codes(lines[number - 1])
            if codes is not None and (not codes or finding.code in codes):
                return True
    for related in finding.related:
        if 1 <= related.line <= len(lines):
            codes = suppressed_codes(lines[related.line - 1])
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
    import libcst as cst  # imported here: a run served from the cache never needs it

    from gpudoctor.check.facts import collect
    from gpudoctor.check.positions import positions as node_positions

    rule_classes = list(rules) if rules is not None else select_rules()
    active = [r for r in rule_classes if not r.triggers or any(t in source for t in r.triggers)]
    if module is None:
        module = cst.parse_module(source)  # even with no active rule: a syntax error is worth reporting
    if not active:
        return []
    facts = collect(module, source, path)
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
        if not with_suppressed and is_suppressed(finding, lines):
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
    if path.suffix == ".ipynb":
        from gpudoctor.check.notebook import check_notebook

        return check_notebook(path, config, rules, shown, data=data)
    if data is None:
        try:
            data = path.read_bytes()
        except OSError as error:
            return FileResult(shown, error=f"{shown}: cannot read: {error.strerror or error}")
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
    except cst.ParserSyntaxError as error:
        return FileResult(shown, error=syntax_error_message(shown, error, source))
    except RecursionError:
        return FileResult(shown, error=f"{shown}: too deeply nested to analyse")
    return FileResult(shown, findings=findings)


def safe_check_file(path: Path, config: Config, rules: Sequence[type[Rule]], display: Optional[str] = None, data: Optional[bytes] = None) -> FileResult:
    """``check_file`` that turns a crash inside a rule into an error for that file, not a dead run."""
    try:
        return check_file(path, config, rules, display, data)
    except Exception as error:  # noqa: BLE001 - one broken file must not stop the others
        shown = display or str(path)
        return FileResult(shown, error=f"{shown}: internal error while checking ({type(error).__name__}: {error}); please report it")


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
    processes. Findings come back as plain data (see :func:`strip_result`), in discovery order.

    ``progress``: None shows a transient bar on stderr when it is a terminal and many files need work.
    """
    config = config or Config()
    files, errors = discover(paths, config)
    results: list[Optional[FileResult]] = [FileResult(e.split(":")[0], error=e) for e in errors]
    store = None
    if use_cache:
        from gpudoctor.check.cache import Cache

        store = Cache.for_run(config)
    todo: list[tuple[int, Path]] = []
    for path in files:
        index = len(results)
        results.append(None)
        if store is None:
            todo.append((index, path))
            continue
        from gpudoctor.check.cache import digest

        try:
            data = path.read_bytes()
        except OSError:
            todo.append((index, path))  # check_file reports it
            continue
        if path.suffix != ".ipynb" and not is_relevant(data):
            results[index] = FileResult(str(path), skipped=True)
            continue
        cached = store.get(path, digest(data), str(path))
        if cached is not None:
            results[index] = cached
        else:
            todo.append((index, path))

    for index, (result, file_digest) in _run(todo, config, jobs, progress):
        results[index] = result
        if store is not None and file_digest is not None and not result.skipped:
            store.put(files[index - len(errors)], file_digest, result)
    if store is not None:
        store.save()
    return CheckResult([r for r in results if r is not None])


def _run(todo: list[tuple[int, Path]], config: Config, jobs: int, progress: Optional[bool]):
    """Yield (index, (FileResult, digest)) for every file in ``todo``, in any order."""
    if not todo:
        return
    show = progress if progress is not None else (len(todo) > PROGRESS_THRESHOLD and sys.stderr.isatty())
    bar = _Progress(len(todo)) if show else None
    try:
        if jobs > 1 and len(todo) > PARALLEL_THRESHOLD:
            yield from _run_parallel(todo, config, jobs, bar)
        else:
            for index, path in todo:
                yield index, _check_one((path, config))
                if bar:
                    bar.advance(1)
    finally:
        if bar:
            bar.stop()


def _run_parallel(todo: list[tuple[int, Path]], config: Config, jobs: int, bar):
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    jobs = min(jobs, len(todo))
    # Small chunks keep the workers evenly loaded (file sizes vary a lot); large enough to amortise IPC.
    size = max(1, min(16, len(todo) // (jobs * 4)))
    chunks = [todo[i : i + size] for i in range(0, len(todo), size)]
    done: set[int] = set()
    try:
        with ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker, initargs=(config.target_versions, hardware.assumed())) as pool:
            # Submit everything before the progress bar's thread starts: the workers are forked then.
            futures = {pool.submit(_check_chunk, [p for _, p in chunk], config): chunk for chunk in chunks}
            if bar:
                bar.start()
            for future in as_completed(futures):
                chunk = futures[future]
                for (index, _), outcome in zip(chunk, future.result()):
                    done.add(index)
                    yield index, outcome
                if bar:
                    bar.advance(len(chunk))
    except (BrokenProcessPool, OSError, RuntimeError):
        # A worker died (out of memory, a crash in a C extension) or processes are unavailable here:
        # finish what is left in this process.
        for index, path in todo:
            if index not in done:
                yield index, _check_one((path, config))
                if bar:
                    bar.advance(1)


def _init_worker(target_versions: dict[str, str], gpus) -> None:
    from gpudoctor.check import versions

    versions.set_targets(target_versions)
    hardware.set_assumed(gpus)


def _check_chunk(paths: list[Path], config: Config) -> list[tuple[FileResult, Optional[str]]]:
    return [_check_one((path, config)) for path in paths]


def _check_one(args: tuple[Path, Config]) -> tuple[FileResult, Optional[str]]:
    """Check one file; return the plain-data result and the content digest it was computed for."""
    from gpudoctor.check.cache import digest

    path, config = args
    try:
        data = path.read_bytes()
    except OSError as error:
        return FileResult(str(path), error=f"{path}: cannot read: {error.strerror or error}"), None
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
