"""GD611's premise, checked against the installed torch (2.13): ``torch.load`` without ``map_location``
(weights_only now defaults to True) restores every storage at the location tag it was saved with
(``cuda:0`` for a checkpoint saved by rank 0), whatever the current device; ``map_location`` bypasses
that. Run on CPU: a registered package tags the saved storages ``cuda:0`` and records where load asks them
to go."""

import io

import pytest

torch = pytest.importorskip("torch")
serialization = pytest.importorskip("torch.serialization")


@pytest.fixture
def fake_gpu_location():
    asked: list[str] = []

    def tagger(obj):
        return "cuda:0"

    def deserializer(obj, location):
        if location.startswith("cuda"):
            asked.append(location)
            return obj  # stays on CPU: no GPU here
        return None

    serialization.register_package(-1000, tagger, deserializer)
    entry = serialization._package_registry[0]
    assert entry[1] is tagger
    try:
        yield asked
    finally:
        serialization._package_registry.remove(entry)


def _checkpoint() -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save({"model": torch.nn.Linear(2, 2).state_dict()}, buffer)
    buffer.seek(0)
    return buffer


def test_unmapped_load_restores_at_the_saved_location(fake_gpu_location):
    state = torch.load(_checkpoint())  # weights_only defaults to True in torch 2.13: still the saved location
    assert set(state["model"]) == {"weight", "bias"}
    assert fake_gpu_location and set(fake_gpu_location) == {"cuda:0"}


def test_map_location_bypasses_the_saved_location(fake_gpu_location):
    state = torch.load(_checkpoint(), map_location="cpu")
    assert fake_gpu_location == []
    assert state["model"]["weight"].device.type == "cpu"


def test_weights_only_is_the_default():
    import inspect

    assert inspect.signature(torch.load).parameters["weights_only"].default is None
    assert serialization._default_to_weights_only(None) is True
