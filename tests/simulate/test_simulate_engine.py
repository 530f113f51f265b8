"""A tiny model simulated end to end: exact bytes, the OOM where a real card would fail, stand-ins."""

import contextlib

import pytest
import torch
import torch.nn as nn

from gpudoctor.simulate import Simulation

MiB = 2**20


def test_cuda_queries_answer_for_the_named_cards():
    with Simulation("2xT4") as sim:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        assert torch.cuda.get_device_properties(1).total_memory == sim.cards[1].total
        free, total = torch.cuda.mem_get_info(0)
        assert total - free == sim.cards[0].context
        x = torch.empty(1024, 1024, device="cuda:1")  # 4 MiB: one 20 MiB large-pool segment
        assert x.device.type == "gpu" and x.device.index == 1
        assert torch.cuda.memory_allocated(1) == 4 * MiB
        assert torch.cuda.memory_reserved(1) == 20 * MiB
        del x
        assert torch.cuda.memory_allocated(1) == 0 and torch.cuda.memory_reserved(1) == 20 * MiB
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved(1) == 0
    assert not torch.cuda.is_available()  # undone on exit


def test_adam_step_bytes_by_arithmetic():
    n = 1024 * 1024  # one fp32 weight of 4 MiB, no bias
    with Simulation("1x8GB") as sim:
        model = nn.Linear(1024, 1024, bias=False).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(8, 1024, device="cuda")
        model(x).sum().backward()
        opt.step()
        summary = sim.summary()["devices"][0]
        # weights + grad + two Adam moments stay; the step count lives on the CPU
        assert torch.cuda.memory_allocated() == 4 * n + 8 * 1024 * 4 + 4 * n * 3
        assert summary["peak_by_category"]["weights"] >= 4 * n
        assert summary["peak_by_category"]["gradients"] == 4 * n
        assert summary["peak_by_category"]["optimizer_state"] >= 8 * n


def test_oom_where_a_real_card_fails_with_torch_message():
    with Simulation("1x1GB") as sim:
        usable = sim.cards[0].usable
        keep = torch.empty(usable // 2, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(usable // 2 + 64 * MiB, dtype=torch.uint8, device="cuda")
        assert info.value.simulated
        assert str(info.value).startswith("CUDA out of memory. Tried to allocate ")
        assert "GPU 0 has a total capacity of" in str(info.value)
        del keep


def test_module_to_keeps_tied_weights_shared():
    with Simulation("1x8GB"):
        emb = nn.Embedding(1000, 256)
        head = nn.Linear(256, 1000, bias=False)
        head.weight = emb.weight
        model = nn.ModuleDict({"emb": emb, "head": head}).to("cuda")
        assert model["emb"].weight is model["head"].weight
        assert torch.cuda.memory_allocated() == 1000 * 256 * 4


def test_data_dependent_values_get_stand_ins():
    with Simulation("1x8GB") as sim:
        t = torch.randn(10, device="cuda")
        assert t.sum().item() == 0.0
        assert bool((t > 0).any()) is False
        assert t[t > 0].shape == (10,)  # boolean mask: every element selected
        assert torch.tensor(3.0).item() == 3.0  # a constant keeps its real value
        assert sim.summary()["stand_ins"]


def test_autocast_cuda_runs_matmuls_in_half():
    with Simulation("1x8GB"):
        model = nn.Linear(64, 64).cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            y = model(torch.randn(4, 64, device="cuda"))
        assert y.dtype == torch.float16
        scaler = torch.amp.GradScaler("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(y.float().sum()).backward()
        scaler.step(opt)
        scaler.update()


def test_max_steps_stops_cleanly():
    from gpudoctor.simulate import SimulationStopped

    with Simulation("1x8GB", max_steps=2) as sim:
        model = nn.Linear(8, 8).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(SimulationStopped):
            for _ in range(10):
                model(torch.randn(2, 8, device="cuda")).sum().backward()
                opt.step()
        assert sim.optimizer_steps == 2 and sim.stopped


def test_oom_in_backward_is_raised_by_backward():
    with Simulation("1x1GB") as sim:
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(5)]).cuda()  # 320 MiB of fp32 weights
        loss = model(torch.randn(64, 4096, device="cuda")).sum()
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 64.00 MiB"):
            loss.backward()  # the gradients (another 320 MiB) do not fit in the ~540 MiB usable
        assert sim.summary()["devices"][0]["phase_peaks"]["backward"]["allocated"] > 320 * MiB


def test_bitsandbytes_4bit_storage_by_arithmetic():
    from types import SimpleNamespace

    from gpudoctor.simulate.quant import quantize

    with Simulation("1x8GB"):
        model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 4096, bias=False))
        config = SimpleNamespace(load_in_4bit=True, bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=torch.float16)
        assert "4-bit" in quantize(model, config)
        model.cuda()
        n = 4096 * 4096
        assert torch.cuda.memory_allocated() == 2 * (n // 2 + (n // 64) * 4)  # packed nibbles + fp32 absmax per 64
        out = model(torch.randn(2, 4096, device="cuda", requires_grad=True))
        assert out.dtype == torch.float32  # computed in fp16, returned in the input's dtype
        out.sum().backward()


def test_error_in_a_tensor_hook_during_backward_is_a_normal_exception():
    # inside the autograd engine on the virtual backend it would abort the process (C++ terminate)
    with Simulation("2x8GB"):
        w = nn.Parameter(torch.empty(8, 8, device="cuda:1"))

        def refuse(grad):
            raise ValueError("hook says no")

        w.register_hook(refuse)
        with pytest.raises(ValueError, match="hook says no"):
            (torch.ones(4, 8, device="cuda:1") @ w).sum().backward()
        (torch.ones(4, 8, device="cuda:1") @ nn.Parameter(torch.empty(8, 8, device="cuda:1"))).sum().backward()  # still usable


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@pytest.mark.parametrize("where", ["full_hook", "pre_hook", "non_full_hook", "global_full_hook", "function_node_hook",
                                   "autograd_grad"])
def test_error_in_a_backward_hook_is_a_normal_exception(where):
    """Module backward hooks (full, pre, non-full, global) and hooks on an autograd.Function's node: raised into the
    autograd engine on the virtual backend they would abort the process; here, as on a real GPU, backward raises."""
    from torch.nn.modules.module import register_module_full_backward_hook

    calls = []

    def refuse(*args):
        calls.append(where)
        raise ValueError("hook says no")

    with Simulation("2x8GB"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to("cuda:1")
        handle = {"full_hook": lambda: model[1].register_full_backward_hook(refuse),
                  "pre_hook": lambda: model[1].register_full_backward_pre_hook(refuse),
                  "non_full_hook": lambda: model[1].register_backward_hook(refuse),
                  "global_full_hook": lambda: register_module_full_backward_hook(refuse),
                  }.get(where, lambda: None)()
        x = torch.ones(4, 8, device="cuda:1", requires_grad=True)
        with pytest.warns(FutureWarning) if where == "non_full_hook" else contextlib.nullcontext():
            out = model(x)
        if where == "function_node_hook":
            out = _Double.apply(out)
            out.grad_fn.register_hook(refuse)
        with pytest.raises(ValueError, match="hook says no"):
            if where == "autograd_grad":
                out.register_hook(refuse)
                torch.autograd.grad(out.sum(), x)
            else:
                out.sum().backward()
        assert len(calls) == 1  # a real backward stops at the error: no later hook runs
        if handle is not None:
            handle.remove()
        model(x).sum().backward()  # the simulation goes on


def test_data_parallel_replicates_the_weights_on_every_card():
    n = 1024 * 1024 * 4  # one fp32 1024x1024 weight
    with Simulation("3x8GB"):
        dp = nn.DataParallel(nn.Linear(1024, 1024, bias=False).cuda())
        out = dp(torch.randn(16, 1024).cuda())
        assert out.shape == (16, 1024) and out.device.index == 0
        assert torch.cuda.memory_allocated(1) == torch.cuda.memory_allocated(2) == n  # a replica each
        assert torch.cuda.memory_allocated(0) >= n + 16 * 1024 * 4
        out.sum().backward()
        dp(torch.randn(16, 1024).cuda())  # the next forward's replicas replace the previous ones
        assert torch.cuda.memory_allocated(1) == n
