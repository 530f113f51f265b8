"""Virtual GPUs for testing on a CPU-only machine.

``gpu:0`` / ``gpu:1`` are PyTorch's PrivateUse1 key registered as a Python backend named ``gpu``,
used under ``FakeTensorMode``: tensors carry shape, dtype and device but no data, and mixing
devices raises PyTorch's real message (``Expected all tensors to be on the same device ...``).

    from gpudoctor.virtual import VirtualGPUs, fake_place
    with VirtualGPUs(memory_cap="64MiB") as vg:
        fake_place(model, {"model.layers.0": "gpu:0", "model.layers.1": "gpu:1"})
        model(input_ids)

Limits (torch 2.13, measured):

* Backward through ``gpu:1`` works only because ``VirtualGPUs`` turns autograd multithreading off:
  the Python device guard reports ``deviceCount() == 1`` (hard-coded in torch/csrc/acc/Module.cpp),
  so the engine has one device queue and asserts on index 1. With multithreading off every node
  runs on the calling thread's CPU queue, whatever its device.
* ``Module.to("gpu:N")`` fails on fake parameters (swap_tensors path); use :func:`fake_place`.
* ``torch.tensor(data, device="gpu:0")`` is not intercepted by fake mode (HF's DynamicCache does
  this): call HF models with ``use_cache=False``.
* ``generate()`` needs data (``.item()``) and cannot run.
* Never use fake ``cuda`` devices in a CPU build: the process aborts (C++ terminate).
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

BACKEND_NAME = "gpu"
DEVICE_COUNT = 2

_lock = threading.Lock()


class _BackendModule:
    """What ``torch.gpu`` answers; ``nn.DataParallel`` and accelerate read ``device_count``."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def device_count(self) -> int:
        return DEVICE_COUNT

    def synchronize(self, device=None) -> None:
        pass

    def get_amp_supported_dtype(self) -> list:  # torch.autocast on the backend (gpudoctor.simulate)
        return [torch.float16, torch.bfloat16]


def ensure_backend() -> str:
    """Register the ``gpu`` PrivateUse1 backend once per process; return its name.

    Registration is process-global and can't be undone, so a process that already renamed
    PrivateUse1 to something else can't host virtual GPUs.
    """
    with _lock:
        current = torch._C._get_privateuse1_backend_name()
        if current == BACKEND_NAME:
            return BACKEND_NAME
        if current != "privateuseone":
            raise RuntimeError(f"PrivateUse1 is already registered as {current!r}; virtual GPUs need it")
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(rename=BACKEND_NAME, backend_module=_BackendModule())
        _hide_from_torch_accelerator_when_closed()
        return BACKEND_NAME


_open_contexts = 0  # VirtualGPUs contexts now open: only inside one is the virtual backend the machine's accelerator


def _hide_from_torch_accelerator_when_closed() -> None:
    """Once registered, PrivateUse1 is what ``torch.accelerator.current_accelerator()`` reports for the rest of the
    process, and accelerate 1.16 picks its device there (``Accelerator()`` would then train on ``gpu`` outside fake
    mode and fail). Outside a :class:`VirtualGPUs` context the process is the CPU-only machine it is: report no
    accelerator there, as before the registration. (gpudoctor.simulate's session shows ``cuda`` by itself.)"""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return
    reported = accelerator.current_accelerator

    def current_accelerator(check_available: bool = False):
        device = reported(check_available)
        if device is not None and device.type == BACKEND_NAME and not _open_contexts:
            return None
        return device

    accelerator.current_accelerator = current_accelerator


_SIZE_RE = re.compile(r"^\s*([\d.]+)\s*([KMGT]?i?B)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = _SIZE_RE.match(size)
    if not match:
        raise ValueError(f"not a size: {size!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


@dataclass
class _DeviceLedger:
    live: list = field(default_factory=list)  # (StorageWeakRef, nbytes)
    peak: int = 0

    def allocated(self) -> int:
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        return sum(n for _, n in self.live)


class MemoryCapMode(TorchDispatchMode):
    """Counts the bytes of live storages per virtual device and raises a CUDA-style OOM past a cap.

    The message follows the current CUDA caching-allocator text, so the OOM parser and report
    see exactly what a real ``torch.OutOfMemoryError`` carries (nothing is "reserved but
    unallocated" here: there is no caching allocator to fragment).
    """

    def __init__(self, cap_bytes: int):
        super().__init__()
        self.cap_bytes = cap_bytes
        self.ledgers: dict[str, _DeviceLedger] = {}

    def track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != BACKEND_NAME:
            return
        storage = tensor.untyped_storage()
        ledger = self.ledgers.setdefault(str(tensor.device), _DeviceLedger())
        ref = StorageWeakRef(storage)
        if any(ref.cdata == known.cdata for known, _ in ledger.live):
            return
        ledger.live.append((ref, storage.nbytes()))
        ledger.peak = max(ledger.peak, ledger.allocated())

    def memory_allocated(self, device: str) -> int:
        ledger = self.ledgers.get(str(torch.device(device)))
        return ledger.allocated() if ledger else 0

    def max_memory_allocated(self, device: str) -> int:
        ledger = self.ledgers.get(str(torch.device(device)))
        return ledger.peak if ledger else 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._schema.is_mutable or func.is_view:
            return out
        for tensor in _tensors_in(out):
            if tensor.device.type != BACKEND_NAME:
                continue
            ledger = self.ledgers.setdefault(str(tensor.device), _DeviceLedger())
            request = tensor.untyped_storage().nbytes()
            in_use = ledger.allocated()
            if in_use + request > self.cap_bytes:
                raise torch.OutOfMemoryError(_cuda_oom_message(tensor.device.index or 0, request, self.cap_bytes, in_use))
            self.track(tensor)
        return out


def _cuda_oom_message(index: int, request: int, total: int, in_use: int) -> str:
    free = max(total - in_use, 0)
    return (
        f"CUDA out of memory. Tried to allocate {_oom_size(request)}. GPU {index} has a total capacity of "
        f"{_oom_size(total)} of which {_oom_size(free)} is free. Including non-PyTorch memory, this process has "
        f"{_oom_size(in_use)} memory in use. Of the allocated memory {_oom_size(in_use)} is allocated by PyTorch, "
        f"and 0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        f"setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
        f"for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def _oom_size(n: int) -> str:
    # CUDACachingAllocator's format_size: bytes, KiB, MiB, GiB with two decimals
    if n <= 1024:
        return f"{n} bytes"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30)):
        if n < scale * 1024 or unit == "GiB":
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"  # pragma: no cover


def _tensors_in(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


@contextlib.contextmanager
def _virtual_accelerator_shown() -> Iterator[None]:
    """The virtual backend as the machine's accelerator, with a ``torch.accelerator.empty_cache()`` that does
    nothing for it: accelerate 1.16 empties the cache through ``torch.accelerator`` after each tensor it places on
    an accelerator (``set_module_tensor_to_device`` -> ``clear_device_cache``), and the virtual backend has no
    caching allocator, so torch's call fails an internal assert ("Allocator for gpu is not a DeviceAllocator").
    On a real GPU it only hands cached blocks back to the driver, which nothing here observes."""
    global _open_contexts
    accelerator = getattr(torch, "accelerator", None)
    original = getattr(accelerator, "empty_cache", None)

    def empty_cache() -> None:
        current = accelerator.current_accelerator()
        if current is not None and current.type == BACKEND_NAME:
            return
        original()

    with _lock:
        _open_contexts += 1
        if original is not None:
            accelerator.empty_cache = empty_cache
    try:
        yield
    finally:
        with _lock:
            _open_contexts -= 1
            if original is not None:
                accelerator.empty_cache = original


class VirtualGPUs:
    """Context manager: fake mode over ``gpu:0..gpu:{DEVICE_COUNT-1}``, optional per-device memory cap."""

    def __init__(self, memory_cap: int | str | None = None):
        self.memory_cap = parse_size(memory_cap) if memory_cap is not None else None
        self.fake_mode: FakeTensorMode | None = None
        self.cap_mode: MemoryCapMode | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "VirtualGPUs":
        ensure_backend()
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._stack.enter_context(self.fake_mode)
        # see module docstring: the only way autograd runs nodes on gpu:1
        self._stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        if self.memory_cap is not None:
            self.cap_mode = MemoryCapMode(self.memory_cap)
            self._stack.enter_context(self.cap_mode)
        self._stack.enter_context(_virtual_accelerator_shown())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def memory_allocated(self, device: str) -> int:
        return self.cap_mode.memory_allocated(device) if self.cap_mode else 0

    def max_memory_allocated(self, device: str) -> int:
        return self.cap_mode.max_memory_allocated(device) if self.cap_mode else 0


def _device_for(path: str, placement: str | torch.device | Mapping[str, str | int | torch.device]):
    if not isinstance(placement, Mapping):
        return placement
    best, best_len = None, -1
    for prefix, device in placement.items():
        if (prefix == "" or path == prefix or path.startswith(prefix + ".")) and len(prefix) > best_len:
            best, best_len = device, len(prefix)
    return best


def fake_place(module: nn.Module, placement: str | torch.device | Mapping[str, str | int | torch.device]) -> nn.Module:
    """Re-create parameters and buffers on their target devices (``Module.to`` can't move fake params).

    ``placement`` is one device or a device map ``{module path: device}`` (longest prefix wins; paths
    absent from the map stay where they are). Must run inside :class:`VirtualGPUs`. The parameter
    objects are replaced, so build optimizers afterwards.
    """
    cap_mode = _active_cap_mode()
    placed: dict[tuple[int, str], nn.Parameter] = {}  # shared (tied) parameters stay shared on one device
    originals: list[nn.Parameter] = []
    for path, sub in module.named_modules(remove_duplicate=False):
        device = _device_for(path, placement)
        if device is None:
            continue
        for name, param in list(sub._parameters.items()):
            if param is not None:
                key = (id(param), str(device))
                if key in placed:
                    sub._parameters[name] = placed[key]
                    continue
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                placed[key] = placed[(id(new), str(device))] = new
                originals.append(param)  # alive until the end, so no other object reuses its id
                sub._parameters[name] = new
                if cap_mode is not None:
                    cap_mode.track(new)
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = torch.empty_like(buf, device=device)
                if cap_mode is not None:
                    cap_mode.track(sub._buffers[name])
    return module


def _active_cap_mode() -> MemoryCapMode | None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, MemoryCapMode):
            return mode
    return None


def dispatch(model: nn.Module, device_map: Mapping[str, str], **dispatch_kwargs) -> nn.Module:
    """``accelerate.dispatch_model`` over virtual GPUs: place each entry, then attach the real hooks.

    Only resident maps (``gpu:N`` entries) are supported: offload needs real weights, so tests use
    real ``cpu``/``disk`` offload on CPU for those cases.
    """
    from accelerate import dispatch_model

    fake_place(model, device_map)
    return dispatch_model(model, device_map=dict(device_map), **dispatch_kwargs)


__all__ = ["VirtualGPUs", "MemoryCapMode", "fake_place", "dispatch", "ensure_backend", "parse_size", "format_bytes", "BACKEND_NAME"]
