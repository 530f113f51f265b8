"""Storage the engine counts as CUDA's allocator would hold it: ``untyped_storage().resize_`` (FSDP2 frees and
re-gathers its unsharded parameters so) and DTensors, whose memory is their local shard."""

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from gpudoctor.simulate import Simulation

KiB = 1024


def test_resize_to_zero_frees_and_resize_up_allocates():
    with Simulation("1x8GB") as sim:
        allocator = sim.allocators[0]
        x = torch.empty(1024, device="cuda")  # 4 KiB, a multiple of the 512-byte block
        storage = x.untyped_storage()
        assert allocator.allocated == 4 * KiB
        storage.resize_(0)
        assert allocator.allocated == 0 and storage.nbytes() == 0
        storage.resize_(4 * KiB)
        assert allocator.allocated == 4 * KiB
        del x, storage
        assert allocator.allocated == 0  # the block held after the resize is the one freed with the storage
        assert allocator.peak_allocated == 4 * KiB


def test_resize_up_holds_old_and_new_block_while_copying():
    with Simulation("1x8GB") as sim:
        allocator = sim.allocators[0]
        x = torch.empty(1024, device="cuda")
        x.untyped_storage().resize_(8 * KiB)
        # resize_bytes_cuda allocates the new block, copies, then frees the old one
        assert allocator.allocated == 8 * KiB and allocator.peak_allocated == 12 * KiB
        x.untyped_storage().resize_(2 * KiB)
        assert allocator.allocated == 2 * KiB and allocator.peak_allocated == 12 * KiB


def test_resize_keeps_the_storage_category():
    with Simulation("1x8GB") as sim:
        allocator = sim.allocators[0]
        x = torch.empty(1024, device="cuda")  # made while loading: weights
        x.untyped_storage().resize_(0)
        sim.phase = "forward"
        x.untyped_storage().resize_(4 * KiB)
        assert allocator.by_category["weights"] == 4 * KiB and allocator.by_category["activations"] == 0


def test_resize_past_the_card_raises_the_oom_and_keeps_the_storage():
    with Simulation("1x8GB") as sim:
        x = torch.empty(1024, device="cuda")
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
            x.untyped_storage().resize_(16 * 2**30)
        assert x.untyped_storage().nbytes() == 4 * KiB and sim.allocators[0].allocated == 4 * KiB


@pytest.fixture
def two_rank_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_counts_its_local_shard(two_rank_mesh):
    with Simulation("2x8GB") as sim:
        allocator = sim.allocators[0]
        with unset_fake_temporarily():  # the mesh's rank arithmetic needs real tensors
            mesh = init_device_mesh("gpu", (2,))
        local = torch.empty(512, device="cuda")  # rank 0's half of 1024 fp32: 2 KiB
        param = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        assert param.shape == (1024,) and allocator.allocated == 2 * KiB
        moment = torch.zeros_like(param)  # AdamW's exp_avg of a DTensor parameter
        assert isinstance(moment, DTensor) and moment.shape == (1024,)
        assert allocator.allocated == 4 * KiB
        del moment
        assert allocator.allocated == 2 * KiB
