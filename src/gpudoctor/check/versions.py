"""Which library versions a diagnosis assumes: ``[tool.gpudoctor] target-versions`` first, then the
versions installed where gpudoctor runs (read from package metadata; nothing is imported)."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import metadata
from typing import Optional

# The versions the rule docs were verified against (see rules/*.md "Versions"): the newest one where several were
# (the accelerate behaviour the rules rely on is the same in 1.15.0 and 1.16.0, tests/check/test_accelerate_truth.py).
VERIFIED = {"torch": "2.13.0", "accelerate": "1.16.0", "transformers": "5.24.0", "peft": "0.21.2"}

_overrides: dict[str, str] = {}


def set_targets(targets: dict[str, str]) -> None:
    _overrides.clear()
    _overrides.update(targets)
    installed.cache_clear()


@lru_cache(maxsize=None)
def installed(package: str) -> Optional[str]:
    if package in _overrides:
        return _overrides[package]
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def major_minor(version: Optional[str]) -> Optional[tuple[int, int]]:
    if not version:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def assumed(package: str) -> tuple[str, bool]:
    """(version, True if it was found in the environment or config; False if we assume VERIFIED)."""
    version = installed(package)
    if version:
        return version, True
    return VERIFIED[package], False


def describe(package: str) -> str:
    version, found = assumed(package)
    return f"{package} {version}" + ("" if found else " (assumed; not installed here)")
