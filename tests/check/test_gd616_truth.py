"""GD616 checked against the installed torch (2.13): a module does not move its inputs. A layer whose weights are on
an accelerator (a virtual ``gpu:0`` here, see gpudoctor.virtual) raises torch's device-mismatch error for a CPU input
and runs once the input is moved; a DataLoader's default collate keeps CPU samples on the CPU; the convolution's
"Input type ... and weight type ... should be the same" message is the one in the installed binary."""

import mmap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from gpudoctor.virtual import VirtualGPUs, fake_place  # noqa: E402

MISMATCH = "Expected all tensors to be on the same device, but found at least two devices"


@pytest.mark.parametrize(
    "make_layer, make_input",
    [
        (lambda: torch.nn.Linear(3, 3), lambda: torch.randn(2, 3)),  # addmm / mm
        (lambda: torch.nn.Embedding(10, 4), lambda: torch.tensor([1, 2])),  # index_select
    ],
    ids=["linear", "embedding"],
)
def test_cpu_input_into_layer_on_accelerator_raises(make_layer, make_input):
    layer = make_layer()
    with VirtualGPUs():
        fake_place(layer, {"": "gpu:0"})
        with pytest.raises(RuntimeError, match=MISMATCH):
            layer(make_input())
        assert layer(make_input().to("gpu:0")).device.type == "gpu"  # the fix: move the input


def test_default_collate_keeps_cpu_samples_on_cpu():
    loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.zeros(8)), batch_size=4, pin_memory=False)
    images, labels = next(iter(loader))
    assert images.device.type == "cpu" and labels.device.type == "cpu"


def test_convolution_message_is_in_the_installed_binary():
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not library.exists():
        pytest.skip("no libtorch_cpu.so (not a Linux wheel)")
    with library.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        assert data.find(b") should be the same or input should be a MKLDNN tensor and weight is a dense tensor") >= 0
        assert data.find(MISMATCH.encode()) >= 0
