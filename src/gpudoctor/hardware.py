"""GPUs as data: the common cards and their memory, parsing of ``2xT4`` / ``6x8GB`` / ``24GB``, and the
local GPUs read through NVML (nvidia-ml-py; never torch).

One table for every part of gpudoctor that reasons about hardware: ``check`` (GD112/GD506 and the
``--gpus`` option), the file-statement parser in ``check.queries`` and ``trace --simulate``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

GIB = 1024**3
GB = 1000**3


class HardwareError(ValueError):
    """A GPU specification that cannot be read; the message lists close matches."""


MIB = 1024**2
OOM_SOURCE = "measured: 'total capacity' in real CUDA OOM messages"
TYPICAL_SOURCE = "typical total CUDA reports for the card (no OOM message found)"


@dataclass(frozen=True)
class Card:
    name: str  # as people write it: "T4", "A100-80GB", "3070 Ti"
    nominal_gb: int  # the marketed size ("16 GB")
    usable_gib: float  # what CUDA reports as total memory (torch.cuda.mem_get_info / OOM "total capacity")
    aliases: tuple[str, ...] = ()
    arch: str = "ampere"  # turing, ampere, ada, hopper, ...: compute capability and bf16 in simulations
    bf16: bool = True
    source: str = TYPICAL_SOURCE  # where usable_gib comes from

    @property
    def usable_bytes(self) -> int:
        return int(round(self.usable_gib * GIB / MIB)) * MIB


# The one card table of gpudoctor (check's --gpus / GD112 / GD506, trace --simulate, plan). Totals are
# what CUDA reports (torch's OOM message "GPU 0 has a total capacity of X GiB"): measured from real OOM
# messages where one was found (the source says so), else the usual figure for the card. The first card
# of a family is its smallest variant: a bare "V100" or "A100" is read as that one (A100 = 40 GB).
CARDS: tuple[Card, ...] = (
    Card("T4", 16, 14.74, ("tesla t4",), "turing", False, OOM_SOURCE + " (Kaggle/Colab: 'total capacity of 14.74 GiB')"),
    Card("P100", 16, 15.89, ("p100-16gb",), "pascal", False),
    Card("K80", 12, 11.2, (), "kepler", False),
    Card("V100", 16, 15.77, ("v100-16gb", "v100-16g"), "volta", False),
    Card("V100-32GB", 32, 31.74, ("v100-32g",), "volta", False),
    Card("A10G", 24, 21.99),
    Card("A10", 24, 21.99),
    Card("L4", 24, 22.03, (), "ada"),
    Card("A100", 40, 39.39, ("a100-40gb", "a100-40g")),
    Card("A100-80GB", 80, 79.15, ("a100-80g",), source=OOM_SOURCE + " ('total capacity of 79.15 GiB')"),
    Card("H100", 80, 79.11, ("h100-80gb",), "hopper"),
    Card("H200", 141, 139.81, ("h200-141gb",), "hopper"),
    Card("1080", 8, 7.9, ("1080ti",), "pascal", False),
    Card("2080", 8, 7.8, ("2080ti",), "turing", False),
    Card("3060", 12, 11.76, ("3060-12gb",)),
    Card("3070", 8, 7.8),
    Card("3070 Ti", 8, 7.58, ("3070ti",), source=OOM_SOURCE + " (field report 003: 'total capacty of 7.58 GiB')"),
    Card("3080", 10, 9.77, ("3080-10gb",)),
    Card("3080-12GB", 12, 11.8),
    Card("3090", 24, 23.69, ("3090ti",)),
    Card("4060", 8, 7.8, (), "ada"),
    Card("4070", 12, 11.8, (), "ada"),
    Card("4080", 16, 15.7, (), "ada"),
    Card("4090", 24, 23.65, (), "ada", source=OOM_SOURCE),
)

# The largest card most people fine-tune on (RTX 3090/4090, A10G, L4): above this, a run needs a
# 40/80 GB data-centre card or sharding, whatever single GPU the file does not name.
LARGEST_COMMON_GB = 24
# The largest GPU training usually runs on (A100/H100 80 GB): what an unknown single GPU is assumed to be
# when a warning must hold whatever the card (GD506).
LARGEST_TRAINING_GB = 80


def _normal(text: str) -> str:
    """"NVIDIA GeForce RTX 3070 Ti" -> "3070ti"; "A100 80GB" -> "a10080gb"."""
    text = text.lower()
    text = re.sub(r"\b(?:nvidia|geforce|tesla|quadro|rtx|gtx)\b", " ", text)
    return re.sub(r"[\s_\-]+", "", text)


def _family(card: Card) -> str:
    """"A100-80GB" -> "A100", "3070 Ti" -> "3070 Ti"."""
    return re.sub(r"-\d+GB$", "", card.name)


@lru_cache(maxsize=None)
def _by_name() -> dict[str, Card]:
    table: dict[str, Card] = {}
    for entry in CARDS:
        # Each card also answers to its family plus its size: "A100 40GB", "T4 16GB", "3070 Ti 8GB".
        for name in (entry.name, *entry.aliases, f"{_family(entry)}{entry.nominal_gb}GB"):
            table.setdefault(_normal(name), entry)
    return table


def card(name: str) -> Optional[Card]:
    """The card a name denotes ("Tesla T4", "RTX 3070 Ti", "A100 80GB", "a100-80gb"), or None."""
    return _by_name().get(_normal(name))


def nominal_gb_by_family() -> dict[str, int]:
    """Family name ("T4", "3070", "A100") -> its smallest variant's marketed GB, for text that names a card."""
    table: dict[str, int] = {}
    for entry in CARDS:
        table.setdefault(_family(entry).split(" ")[0], entry.nominal_gb)
    return table


@dataclass(frozen=True)
class Gpus:
    """Identical GPUs: how many, the memory of each, and where that came from."""

    count: int
    bytes_each: int
    label: str  # "T4", "8 GB", "NVIDIA A100-SXM4-80GB"
    source: str  # "--gpus 2xT4", "[tool.gpudoctor] gpus", "local GPUs (NVML)", "the file"
    detected: bool = False  # read from this machine, not declared for the script

    @property
    def gib_each(self) -> float:
        return self.bytes_each / GIB

    @property
    def gb_each(self) -> float:
        return self.bytes_each / GB

    @property
    def spec(self) -> str:
        """A canonical ``--gpus`` value that parses back to the same memory."""
        return f"{self.count}x{self.gib_each:.1f}GiB"

    def describe(self) -> str:
        if re.fullmatch(r"[\d.]+ Gi?B", self.label):  # given as a size: nothing to add
            head = f"{self.count} x {self.label}"
        else:
            head = f"{self.count} x {self.label} ({self.gib_each:.1f} GiB usable)"
        return f"{head}, from {self.source}" if self.source else head


_SPEC = re.compile(r"^\s*(?:(?P<count>\d+)\s*[x×*]\s*)?(?P<what>.+?)\s*$", re.IGNORECASE)
_SIZE = re.compile(r"^(?P<amount>\d+(?:\.\d+)?)\s*(?P<unit>GB|GiB|G)$", re.IGNORECASE)


def parse_gpus(spec: str, source: str = "") -> Gpus:
    """``"2xT4"``, ``"6x3070Ti"``, ``"1xA100-80GB"``, ``"4090"``, ``"2x16GB"``, ``"24GB"`` -> :class:`Gpus`.

    Raises :class:`HardwareError` naming the close matches when the card is unknown.
    """
    count, found, label = parse_part(spec)
    return Gpus(count, found.usable_bytes if label is None else int(round(found.usable_gib * GIB)), label or found.name, source)


def parse_cards(spec: str) -> list[Card]:
    """``"2xT4"`` -> [T4, T4]; mixed machines with ``+``: ``"1xT4+1x3090"``; sizes: ``"2x16GB"``."""
    cards: list[Card] = []
    for part in (spec or "").split("+"):
        count, found, _ = parse_part(part, spec)
        cards.extend([found] * count)
    return cards


def parse_part(spec: str, whole: str | None = None) -> tuple[int, Card, Optional[str]]:
    """One ``N x NAME`` or ``N x SIZE``: (count, card, size label or None). A size is a generic card."""
    whole = spec if whole is None else whole
    match = _SPEC.match(spec or "")
    if not match or not match.group("what"):
        raise HardwareError(f"empty GPU specification {whole!r}: expected e.g. 2xT4, 6x8GB, 1xA100-80GB or 24GB")
    count = int(match.group("count") or 1)
    if not 1 <= count <= 1024:
        raise HardwareError(f"GPU count {count} in {whole!r} is out of range (1-1024)")
    what = match.group("what")
    size = _SIZE.match(what)
    if size:
        amount = float(size.group("amount"))
        if amount <= 0:
            raise HardwareError(f"GPU memory in {whole!r} must be positive")
        per_gpu = amount * (GIB if size.group("unit").lower() == "gib" else GB)
        label = f"{amount:g} {size.group('unit').upper().replace('GIB', 'GiB')}"
        generic = Card(label.replace(" ", ""), int(round(per_gpu / GB)), per_gpu / GIB, (), "generic", True,
                       "a size given in the spec (no card named)")
        return count, generic, label
    found = card(what)
    if found is None:
        names = [c.name for c in CARDS]
        close = difflib.get_close_matches(what, names, n=4, cutoff=0.4) or difflib.get_close_matches(
            _normal(what), [_normal(n) for n in names], n=4, cutoff=0.4
        )
        hint = f"close matches: {', '.join(close)}; " if close else ""
        raise HardwareError(
            f"unknown GPU {what!r} in {whole!r} ({hint}known: {', '.join(names)}); "
            "or give the memory per GPU, e.g. 2x16GB (gpudoctor trace --list-gpus)"
        )
    return count, found, None


@lru_cache(maxsize=1)
def local_gpus() -> Optional[Gpus]:
    """The GPUs of this machine through NVML, or None when nvidia-ml-py or a driver is missing.

    Mixed GPUs are described by the smallest one (a model must fit the smallest of them).
    """
    try:
        import pynvml  # nvidia-ml-py; optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound / DriverNotLoaded / ...: unknown hardware
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count < 1:
            return None
        devices = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        memory = [int(pynvml.nvmlDeviceGetMemoryInfo(d).total) for d in devices]
        name = pynvml.nvmlDeviceGetName(devices[memory.index(min(memory))])
        name = name.decode() if isinstance(name, bytes) else str(name)
        return Gpus(count, min(memory), name, "local GPUs (NVML)", detected=True)
    except Exception:  # noqa: BLE001 - a half-working driver: treat the hardware as unknown
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


# ------------------------------------------------------------------------------------------------
# The hardware one `gpudoctor check` run assumes (set from --gpus / [tool.gpudoctor] gpus / NVML).

_ASSUMED: Optional[Gpus] = None


def set_assumed(gpus: Optional[Gpus]) -> None:
    global _ASSUMED
    _ASSUMED = gpus


def assumed() -> Optional[Gpus]:
    return _ASSUMED


def for_file(stated: Optional[tuple[int, float, str]]) -> Optional[Gpus]:
    """The GPUs to judge one file against: declared for the run (``--gpus``, ``[tool.gpudoctor] gpus``)
    first, then what the file itself states (``stated``: count, GB each, the text), then this machine's
    GPUs; None when nothing is known."""
    run = assumed()
    if run is not None and not run.detected:
        return run
    if stated is not None:
        count, gb_each, text = stated
        return Gpus(count, int(gb_each * GB), f"{gb_each:g} GB", f'the file ("{text}")')
    return run
