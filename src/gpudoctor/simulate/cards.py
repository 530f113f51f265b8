"""The GPUs ``--simulate`` knows, and the parser of specs such as ``2xT4``, ``6x3070Ti``, ``1xA100-80GB``, ``2x16GB``.

``total`` is the "total capacity" torch reports for the card (``cudaMemGetInfo`` total, the figure in
its OOM message), taken from real OOM messages where one was found, else the usual figure for the card.
``context`` is what the CUDA context takes before the first tensor (driver, cuBLAS/cuDNN handles with
lazy module loading); it is an estimate per architecture, and the simulation takes it off the free
memory. The lead may unify this table with ``gpudoctor.hardware`` (one table for ``check`` and ``trace``).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Card:
    name: str
    total: int  # bytes torch reports as total capacity
    context: int  # bytes the CUDA context takes
    arch: str
    bf16: bool
    source: str

    @property
    def usable(self) -> int:
        return self.total - self.context


def _gib(x: float) -> int:
    return int(round(x * GiB / MiB)) * MiB


_TURING_CONTEXT = 300 * MiB  # estimate (Turing/Pascal/Volta, CUDA 12 with lazy loading)
_AMPERE_CONTEXT = 400 * MiB  # estimate (Ampere/Ada)
_HOPPER_CONTEXT = 500 * MiB  # estimate (Hopper)
_OOM = "OOM messages seen in public logs"
_TYPICAL = "typical reported total (no OOM message found)"

CARDS: dict[str, Card] = {c.name: c for c in (
    Card("T4", _gib(14.74), _TURING_CONTEXT, "turing", False, _OOM + " (Kaggle/Colab: 'total capacity of 14.74 GiB')"),
    Card("P100", _gib(15.89), _TURING_CONTEXT, "pascal", False, _TYPICAL),
    Card("V100-16GB", _gib(15.77), _TURING_CONTEXT, "volta", False, _TYPICAL),
    Card("V100-32GB", _gib(31.74), _TURING_CONTEXT, "volta", False, _TYPICAL),
    Card("A10G", _gib(21.99), _AMPERE_CONTEXT, "ampere", True, _TYPICAL),
    Card("L4", _gib(22.03), _AMPERE_CONTEXT, "ada", True, _TYPICAL),
    Card("3060-12GB", _gib(11.76), _AMPERE_CONTEXT, "ampere", True, _TYPICAL),
    Card("3070Ti", _gib(7.58), _AMPERE_CONTEXT, "ampere", True, "field report 003 ('total capacty of 7.58 GiB')"),
    Card("3080", _gib(9.77), _AMPERE_CONTEXT, "ampere", True, _TYPICAL),
    Card("3090", _gib(23.69), _AMPERE_CONTEXT, "ampere", True, _TYPICAL),
    Card("4090", _gib(23.65), _AMPERE_CONTEXT, "ada", True, _OOM),
    Card("A100-40GB", _gib(39.39), _AMPERE_CONTEXT, "ampere", True, _TYPICAL),
    Card("A100-80GB", _gib(79.15), _AMPERE_CONTEXT, "ampere", True, _OOM + " ('total capacity of 79.15 GiB')"),
    Card("H100", _gib(79.11), _HOPPER_CONTEXT, "hopper", True, _TYPICAL),
    Card("H200", _gib(139.81), _HOPPER_CONTEXT, "hopper", True, _TYPICAL),
)}

_ALIASES = {"3070TI": "3070Ti", "3060": "3060-12GB", "A100": "A100-80GB", "A100-80G": "A100-80GB", "A100-40G": "A100-40GB",
            "V100": "V100-16GB", "V100-32G": "V100-32GB", "H100-80GB": "H100", "A10": "A10G", "RTX4090": "4090",
            "RTX3090": "3090", "RTX3080": "3080", "RTX3070TI": "3070Ti", "TESLA-T4": "T4"}
_GENERIC_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(GB|GIB|G)$", re.I)


class UnknownCard(ValueError):
    pass


def _key(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip()).upper()


def lookup(name: str) -> Card:
    """A card by name (case-insensitive, aliases such as ``A100`` or ``RTX4090``), or a generic ``16GB`` card."""
    key = _key(name)
    by_key = {_key(n): c for n, c in CARDS.items()}
    if key in by_key:
        return by_key[key]
    if key in _ALIASES:
        return CARDS[_ALIASES[key]]
    generic = _GENERIC_RE.match(key)
    if generic:
        size = float(generic.group(1))
        # a generic card: nominal GB as sold (10^9) is roughly what torch reports in GiB minus a little
        total = _gib(size * 1e9 / GiB * 0.985)
        return Card(f"{generic.group(1)}GB", total, _AMPERE_CONTEXT, "generic", True, "generic card: 98.5% of the nominal size")
    choices = list(CARDS) + list(_ALIASES)
    close = difflib.get_close_matches(name.strip(), choices, n=4, cutoff=0.4) or \
        difflib.get_close_matches(key, [_key(c) for c in choices], n=4, cutoff=0.4)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise UnknownCard(f"unknown GPU {name!r}.{hint} Known: {', '.join(CARDS)} or a size such as 16GB "
                      "(gpudoctor trace --list-gpus)")


_SPEC_RE = re.compile(r"^\s*(?:(\d+)\s*[x×*]\s*)?(.+?)\s*$", re.I)


def parse_spec(spec: str) -> list[Card]:
    """``2xT4`` -> [T4, T4]; ``4090`` -> [4090]; ``2x16GB``; ``1xT4+1x3090`` for mixed boxes."""
    cards: list[Card] = []
    for part in spec.split("+"):
        match = _SPEC_RE.match(part)
        if not match or not match.group(2):
            raise UnknownCard(f"not a GPU spec: {spec!r} (examples: 2xT4, 6x3070Ti, 1xA100-80GB, 4090, 2x16GB)")
        count_text, name = match.group(1), match.group(2)
        # "4090" alone is a card, not a count: only "N x NAME" carries a count
        count = int(count_text) if count_text else 1
        if count < 1 or count > 64:
            raise UnknownCard(f"GPU count out of range in {spec!r}")
        cards.extend([lookup(name)] * count)
    return cards


def table_rows() -> list[tuple[str, str, str, str, str]]:
    return [(c.name, f"{c.total / GiB:.2f} GiB", f"{c.context / MiB:.0f} MiB", f"{c.usable / GiB:.2f} GiB", c.source)
            for c in CARDS.values()]


def format_table() -> str:
    header = ("card", "torch total", "CUDA context", "usable", "source")
    rows = [header, *table_rows()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines.append("specs: NxNAME (2xT4, 6x3070Ti, 1xA100-80GB), NAME (4090), NxSIZE (2x16GB), mixed with + (1xT4+1x3090)")
    return "\n".join(lines)
