"""Loads every rule module under ``gpudoctor.check.rules``; a rule registers itself by subclassing."""

from __future__ import annotations

import importlib
import pkgutil
import re
from functools import lru_cache

from gpudoctor.check.rule import Rule, registered


@lru_cache(maxsize=None)
def all_rules() -> tuple[type[Rule], ...]:
    import gpudoctor.check.rules as package

    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
    return tuple(sorted(registered().values(), key=lambda r: r.code))


_MODULE_CODE = re.compile(r"^gd(\d{3})_")


@lru_cache(maxsize=None)
def known_codes() -> frozenset[str]:
    """Every rule code, from the module file names (``gd101_*.py``), without importing any rule."""
    import gpudoctor.check.rules as package

    return frozenset(
        f"GD{match.group(1)}"
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
        if (match := _MODULE_CODE.match(info.name.rsplit(".", 1)[-1]))
    )


def rule_by_code(code: str) -> type[Rule] | None:
    code = code.upper()
    for rule in all_rules():
        if rule.code == code:
            return rule
    return None


def select_rules(select=None, ignore=(), preview: bool = False) -> list[type[Rule]]:
    """Filter by code prefixes (``GD1`` selects the family, ``GD101`` one rule).

    Preview rules are only on with ``preview`` or when selected by their exact code.
    """

    def matches(code: str, prefixes) -> bool:
        return any(code.startswith(p.upper()) for p in prefixes)

    chosen = []
    for rule in all_rules():
        if select and not matches(rule.code, select):
            continue
        if ignore and matches(rule.code, ignore):
            continue
        if rule.preview and not preview and not (select and rule.code in {s.upper() for s in select}):
            continue
        chosen.append(rule)
    return chosen
