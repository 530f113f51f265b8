"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), one per virtual device.

What is modelled, with torch's constants:

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
* requests of at most 1 MiB (``kSmallSize``) come from the small pool, whose segments are 2 MiB
  (``kSmallBuffer``); larger ones from the large pool, whose segments are 20 MiB (``kLargeBuffer``) for
  requests under 10 MiB (``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``);
* a request takes the smallest free block of its pool that fits (best fit, lowest address on ties) and
  splits it when the rest is at least 512 bytes (small pool) or more than 1 MiB (large pool); freed blocks
  merge with free neighbours of the same segment;
* when no cached block fits and a new segment would exceed the device, every fully free segment is
  released (as ``release_cached_blocks`` does) and the segment retried; if it still does not fit, the
  allocation fails with torch's OOM message, naming the segment size it tried to allocate.

Not modelled: streams (one stream), ``max_split_size_mb``, ``expandable_segments``, garbage-collection
thresholds, memory other processes hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "temporaries", "other")


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(rounded: int) -> int:
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


def format_size(size: int) -> str:
    """c10's ``format_size``: bytes up to 1 KiB, then KiB, MiB, GiB with two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


class Block:
    __slots__ = ("segment", "offset", "size", "requested", "allocated", "category")

    def __init__(self, segment: "Segment", offset: int, size: int):
        self.segment = segment
        self.offset = offset
        self.size = size
        self.requested = 0
        self.allocated = False
        self.category = "other"


@dataclass(eq=False)
class Segment:
    size: int
    small: bool
    blocks: list = field(default_factory=list)  # ordered by offset


def SimulatedOutOfMemory(message: str) -> torch.OutOfMemoryError:
    """A plain ``torch.OutOfMemoryError`` (the user's traceback reads as on a real card), marked ``simulated``."""
    error = torch.OutOfMemoryError(message)
    error.simulated = True
    return error


@dataclass
class PhasePeak:
    allocated: int = 0
    reserved: int = 0
    by_category: dict = field(default_factory=dict)


class DeviceAllocator:
    """Allocated / reserved bytes of one virtual device, peaks per phase and per category."""

    def __init__(self, index: int, total: int, context: int = 0):
        self.index = index
        self.total = total
        self.context = context
        self.segments: list[Segment] = []
        self.allocated = 0
        self.reserved = 0
        self.requested = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_by_category = dict.fromkeys(CATEGORIES, 0)
        self.breakdown_at_peak = dict.fromkeys(CATEGORIES, 0)
        self.phase_peaks: dict[str, PhasePeak] = {}
        self.num_allocs = 0
        self.num_ooms = 0

    # -- queries ------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """What ``cudaMemGetInfo`` would call free: the card less the context and every reserved segment."""
        return max(self.total - self.context - self.reserved, 0)

    def reset_peaks(self) -> None:
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.peak_by_category = dict(self.by_category)
        self.breakdown_at_peak = dict(self.by_category)

    # -- malloc / free ----------------------------------------------------------------------------
    def malloc(self, nbytes: int, category: str = "other", phase: str = "other") -> Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:
            seg_bytes = segment_size(size)
            if self.reserved + seg_bytes > self.total - self.context:
                self.release_cached()
            if self.reserved + seg_bytes > self.total - self.context:
                self.num_ooms += 1
                raise SimulatedOutOfMemory(self.oom_message(seg_bytes))
            segment = Segment(seg_bytes, small)
            block = Block(segment, 0, seg_bytes)
            segment.blocks.append(block)
            self.segments.append(segment)
            self.reserved += seg_bytes
        self._split(block, size, small)
        block.allocated = True
        block.requested = nbytes
        block.category = category
        self.allocated += block.size
        self.requested += nbytes
        self.by_category[category] += block.size
        self.num_allocs += 1
        self._update_peaks(phase)
        return block

    def free_block(self, block: Block) -> None:
        if not block.allocated:
            return
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        self.by_category[block.category] -= block.size
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and not blocks[i + 1].allocated:
            block.size += blocks.pop(i + 1).size
        if i > 0 and not blocks[i - 1].allocated:
            prev = blocks[i - 1]
            prev.size += block.size
            blocks.pop(i)

    def recategorize(self, block: Block, category: str) -> None:
        if block.allocated and block.category != category:
            self.by_category[block.category] -= block.size
            self.by_category[category] += block.size
            block.category = category
            if self.by_category[category] > self.peak_by_category[category]:
                self.peak_by_category[category] = self.by_category[category]

    def release_cached(self) -> None:
        """``torch.cuda.empty_cache()``: return every fully free segment to the device."""
        keep = []
        for segment in self.segments:
            if len(segment.blocks) == 1 and not segment.blocks[0].allocated:
                self.reserved -= segment.size
            else:
                keep.append(segment)
        self.segments = keep

    # -- internals --------------------------------------------------------------------------------
    def _best_fit(self, size: int, small: bool) -> Block | None:
        best = None
        for segment in self.segments:
            if segment.small != small:
                continue
            for block in segment.blocks:
                if not block.allocated and block.size >= size and (best is None or block.size < best.size):
                    best = block
                    if block.size == size:
                        return best
        return best

    def _split(self, block: Block, size: int, small: bool) -> None:
        remaining = block.size - size
        if (small and remaining >= MIN_BLOCK) or (not small and remaining > SMALL_SIZE):
            rest = Block(block.segment, block.offset + size, remaining)
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, rest)
            block.size = size

    def _update_peaks(self, phase: str) -> None:
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
            self.breakdown_at_peak = dict(self.by_category)
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        for category, value in self.by_category.items():
            if value > self.peak_by_category[category]:
                self.peak_by_category[category] = value
        peak = self.phase_peaks.get(phase)
        if peak is None:
            peak = self.phase_peaks[phase] = PhasePeak()
        if self.allocated > peak.allocated:
            peak.allocated = self.allocated
            peak.by_category = dict(self.by_category)
        peak.reserved = max(peak.reserved, self.reserved)

    def oom_message(self, alloc_size: int) -> str:
        free = self.free
        in_use = self.total - free
        return (
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {self.index} has a total capacity of "
            f"{format_size(self.total)} of which {format_size(free)} is free. Including non-PyTorch memory, this process "
            f"has {format_size(in_use)} memory in use. Of the allocated memory {format_size(self.allocated)} is allocated "
            f"by PyTorch, and {format_size(self.reserved - self.allocated)} is reserved by PyTorch but unallocated. If "
            f"reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
            f"avoid fragmentation.  See documentation for Memory Management  "
            f"(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )

    def summary(self) -> dict:
        return {
            "device": f"cuda:{self.index}",
            "total": self.total,
            "cuda_context": self.context,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "free_at_peak": max(self.total - self.context - self.peak_reserved, 0),
            "peak_by_category": dict(self.peak_by_category),
            "breakdown_at_peak": dict(self.breakdown_at_peak),
            "phase_peaks": {name: {"allocated": p.allocated, "reserved": p.reserved, "by_category": p.by_category}
                            for name, p in self.phase_peaks.items()},
            "allocations": self.num_allocs,
        }
