"""Rule documentation: ``rules/<CODE>-<name>.md`` at the top of the repository (inside the wheel
under ``gpudoctor/_bundled/rules``). Its ``## Example`` and ``## Use instead`` code blocks are tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

_PACKAGE = Path(__file__).resolve().parent.parent


def bundled_dir(name: str) -> Path:
    """A top-level folder of the repository, or its copy inside an installed wheel."""
    inside = _PACKAGE / "_bundled" / name
    if inside.is_dir():
        return inside
    return _PACKAGE.parent.parent / name


def rules_dir() -> Path:
    return bundled_dir("rules")


def doc_path(code: str, name: str) -> Path:
    return rules_dir() / f"{code}-{name}.md"


def read_doc(code: str, name: str) -> Optional[str]:
    path = doc_path(code, name)
    return path.read_text(encoding="utf-8") if path.is_file() else None


_SECTION = re.compile(r"^## (?P<title>.+?)\s*$", re.MULTILINE)
_CODE_BLOCK = re.compile(r"```python\n(?P<code>.*?)```", re.DOTALL)


def sections(text: str) -> dict[str, str]:
    out = {}
    matches = list(_SECTION.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        out[match.group("title").strip()] = text[match.end() : end].strip()
    return out


def code_blocks(section: str) -> list[str]:
    return [m.group("code") for m in _CODE_BLOCK.finditer(section)]
