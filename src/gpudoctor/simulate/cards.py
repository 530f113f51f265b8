"""The GPUs ``--simulate`` knows: the cards of :data:`gpudoctor.hardware.CARDS` (gpudoctor's one card table and
its one spec parser: ``2xT4``, ``6x3070Ti``, ``1xA100-80GB``, ``2x16GB``, ``1xT4+1x3090``) with what a
simulation adds.

``total`` is the "total capacity" torch reports for the card (from real OOM messages where one was
found; the table's source says which). ``context`` is what the CUDA context takes before the first
tensor (driver, cuBLAS/cuDNN handles with lazy module loading); it is an estimate per architecture, and
the simulation takes it off the free memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpudoctor import hardware

GiB = 2**30
MiB = 2**20

_CONTEXT = {"kepler": 300 * MiB, "pascal": 300 * MiB, "volta": 300 * MiB, "turing": 300 * MiB,  # estimates, CUDA 12
            "hopper": 500 * MiB}
_DEFAULT_CONTEXT = 400 * MiB  # Ampere / Ada / a card given by size


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


UnknownCard = hardware.HardwareError


def simulated(card: hardware.Card) -> Card:
    return Card(card.name, card.usable_bytes, _CONTEXT.get(card.arch, _DEFAULT_CONTEXT), card.arch, card.bf16, card.source)


CARDS: dict[str, Card] = {c.name: simulated(c) for c in hardware.CARDS}


def lookup(name: str) -> Card:
    """A card by name (case-insensitive, aliases such as ``Tesla T4`` or ``RTX 4090``), or a generic ``16GB`` card."""
    count, card, _ = hardware.parse_part(name)
    return simulated(card)


def parse_spec(spec: str) -> list[Card]:
    """``2xT4`` -> [T4, T4]; ``4090`` -> [4090]; ``2x16GB``; ``1xT4+1x3090`` for mixed boxes (hardware.parse_cards)."""
    cards = hardware.parse_cards(spec)
    if len(cards) > 64:
        raise UnknownCard(f"GPU count out of range in {spec!r} (at most 64 simulated cards)")
    return [simulated(c) for c in cards]


def table_rows() -> list[tuple[str, str, str, str, str]]:
    return [(c.name, f"{c.total / GiB:.2f} GiB", f"{c.context / MiB:.0f} MiB", f"{c.usable / GiB:.2f} GiB", c.source)
            for c in CARDS.values()]


def format_table() -> str:
    header = ("card", "torch total", "CUDA context", "usable", "source")
    rows = [header, *table_rows()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines.append("specs: NxNAME (2xT4, 6x3070Ti, 1xA100-80GB), NAME (4090), NxSIZE (2x16GB), mixed with + (1xT4+1x3090); "
                 "a bare A100 is the 40 GB card")
    return "\n".join(lines)
