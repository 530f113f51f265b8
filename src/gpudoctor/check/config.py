"""``[tool.gpudoctor]`` in pyproject.toml: select, ignore, per-file-ignores, exclude, preview,
target-versions. Command-line options override the file."""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(Exception):
    pass


_KNOWN_KEYS = {
    "select", "ignore", "extend-select", "per-file-ignores", "exclude", "extend-exclude", "preview",
    "target-versions", "force-exclude", "gpus",
}


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

    # ---------------------------------------------------------------- loading

    @classmethod
    def discover(cls, start: Optional[Path] = None) -> "Config":
        """Read the nearest pyproject.toml with a ``[tool.gpudoctor]`` table, walking up from ``start``."""
        here = (start or Path.cwd()).resolve()
        if here.is_file():
            here = here.parent
        for folder in (here, *here.parents):
            candidate = folder / "pyproject.toml"
            if candidate.is_file():
                table = _read_table(candidate)
                if table is not None:
                    return cls.from_table(table, folder, candidate)
        return cls(root=here)

    @classmethod
    def from_file(cls, path: Path) -> "Config":
        table = _read_table(path)
        return cls.from_table(table or {}, path.resolve().parent, path)

    @classmethod
    def from_table(cls, table: dict, root: Path, source: Optional[Path] = None) -> "Config":
        unknown = set(table) - _KNOWN_KEYS
        if unknown:
            raise ConfigError(f"{source}: unknown [tool.gpudoctor] key(s): {', '.join(sorted(unknown))}")
        select = table.get("select")
        if table.get("extend-select"):
            select = list(select or ["GD"]) + list(table["extend-select"])
        return cls(
            select=_str_list(select, "select", source) if select is not None else None,
            ignore=_str_list(table.get("ignore", []), "ignore", source),
            per_file_ignores={k: _str_list(v, f"per-file-ignores.{k}", source) for k, v in table.get("per-file-ignores", {}).items()},
            exclude=_str_list(table.get("exclude", []), "exclude", source) + _str_list(table.get("extend-exclude", []), "extend-exclude", source),
            preview=bool(table.get("preview", False)),
            target_versions={str(k): str(v) for k, v in table.get("target-versions", {}).items()},
            force_exclude=bool(table.get("force-exclude", False)),
            gpus=_gpus(table.get("gpus"), source),
            root=root,
            source=source,
        )

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
        return repr((self.select, sorted(self.ignore), sorted(self.per_file_ignores.items()), self.preview, sorted(self.target_versions.items()), self.gpus))


def _read_table(path: Path) -> Optional[dict]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"{path}: cannot read configuration: {error}") from error
    tool = data.get("tool", {})
    return tool.get("gpudoctor") if isinstance(tool, dict) else None


def _gpus(value, source) -> Optional[str]:
    from gpudoctor.hardware import HardwareError, parse_gpus

    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{source}: [tool.gpudoctor] gpus must be a string such as \"2xT4\" or \"6x8GB\"")
    try:
        parse_gpus(value)
    except HardwareError as error:
        raise ConfigError(f"{source}: [tool.gpudoctor] gpus: {error}") from error
    return value


def _str_list(value, key: str, source) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{source}: [tool.gpudoctor] {key} must be a list of strings")
    return list(value)
