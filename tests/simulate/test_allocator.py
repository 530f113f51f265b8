"""The caching-allocator model against torch's constants, by arithmetic."""

import pytest
import torch

from gpudoctor.simulate.allocator import DeviceAllocator, format_size, round_size, segment_size
from gpudoctor.simulate.cards import UnknownCard, lookup, parse_spec

MiB = 2**20
GiB = 2**30


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512
    assert round_size(513) == 1024
    assert segment_size(round_size(4)) == 2 * MiB  # small pool
    assert segment_size(round_size(1 * MiB + 1)) == 20 * MiB  # large pool, < 10 MiB
    assert segment_size(round_size(10 * MiB)) == 10 * MiB  # exact multiple of 2 MiB
    assert segment_size(round_size(11 * MiB)) == 12 * MiB  # rounded up to 2 MiB


def test_small_blocks_share_one_segment_and_split():
    a = DeviceAllocator(0, total=1 * GiB)
    blocks = [a.malloc(1000) for _ in range(4)]
    assert a.reserved == 2 * MiB
    assert a.allocated == 4 * 1024
    a.free_block(blocks[1])
    a.free_block(blocks[2])
    assert a.allocated == 2 * 1024
    again = a.malloc(2048)  # the two freed neighbours merged into one 2048-byte block: best fit
    assert again.offset == blocks[1].offset and a.reserved == 2 * MiB


def test_large_request_takes_whole_block_when_remainder_is_small():
    a = DeviceAllocator(0, total=1 * GiB)
    block = a.malloc(19 * MiB + 512)  # 20 MiB segment, 512 KiB left: not split (large pool needs > 1 MiB)
    assert a.reserved == 20 * MiB
    assert block.size == 20 * MiB and a.allocated == 20 * MiB


def test_cached_segments_are_released_before_oom_and_oom_message_matches_torch():
    a = DeviceAllocator(0, total=100 * MiB, context=10 * MiB)
    first = a.malloc(60 * MiB)
    a.free_block(first)
    assert a.reserved == 60 * MiB  # cached
    second = a.malloc(80 * MiB)  # needs the cache released first
    assert a.reserved == 80 * MiB and second.size == 80 * MiB
    with pytest.raises(torch.OutOfMemoryError) as info:
        a.malloc(12 * MiB)
    message = str(info.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has a total capacity of 100.00 MiB "
                              "of which 10.00 MiB is free. Including non-PyTorch memory, this process has 90.00 MiB memory in use. "
                              "Of the allocated memory 80.00 MiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")


def test_format_size_boundaries():
    assert format_size(1024) == "1024 bytes"
    assert format_size(1025) == "1.00 KiB"
    assert format_size(MiB) == "1024.00 KiB"
    assert format_size(3 * GiB // 2) == "1.50 GiB"


def test_specs():
    assert [c.name for c in parse_spec("2xT4")] == ["T4", "T4"]
    assert len(parse_spec("6x3070Ti")) == 6
    assert parse_spec("1xA100-80GB")[0].name == "A100-80GB"
    assert parse_spec("4090")[0].name == "4090"
    assert parse_spec("2x16GB")[0].total == parse_spec("16GB")[0].total
    assert [c.name for c in parse_spec("1xT4+1x3090")] == ["T4", "3090"]
    with pytest.raises(UnknownCard, match="close matches: T4"):
        lookup("T5")
