"""GD307 checked against the installed torch (2.13): a DataLoader refuses shuffle=True together with a sampler
or a batch_sampler, and accepts shuffle=True with sampler=None (the single-GPU branch)."""

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset  # noqa: E402

_DATA = TensorDataset(torch.arange(8))


def test_sampler_and_shuffle_are_mutually_exclusive():
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        DataLoader(_DATA, shuffle=True, sampler=SequentialSampler(_DATA))


def test_batch_sampler_and_shuffle_are_mutually_exclusive():
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive with batch_size, shuffle"):
        DataLoader(_DATA, shuffle=True, batch_sampler=BatchSampler(RandomSampler(_DATA), 2, False))


def test_no_sampler_is_fine():
    assert len(DataLoader(_DATA, shuffle=True, sampler=None)) == 8
