"""Per-file result cache: ``<project root>/.gpudoctor_cache/<settings>.json``.

An entry is reused when the file's *content hash* is unchanged and the run's settings are the same:
the settings fingerprint covers the gpudoctor version, ``Config.cache_key()`` (select, ignore,
per-file-ignores, preview, target-versions), the set of active rule codes, the library versions the
rules may read (``versions.installed``) and the size/mtime of gpudoctor's own check code (so an edited
rule never serves stale results during development). A changed setting simply selects another cache
file; ``gpudoctor clean`` removes them all.

Only plain data is stored (no libcst nodes): findings keep their fix's description and
applicability, which is all a report needs. Writes are atomic (temp file + ``os.replace``) and merge
with what another process may have written meanwhile (pre-commit runs several gpudoctor processes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from gpudoctor import __version__
from gpudoctor.check.finding import Applicability, Finding, Fix, Related, Severity

if TYPE_CHECKING:
    from gpudoctor.check.config import Config
    from gpudoctor.check.engine import FileResult

CACHE_DIR = ".gpudoctor_cache"
FORMAT = 1
# Libraries whose installed version a rule may consult (gpudoctor.check.versions).
_LIBRARIES = ("torch", "accelerate", "transformers", "peft", "trl", "bitsandbytes", "deepspeed")
_CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by gpudoctor.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """Size and mtime of every module under gpudoctor.check (rules included)."""
    here = Path(__file__).resolve().parent
    parts = []
    for path in sorted(here.rglob("*.py")):
        try:
            stat = path.stat()
        except OSError:
            continue
        parts.append(f"{path.relative_to(here).as_posix()}:{stat.st_size}:{stat.st_mtime_ns}")
    return digest("\n".join(parts).encode())


def settings_key(config: "Config") -> str:
    """Everything besides a file's content that its findings depend on. The selected rules follow from
    the configuration and the code fingerprint, so computing the key imports no rule (nor libcst)."""
    from gpudoctor.check import versions

    parts = [
        f"format={FORMAT}",
        f"version={__version__}",
        f"config={config.cache_key()}",
        "libs=" + ",".join(f"{name}={versions.installed(name)}" for name in _LIBRARIES),
        f"code={_code_fingerprint()}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def cache_dir(root: Path) -> Path:
    return Path(root) / CACHE_DIR


# The only files the cache writes (a hostile repository may commit a `.gpudoctor_cache` link or fill
# the folder: nothing else is ever deleted, and a link is never followed).
_SETTINGS_FILE = re.compile(r"[0-9a-f]{20}\.json")
_OWN_FILES = ("CACHEDIR.TAG", ".gitignore")
_TEMP_FILE = re.compile(r"\.tmp-\w+\.json")
# A settings file bigger than this is not ours to read.
MAX_CACHE_BYTES = 256 * 2**20


def _real_folder(folder: Path) -> bool:
    """True when ``folder`` is a folder itself, not a symbolic link (or junction) to one."""
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and not _is_junction(folder)


def _is_junction(folder: Path) -> bool:
    is_junction = getattr(os.path, "isjunction", None)
    return bool(is_junction and is_junction(folder))


# ------------------------------------------------------------------------------------------------
# (de)serialising results


def finding_to_data(finding: Finding) -> dict:
    return {
        "code": finding.code,
        "name": finding.name,
        "severity": finding.severity.value,
        "message": finding.message,
        "line": finding.line,
        "column": finding.column,
        "end_line": finding.end_line,
        "end_column": finding.end_column,
        "fix_hint": finding.fix_hint,
        "fix": [finding.fix.description, finding.fix.applicability.value] if finding.fix else None,
        "cell": finding.cell,
        "source_line": finding.source_line,
        "related": [r.to_dict() for r in finding.related],
    }


def finding_from_data(data: dict, path: str) -> Finding:
    fix = data.get("fix")
    return Finding(
        code=data["code"],
        name=data["name"],
        severity=Severity(data["severity"]),
        message=data["message"],
        path=path,
        line=data["line"],
        column=data["column"],
        end_line=data["end_line"],
        end_column=data["end_column"],
        fix_hint=data.get("fix_hint", ""),
        fix=Fix(fix[0], Applicability(fix[1]), ()) if fix else None,
        cell=data.get("cell"),
        source_line=data.get("source_line", ""),
        related=[Related(**r) for r in data.get("related", ())],
    )


class Cache:
    """One settings fingerprint's entries: absolute path -> {digest, findings, error}."""

    def __init__(self, root: Path, settings: str) -> None:
        self.root = Path(root)
        self.file = cache_dir(self.root) / f"{settings}.json"
        self._entries: Optional[dict[str, dict]] = None
        self._dirty: dict[str, dict] = {}

    @classmethod
    def for_run(cls, config: "Config") -> "Cache":
        return cls(config.root, settings_key(config))

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = _read(self.file)
        return self._entries

    @staticmethod
    def key(path: Path) -> str:
        return os.path.abspath(path)

    def get(self, path: Path, file_digest: str, display: str) -> Optional["FileResult"]:
        from gpudoctor.check.engine import FileResult

        entry = self._load().get(self.key(path))
        # An entry of the wrong shape (hand-edited, another version, a hostile repository) is a miss.
        if not isinstance(entry, dict) or entry.get("digest") != file_digest:
            return None
        error = entry.get("error")
        findings = entry.get("findings", [])
        if not isinstance(findings, list) or not (error is None or isinstance(error, str)):
            return None
        try:
            findings = [finding_from_data(f, display) for f in findings]
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            return None
        return FileResult(display, findings=findings, error=display + error if error is not None else None)

    def put(self, path: Path, file_digest: str, result: "FileResult") -> None:
        error = None
        if result.error is not None:
            # Stored without the displayed path so another working directory can reuse it.
            error = result.error[len(result.path):] if result.error.startswith(result.path) else ": " + result.error
        entry = {"digest": file_digest, "findings": [finding_to_data(f) for f in result.findings], "error": error}
        self._load()[self.key(path)] = entry
        self._dirty[self.key(path)] = entry

    def save(self) -> None:
        """Merge our new entries into the file on disk and replace it atomically. Never raises."""
        if not self._dirty:
            return
        folder = self.file.parent
        try:
            try:
                folder.mkdir(exist_ok=False)
            except FileExistsError:
                pass
            if not _real_folder(folder):
                return  # a link or a file in its place: never write through it
            for name, text in (("CACHEDIR.TAG", _CACHEDIR_TAG), (".gitignore", "# Created by gpudoctor.\n*\n")):
                marker = folder / name
                if not os.path.lexists(marker):
                    with open(marker, "x", encoding="utf-8") as handle:  # "x": never through a link
                        handle.write(text)
            entries = _read(self.file)  # another process may have added entries meanwhile
            entries.update(self._dirty)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    json.dump({"format": FORMAT, "version": __version__, "entries": entries}, handle, separators=(",", ":"))
                os.chmod(tmp, 0o644)
                os.replace(tmp, self.file)
            except BaseException:
                _unlink(tmp)
                raise
        except OSError:
            return  # a read-only checkout still gets checked, just without a cache
        self._entries = entries
        self._dirty.clear()
        _prune(folder, keep=self.file)


# Each settings fingerprint has its own file; keep the most recently written few.
MAX_SETTINGS_FILES = 8


def _own_files(folder: Path) -> list[tuple[Path, os.stat_result]]:
    """The regular files in ``folder`` that the cache writes (never a link, never anything else)."""
    out = []
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if not (_SETTINGS_FILE.fullmatch(name) or _TEMP_FILE.fullmatch(name) or name in _OWN_FILES):
            continue
        try:
            info = os.lstat(folder / name)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            out.append((folder / name, info))
    return out


def _prune(folder: Path, keep: Path) -> None:
    if not _real_folder(folder):
        return
    files = [(p, i) for p, i in _own_files(folder) if _SETTINGS_FILE.fullmatch(p.name) and p != keep]
    files.sort(key=lambda item: item[1].st_mtime, reverse=True)
    for old, _ in files[MAX_SETTINGS_FILES - 1 :]:
        _unlink(str(old))


def _read(file: Path) -> dict[str, dict]:
    if not _real_folder(file.parent):
        return {}
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return {}
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_CACHE_BYTES:
            return {}
        with os.fdopen(fd, encoding="utf-8", closefd=False) as handle:
            data = json.load(handle)
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def clean(root: Path) -> tuple[Optional[str], str]:
    """Remove the files ``<root>/.gpudoctor_cache`` holds that the cache wrote, then the folder when it
    is left empty (root: the config root, found from ``root`` upwards). A link is never followed.

    Returns (the folder, what happened) for the message; (None, "") when there was no cache.
    """
    from gpudoctor.check.config import Config, ConfigError

    candidates = [Path(root)]
    try:
        candidates.insert(0, Config.discover(Path(root)).root)
    except ConfigError:
        pass
    for folder in dict.fromkeys(c.resolve() for c in candidates):
        target = cache_dir(folder)
        if not os.path.lexists(target):
            continue
        if not _real_folder(target):
            return str(target), "not removed: it is not a folder but a link or a file, and gpudoctor never follows or deletes it"
        removed = 0
        for path, _ in _own_files(target):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
        try:
            os.rmdir(target)
        except OSError:
            left = "; other files were left in place" if os.path.isdir(target) else ""
            return str(target), f"removed {removed} cache file{'s' if removed != 1 else ''}{left}"
        return str(target), "removed"
    return None, ""
