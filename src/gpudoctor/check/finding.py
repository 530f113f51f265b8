"""The one plain data type every rule produces and every reporter consumes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # libcst is only needed once a file is parsed; cached runs never import it
    import libcst as cst


class Severity(str, enum.Enum):
    """How sure we are that the code fails.

    ``error``: fails (raises, or silently trains wrong) with the versions in use.
    ``warning``: fails in a configuration the file cannot fully show (hardware, launcher, config file).
    ``info``: allowed as written, but fragile; shown, never fails the exit code.
    """

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def fails(self) -> bool:
        return self is not Severity.INFO


class Applicability(str, enum.Enum):
    SAFE = "safe"
    UNSAFE = "unsafe"


@dataclass(frozen=True)
class Edit:
    """Replace ``node`` (identity) with ``replacement``; ``None`` removes it."""

    node: cst.CSTNode
    replacement: Optional[cst.CSTNode]


@dataclass(frozen=True)
class Fix:
    description: str
    applicability: Applicability
    edits: tuple[Edit, ...]
    # Imports the fixed code needs, as (module, name) pairs: ("transformers", "BitsAndBytesConfig").
    imports: tuple[tuple[str, str], ...] = ()


@dataclass
class Related:
    """Another line that takes part in a finding (where the object was built, wrapped, prepared ...):
    often the line where the user fixes it. Same file as the finding; notebooks name its cell."""

    message: str  # what this line does in the chain: "the adapters are added here"
    line: int = 0
    column: int = 0
    end_line: int = 0
    end_column: int = 0
    cell: Optional[int] = None
    source_line: str = ""

    def to_dict(self) -> dict:
        return {
            "cell": self.cell,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "message": self.message,
            "source_line": self.source_line,
        }


@dataclass
class Finding:
    code: str
    name: str
    severity: Severity
    message: str
    path: str
    line: int = 0
    column: int = 0
    end_line: int = 0
    end_column: int = 0
    fix_hint: str = ""
    fix: Optional[Fix] = None
    # Notebook findings point to a cell; line/column are then relative to that cell.
    cell: Optional[int] = None
    source_line: str = ""
    related: list[Related] = field(default_factory=list)
    node: Optional[cst.CSTNode] = field(default=None, repr=False, compare=False)

    def location(self, where: Optional[Related] = None) -> str:
        """``path[cell N]:line:col`` of the finding, or of ``where`` (one of its related locations)."""
        at = where or self
        cell = f"[cell {at.cell}]" if at.cell is not None else ""
        return f"{self.path}{cell}:{at.line}:{at.column}"

    def sort_key(self) -> tuple:
        return (self.path, self.cell or 0, self.line, self.column, self.code)

    def to_dict(self) -> dict:
        """The stable JSON shape (documented in docs/json-schema.md)."""
        return {
            "path": self.path,
            "cell": self.cell,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "code": self.code,
            "name": self.name,
            "severity": self.severity.value,
            "message": self.message,
            "fix": (
                {
                    "description": self.fix.description,
                    "applicability": self.fix.applicability.value,
                }
                if self.fix
                else None
            ),
            "fix_hint": self.fix_hint,
            "source_line": self.source_line,
            "related": [r.to_dict() for r in self.related],
        }
