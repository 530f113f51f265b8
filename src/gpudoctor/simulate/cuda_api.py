"""The ``torch.cuda`` functions a script may call, answered for the simulated cards."""

from __future__ import annotations

import contextlib
import types

import torch

from gpudoctor.simulate import devices


class _NoOpEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NoOpStream(_NoOpEvent):
    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cuda", devices.index_of(device))

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NoOpEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def functions(sim) -> dict:
    cards = sim.cards
    allocs = sim.allocators

    def alloc(device=None):
        return allocs[devices.index_of(device)]

    def set_device(device):
        devices.State.current = devices.index_of(device)

    class device_ctx:  # torch.cuda.device(i)
        def __init__(self, device):
            self.index = devices.index_of(device)

        def __enter__(self):
            self.prev, devices.State.current = devices.State.current, self.index

        def __exit__(self, *exc):
            devices.State.current = self.prev

    def properties(device=None):
        index = devices.index_of(device)
        card = cards[index]
        major, minor = _capability(card)
        return types.SimpleNamespace(name=f"NVIDIA {card.name} (simulated by gpudoctor)", total_memory=card.total,
                                     major=major, minor=minor, multi_processor_count=80, is_integrated=False,
                                     is_multi_gpu_board=False, uuid=f"simulated-{index}", L2_cache_size=40 << 20)

    def reset_peaks(device=None):
        alloc(device).reset_peaks()

    def empty_cache():
        for a in allocs:
            a.release_cached()

    def memory_stats(device=None):
        a = alloc(device)
        return {"allocated_bytes.all.current": a.allocated, "allocated_bytes.all.peak": a.peak_allocated,
                "reserved_bytes.all.current": a.reserved, "reserved_bytes.all.peak": a.peak_reserved,
                "requested_bytes.all.current": a.requested, "num_alloc_retries": 0, "num_ooms": a.num_ooms}

    def memory_summary(device=None, abbreviated=False):
        a = alloc(device)
        return (f"simulated {cards[a.index].name} cuda:{a.index}: allocated {a.allocated} B (peak {a.peak_allocated}), "
                f"reserved {a.reserved} B (peak {a.peak_reserved})")

    noop = lambda *a, **k: None  # noqa: E731
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": noop,
        "device_count": lambda: len(cards),
        "current_device": lambda: devices.State.current,
        "set_device": set_device,
        "device": device_ctx,
        "get_device_name": lambda device=None: properties(device).name,
        "get_device_properties": properties,
        "get_device_capability": lambda device=None: _capability(cards[devices.index_of(device)]),
        "is_bf16_supported": lambda including_emulation=True: cards[devices.State.current].bf16,
        "mem_get_info": lambda device=None: (alloc(device).free, cards[devices.index_of(device)].total),
        "memory_allocated": lambda device=None: alloc(device).allocated,
        "memory_reserved": lambda device=None: alloc(device).reserved,
        "max_memory_allocated": lambda device=None: alloc(device).peak_allocated,
        "max_memory_reserved": lambda device=None: alloc(device).peak_reserved,
        "memory_cached": lambda device=None: alloc(device).reserved,
        "reset_peak_memory_stats": reset_peaks,
        "reset_max_memory_allocated": reset_peaks,
        "reset_max_memory_cached": reset_peaks,
        "reset_accumulated_memory_stats": noop,
        "memory_stats": memory_stats,
        "memory_summary": memory_summary,
        "empty_cache": empty_cache,
        "synchronize": noop,
        "ipc_collect": noop,
        "manual_seed": noop,
        "manual_seed_all": noop,
        "seed": noop,
        "seed_all": noop,
        "set_per_process_memory_fraction": noop,
        "Event": _NoOpEvent,
        "Stream": _NoOpStream,
        "current_stream": lambda device=None: _NoOpStream(device),
        "default_stream": lambda device=None: _NoOpStream(device),
        "stream": lambda stream=None: contextlib.nullcontext(),
        "nvtx": types.SimpleNamespace(range_push=noop, range_pop=noop, mark=noop, range=lambda *a, **k: contextlib.nullcontext()),
    }


def _capability(card) -> tuple[int, int]:
    from gpudoctor.simulate.session import _ARCH_CAPABILITY

    return _ARCH_CAPABILITY.get(card.arch, (8, 0))
