"""``[tool.gpudoctor]`` in pyproject.toml: select, ignore, per-file-ignores, exclude, preview,
target-versions. Command-line options override the file."""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(Exception):
    pass


# ------------------------------------------------------------------------------------------------
# the table's schema: one line per key (type name shown in messages, check)


def _is_str_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_str_table(value) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _is_str_list_table(value) -> bool:
    return isinstance(value, dict) and all(_is_str_list(v) for v in value.values())


# key -> (expected, as said in an error message; test). Strings are never split into lists, and
# booleans are TOML booleans: `preview = "false"` is an error, not preview on.
SCHEMA = {
    "select": ("a list of strings", _is_str_list),
    "extend-select": ("a list of strings", _is_str_list),
    "ignore": ("a list of strings", _is_str_list),
    "per-file-ignores": ("a table of glob = list of strings", _is_str_list_table),
    "exclude": ("a list of strings", _is_str_list),
    "extend-exclude": ("a list of strings", _is_str_list),
    "preview": ("a boolean (true or false)", lambda v: isinstance(v, bool)),
    "force-exclude": ("a boolean (true or false)", lambda v: isinstance(v, bool)),
    "target-versions": ("a table of package = version string", _is_str_table),
    "gpus": ('a string such as "2xT4" or "6x8GB"', lambda v: isinstance(v, str)),
}


def _type_name(value) -> str:
    names = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}
    return next((n for t, n in names.items() if type(value) is t), type(value).__name__)


def validate(table, source) -> None:
    """Raise ConfigError naming the key, the expected type and what was found."""
    where = f"{source}: [tool.gpudoctor]"
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: `tool.gpudoctor` must be a table, got {_type_name(table)} {table!r}")
    unknown = sorted(set(table) - set(SCHEMA))
    if unknown:
        raise ConfigError(f"{where} unknown key(s): {', '.join(unknown)} (known: {', '.join(SCHEMA)})")
    for key, value in table.items():
        expected, test = SCHEMA[key]
        if not test(value):
            raise ConfigError(f"{where} {key} must be {expected}, got {_type_name(value)} {value!r}")
    if "gpus" in table:
        from gpudoctor.hardware import HardwareError, parse_gpus

        try:
            parse_gpus(table["gpus"])
        except HardwareError as error:
            raise ConfigError(f"{where} gpus: {error}") from error


@dataclass
class Overrides:
    """Command-line options; they apply on top of every configuration file a run reads."""

    select: Optional[list[str]] = None
    extend_select: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    preview: bool = False
    force_exclude: bool = False

    def apply(self, config: "Config") -> "Config":
        if self.select is not None:
            config.select = list(self.select)
        if self.extend_select:
            config.select = list(config.select or ["GD"]) + list(self.extend_select)
        config.ignore = list(config.ignore) + list(self.ignore)
        config.exclude = list(config.exclude) + list(self.exclude)
        config.preview = config.preview or self.preview
        config.force_exclude = config.force_exclude or self.force_exclude
        config.overrides = self
        return config


@dataclass
class Config:
    select: Optional[list[str]] = None
    ignore: list[str] = field(default_factory=list)
    per_file_ignores: dict[str, list[str]] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)
    preview: bool = False
    target_versions: dict[str, str] = field(default_factory=dict)
    force_exclude: bool = False
    gpus: Optional[str] = None  # "2xT4", "6x8GB": the hardware GD112/GD506 assume (gpudoctor.hardware)
    root: Path = field(default_factory=Path.cwd)
    source: Optional[Path] = None  # the pyproject.toml read, if any
    # True (``gpudoctor check`` without --config): each file is checked with the nearest pyproject.toml
    # with a [tool.gpudoctor] table above it, like ruff; this config serves files that have none.
    hierarchical: bool = False
    overrides: Optional[Overrides] = None
    _nearest: dict = field(default_factory=dict, repr=False, compare=False)

    # ---------------------------------------------------------------- loading

    @classmethod
    def discover(cls, start: Optional[Path] = None) -> "Config":
        """Read the nearest pyproject.toml with a ``[tool.gpudoctor]`` table, walking up from ``start``."""
        here = (start or Path.cwd()).resolve()
        if here.is_file():
            here = here.parent
        found = _nearest_table(here)
        if found is None:
            return cls(root=here)
        candidate, table = found
        return cls.from_table(table, candidate.parent, candidate)

    @classmethod
    def from_file(cls, path: Path) -> "Config":
        table = _read_table(path)
        return cls.from_table(table or {}, path.resolve().parent, path)

    @classmethod
    def from_table(cls, table: dict, root: Path, source: Optional[Path] = None) -> "Config":
        validate(table, source)
        select = table.get("select")
        if table.get("extend-select"):
            select = list(select or ["GD"]) + list(table["extend-select"])
        return cls(
            select=list(select) if select is not None else None,
            ignore=list(table.get("ignore", [])),
            per_file_ignores={k: list(v) for k, v in table.get("per-file-ignores", {}).items()},
            exclude=list(table.get("exclude", [])) + list(table.get("extend-exclude", [])),
            preview=table.get("preview", False),
            target_versions=dict(table.get("target-versions", {})),
            force_exclude=table.get("force-exclude", False),
            gpus=table.get("gpus"),
            root=root,
            source=source,
        )

    def for_file(self, path: Path) -> "Config":
        """The configuration ``path`` is checked with: with ``hierarchical``, the nearest
        [tool.gpudoctor] above the file (command-line options applied on top), else this one.
        Each folder is looked at once per run."""
        if not self.hierarchical:
            return self
        folder = Path(os.path.abspath(path)).parent
        if folder in self._nearest:
            return self._nearest[folder]
        walked = []
        config = self
        for parent in (folder, *folder.parents):
            if parent in self._nearest:
                config = self._nearest[parent]
                break
            walked.append(parent)
            candidate = parent / "pyproject.toml"
            table = _table_at(candidate)
            if table is None:
                continue
            if candidate != self.source:
                config = Config.from_table(table, parent, candidate)
                if self.overrides is not None:
                    self.overrides.apply(config)
            break
        for parent in walked:
            self._nearest[parent] = config
        return config

    # ---------------------------------------------------------------- questions

    def _relative(self, path: Path) -> str:
        try:
            return path.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return path.as_posix()

    def _matches(self, path: Path, pattern: str) -> bool:
        rel = self._relative(path)
        pattern = pattern.rstrip("/")
        return (
            fnmatch.fnmatch(rel, pattern)
            or fnmatch.fnmatch(path.name, pattern)
            or fnmatch.fnmatch(rel, pattern + "/*")
            or any(fnmatch.fnmatch(part, pattern) for part in Path(rel).parts)
        )

    def is_excluded(self, path: Path) -> bool:
        return any(self._matches(path, p) for p in self.exclude)

    def selected_rules(self):
        from gpudoctor.check.registry import select_rules

        return select_rules(self.select, self.ignore, self.preview)

    def rules_for(self, path: Path, rules):
        ignored = [code for pattern, codes in self.per_file_ignores.items() if self._matches(path, pattern) for code in codes]
        if not ignored:
            return rules
        return [r for r in rules if not any(r.code.startswith(c.upper()) for c in ignored)]

    def cache_key(self) -> str:
        return repr((self.select, sorted(self.ignore), sorted(self.per_file_ignores.items()), self.preview, sorted(self.target_versions.items()), self.gpus, _assumed_gpus()))




def _assumed_gpus() -> Optional[str]:
    # The hardware the run judges against (--gpus, the config, NVML) is part of every file's result.
    from gpudoctor import hardware

    gpus = hardware.assumed()
    return gpus.spec if gpus else None


def _nearest_table(folder: Path) -> Optional[tuple[Path, dict]]:
    """(pyproject.toml, its [tool.gpudoctor] table) nearest at or above ``folder``, or None."""
    for parent in (folder, *folder.parents):
        table = _table_at(parent / "pyproject.toml")
        if table is not None:
            return parent / "pyproject.toml", table
    return None


def _table_at(candidate: Path) -> Optional[dict]:
    try:
        is_file = candidate.is_file()
    except OSError:
        return None
    return _read_table(candidate) if is_file else None


def _read_table(path: Path) -> Optional[dict]:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read configuration: {error.strerror or error}") from error
    if b"gpudoctor" not in data:
        return None  # not ours: a project's pyproject.toml need not even be valid for gpudoctor to run
    try:
        parsed = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: cannot read configuration: not UTF-8 ({error.reason} at byte {error.start})") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: cannot read configuration: {error}") from error
    tool = parsed.get("tool", {})
    if not isinstance(tool, dict):
        raise ConfigError(f"{path}: `tool` must be a table, got {_type_name(tool)} {tool!r}")
    if "gpudoctor" not in tool:
        return None
    validate(tool["gpudoctor"], path)
    return tool["gpudoctor"]
