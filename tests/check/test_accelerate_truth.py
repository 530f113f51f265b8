"""What the accelerate-family rules (GD101-GD114, GD408, GD409, GD417) say accelerate does, checked against the
installed accelerate on CPU. Each test names the rule whose "Why is this bad" it backs. Verified with accelerate
1.15.0 and 1.16.0 (run this file with the 1.15 wheel first on ``PYTHONPATH`` to check the older one)."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import socket

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator, dispatch_model, infer_auto_device_map, load_checkpoint_and_dispatch  # noqa: E402
from accelerate.hooks import remove_hook_from_module  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402


@pytest.fixture
def fresh_state():
    """Accelerator state is a process-wide singleton: every test builds its own."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _two_linears() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))


# --- GD101 / GD107 / GD408: two CPU processes (gloo) ------------------------------------------------------------


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    AcceleratorState._reset_state(True)  # the forked child starts from the parent's singleton
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    result = {"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes}
    # dispatch_model sets `hf_device_map`, as from_pretrained(device_map=...) does
    dispatched = dispatch_model(_two_linears(), device_map={"0": "cpu", "1": "cpu"})
    try:
        accelerator.prepare(dispatched)
    except ValueError as error:
        result["prepare_error"] = str(error)
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(5.0), batch_size=2))
    seen, gathered, gathered_plain = [], [], []
    for batch in loader:
        seen += batch.tolist()
        gathered += accelerator.gather_for_metrics(batch).tolist()
        gathered_plain += accelerator.gather(batch).tolist()
    result.update(seen=seen, gathered_for_metrics=gathered, gathered=gathered_plain)
    accelerator.wait_for_everyone()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump(result, handle)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from torch.multiprocessing import start_processes

    out_dir = tmp_path_factory.mktemp("ranks")
    start_processes(_two_rank_worker, args=(_free_port(), str(out_dir)), nprocs=2, start_method="fork")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return [json.loads((out_dir / f"{rank}.json").read_text()) for rank in range(2)]


def test_gd101_prepare_refuses_a_dispatched_model_in_any_distributed_mode(two_ranks):
    for result in two_ranks:
        assert result["distributed_type"] == "DistributedType.MULTI_CPU" and result["num_processes"] == 2
        assert result["prepare_error"].startswith(
            "You can't train a model that has been loaded with `device_map='auto'` in any distributed mode.")
        assert "--num_processes=1" in result["prepare_error"]


def test_gd408_prepared_loader_shards_and_gather_for_metrics_drops_the_padding(two_ranks):
    seen = [result["seen"] for result in two_ranks]
    # 5 samples in batches of 2 per rank: each rank gets 2 batches, the last ones filled up from the start
    assert seen == [[0.0, 1.0, 4.0, 0.0], [2.0, 3.0, 1.0, 2.0]]
    for result in two_ranks:
        assert sorted(result["gathered_for_metrics"]) == [0.0, 1.0, 2.0, 3.0, 4.0]  # each sample once
        assert len(result["gathered"]) == 8  # plain gather keeps the three repeated samples


# --- GD103 / GD104 / GD113 / GD406: accumulation in one process -------------------------------------------------


def test_gd104_backward_divides_the_loss_by_the_accumulation_steps(fresh_state):
    accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = accelerator.prepare(torch.nn.Linear(1, 1, bias=False))
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.ones(1, 1)).sum())
    assert model.weight.grad.item() == pytest.approx(0.25)  # d(w*1)/dw = 1, divided by 4


def test_gd103_the_raw_optimizer_steps_on_every_micro_batch(fresh_state):
    accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = torch.nn.Linear(2, 1)
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    inner_steps = []
    raw.register_step_post_hook(lambda *args: inner_steps.append(1))
    loader = torch.utils.data.DataLoader(torch.randn(10, 2), batch_size=1)  # 10 micro-batches
    model, prepared, loader = accelerator.prepare(model, raw, loader)

    def run(optimizer) -> int:
        inner_steps.clear()
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).sum())
                optimizer.step()
                optimizer.zero_grad()
        return len(inner_steps)

    assert run(prepared) == 3  # after micro-batches 4 and 8, and at the end of the loader
    assert run(raw) == 10


def test_gd113_fp16_on_a_cpu_only_accelerator_is_silently_off(fresh_state):
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.state.mixed_precision == "fp16"
    assert accelerator.native_amp is False and accelerator.scaler is None


# --- GD105: launch config and clipping --------------------------------------------------------------------------


def test_gd105_launch_mixed_precision_applies_only_when_the_argument_is_unset(fresh_state, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert Accelerator(cpu=True).state.mixed_precision == "fp16"
    AcceleratorState._reset_state(True)
    assert Accelerator(cpu=True, mixed_precision="no").state.mixed_precision == "no"


def test_gd105_accelerator_clip_equals_torch_clip_without_fp16(fresh_state):
    accelerator = Accelerator(cpu=True)
    grads = {}
    for clip in ("accelerate", "torch"):
        model = accelerator.prepare(_two_linears())
        accelerator.backward((model(torch.ones(3, 4)) * 10).sum())
        if clip == "accelerate":
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads[clip] = (float(norm), [p.grad.clone() for p in model.parameters()])
    assert grads["accelerate"][0] == pytest.approx(grads["torch"][0]) and grads["torch"][0] > 1.0
    assert all(torch.allclose(a, b) for a, b in zip(grads["accelerate"][1], grads["torch"][1]))


# --- GD108: blocks cut between devices -------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)


def test_gd108_without_no_split_module_classes_a_block_is_cut_between_two_gpus():
    with accelerate.init_empty_weights():
        model = torch.nn.Sequential(_Block(), _Block(), _Block())  # 16.6 kB per Linear
    budgets = {0: 72_000, 1: 1_000_000}  # integer keys are GPUs; the map is computed without touching them
    cut = infer_auto_device_map(model, max_memory=budgets)
    assert cut["1.fc1"] == 0 and cut["1.fc2"] == 1  # the residual block's halves on two GPUs
    whole = infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=["_Block"])
    assert set(whole) == {"0", "1", "2"}


# --- GD109 / GD110: offload to disk -----------------------------------------------------------------------------


def test_gd109_infer_auto_device_map_puts_what_does_not_fit_on_disk():
    with accelerate.init_empty_weights():
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    device_map = infer_auto_device_map(model, max_memory={"cpu": 40_000})  # one 16.6 kB layer fits, with room for another
    assert "disk" in device_map.values() and "cpu" in device_map.values()


def test_gd109_dispatch_and_load_without_a_folder_refuse_disk_entries(tmp_path):
    with pytest.raises(ValueError, match="We need an `offload_dir` to dispatch this model"):
        dispatch_model(_two_linears(), device_map={"0": "cpu", "1": "disk"}, main_device="cpu")
    checkpoint = tmp_path / "model.bin"
    torch.save(_two_linears().state_dict(), checkpoint)
    with pytest.raises(ValueError, match="At least one of the model submodule will be offloaded to disk, please pass along an `offload_folder`"):
        load_checkpoint_and_dispatch(_two_linears(), str(checkpoint), device_map={"0": "cpu", "1": "disk"})


def test_gd110_an_offloaded_model_refuses_any_move(tmp_path):
    model = dispatch_model(_two_linears(), device_map={"0": "cpu", "1": "disk"}, main_device="cpu", offload_dir=str(tmp_path))
    for move in (lambda: model.to("cpu"), lambda: model.to(torch.float16)):
        with pytest.raises(RuntimeError, match="You can't move a model that has some modules offloaded to cpu or disk."):
            move()
    assert "to" in vars(model)
    remove_hook_from_module(model, recurse=True)  # the documented way out for a model without offload
    assert "to" not in vars(model)


# --- GD409 / GD417 ----------------------------------------------------------------------------------------------


def test_gd409_a_prepared_loader_sets_the_sampler_epoch(fresh_state):
    epochs = []

    class RecordingSampler(torch.utils.data.DistributedSampler):
        def set_epoch(self, epoch):
            epochs.append(epoch)
            super().set_epoch(epoch)

    dataset = torch.arange(4.0)
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, sampler=RecordingSampler(dataset, num_replicas=1, rank=0)))
    for _epoch in range(2):
        for _batch in loader:
            pass
    assert epochs[-2:] == [0, 1]


@pytest.mark.parametrize("name", ["accumulate", "autocast", "no_sync"])
def test_gd417_accelerator_context_managers_run_nothing_when_only_called(name):
    method = getattr(Accelerator, name)
    assert inspect.isgeneratorfunction(inspect.unwrap(method))  # a @contextmanager: the call builds a generator
